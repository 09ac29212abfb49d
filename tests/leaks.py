"""'Nothing of shmseq is left': shared memory, semaphores, child processes, threads."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

SHM_DIR = "/dev/shm"


def shm_entries() -> set[str]:
    """Entries of /dev/shm that shmseq could have made (segments and named semaphores)."""
    return {name for name in os.listdir(SHM_DIR) if "shmseq" in name}


def shmseq_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shmseq-")]


def live_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("shmseq-")]


def leftovers(before: set[str] = frozenset(), grace: float = 5.0) -> dict:
    """What is still there after ``grace`` seconds; empty when everything was cleaned."""
    deadline = time.monotonic() + grace
    while True:
        found = {"shm": sorted(shm_entries() - set(before)), "threads": shmseq_threads(),
                 "children": [p.pid for p in live_children()]}
        if not any(found.values()) or time.monotonic() > deadline:
            return {key: value for key, value in found.items() if value}
        time.sleep(0.05)


def assert_nothing_left(before: set[str] = frozenset(), grace: float = 5.0) -> None:
    left = leftovers(before, grace)
    assert not left, f"shmseq left resources behind: {left}"
