import gc

import pytest

from leaks import assert_nothing_left, shm_entries


def pytest_collection_finish(session):
    """Collecting imports torch, transformers and the rest: some 450,000 objects that live as
    long as the session, which every full collection walks again (0.3 s each; the side-by-side
    torch tests collect before each of shmseq's runs, the gc fixtures before each test).
    Frozen, a collection walks only what the tests made, the only objects a check looks at."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no segment, mapping, child process or thread of shmseq, without
    help from the garbage collector (see leaks.py)."""
    before = shm_entries()
    yield
    assert_nothing_left(before)
