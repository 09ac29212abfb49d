import pytest

from leaks import assert_nothing_left, shm_entries


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no segment, mapping, child process or thread of shmseq, without
    help from the garbage collector (see leaks.py)."""
    before = shm_entries()
    yield
    assert_nothing_left(before)
