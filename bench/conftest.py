"""Stage benchmarks: every test must leave /dev/shm as it found it."""
import os

import pytest

SHM_DIR = "/dev/shm"


def _shmseq_entries() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if "shmseq" in name}


@pytest.fixture(autouse=True)
def shm_left_clean():
    before = _shmseq_entries()
    yield
    left = _shmseq_entries() - before
    assert not left, f"left in {SHM_DIR}: {sorted(left)}"
