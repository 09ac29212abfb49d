"""'Nothing of shmseq is left': shared memory, mappings, child processes, threads.

Only what this test process (or one of its children) made is counted: segment names carry
their creator's pid, so another shmseq run on the same machine cannot fail the suite. Checks
look before any garbage collection: a resource that only the cyclic collector frees is a
leak for a user with a small /dev/shm.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

from shmseq.bench.memory import children

SHM_DIR = "/dev/shm"
PREFIX = "shmseq-"
BOARD = "-board-"


def made_by(name: str, pids: set[int]) -> bool:
    """Whether a segment name (``shmseq-PID-...``) carries one of ``pids``."""
    if not name.startswith(PREFIX):
        return False
    creator = name[len(PREFIX):].split("-", 1)[0]
    return creator.isdigit() and int(creator) in pids


def shm_entries(pids: set[int] | None = None) -> set[str]:
    """Segments in /dev/shm made by this process (or ``pids``)."""
    pids = {os.getpid()} | children() if pids is None else pids
    return {name for name in os.listdir(SHM_DIR) if made_by(name, pids)}


def mapped_rings(pid: int | str = "self", made_in: set[int] | None = None) -> dict[str, int]:
    """Rings mapped in process ``pid``: segment name -> bytes mapped (by default only rings
    made by this test process)."""
    return {name: size for name, size in mapped_segments(pid, made_in).items()
            if BOARD not in name}


def mapped_segments(pid: int | str = "self", made_in: set[int] | None = None) -> dict[str, int]:
    """shmseq segments mapped in process ``pid``, rings and the pools' boards (board.py)."""
    made_in = {os.getpid()} if made_in is None else made_in
    sizes: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return sizes
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(f"{SHM_DIR}/{PREFIX}"):
            continue
        name = fields[5][len(SHM_DIR) + 1:].split()[0]
        if made_by(name, made_in):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            sizes[name] = sizes.get(name, 0) + end - start
    return sizes


def holders(name: str) -> set[int]:
    """The processes (this one and its children) that map segment ``name`` or hold a descriptor
    of it: the kernel frees its pages once there is none."""
    found = set()
    for pid in {os.getpid()} | children():
        if name in mapped_segments(pid):
            found.add(pid)
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(f"{SHM_DIR}/{name}"):
                found.add(pid)
                break
    return found


def shmseq_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shmseq-")]


def live_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("shmseq-")]


def leftovers(before: set[str] = frozenset(), grace: float = 5.0) -> dict:
    """What is still there after ``grace`` seconds; empty when everything was released."""
    deadline = time.monotonic() + grace
    while True:
        found = {"shm": sorted(shm_entries() - set(before)), "mapped": mapped_segments(),
                 "threads": shmseq_threads(), "children": [p.pid for p in live_children()]}
        if not any(found.values()) or time.monotonic() > deadline:
            return {key: value for key, value in found.items() if value}
        time.sleep(0.05)


def assert_nothing_left(before: set[str] = frozenset(), grace: float = 5.0) -> None:
    left = leftovers(before, grace)
    assert not left, f"shmseq left resources behind: {left}"
