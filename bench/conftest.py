"""Stage benchmarks: every test must leave /dev/shm as it found it (segments of this process)."""
import os

import pytest

SHM_DIR = "/dev/shm"


def _our_entries() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(f"shmseq-{os.getpid()}-")}


@pytest.fixture(autouse=True)
def shm_left_clean():
    before = _our_entries()
    yield
    left = _our_entries() - before
    assert not left, f"left in {SHM_DIR}: {sorted(left)}"
