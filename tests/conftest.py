import gc

import pytest

from leaks import assert_nothing_left, shm_entries


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no segment, semaphore, child process or thread of shmseq."""
    before = shm_entries()
    yield
    gc.collect()
    assert_nothing_left(before)
