import gc
import signal

import pytest

from leaks import assert_nothing_left, shm_entries


def pytest_configure(config):
    """Ctrl-C as a terminal sends it, whatever started the suite: a shell without job control
    starts a background command (``pytest &``) with SIGINT ignored, which Python keeps and every
    process it starts inherits, so the tests that send a Ctrl-C would see it lost. And the
    ``last`` marker."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "last: run after the other tests, what it leaves in the "
                                       "suite's process slowing every fork after it")


def pytest_collection_modifyitems(items):
    """Tests marked ``last`` run after the others, in their order: moto's S3 server leaves
    125 MB in the suite's process, whose page tables each later worker's fork copied (6-12 ms
    more a fork, 800 forks in the modules after test_remote)."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


@pytest.fixture(autouse=True, scope="module")
def long_lived_objects_frozen():
    """What lives on from collecting and from earlier modules (torch and the rest, then
    transformers' Trainer, moto's S3 backend and botocore's models: 200,000 to 450,000 objects)
    is frozen out of the garbage collector's walks: each full collection took 0.15-0.3 s in the
    suite's process, and the side-by-side torch tests collect before each of shmseq's runs, the
    gc fixtures before each test. A collection walks only what the module's tests made, all that
    a check looks at."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no segment, mapping, child process or thread of shmseq, without
    help from the garbage collector (see leaks.py)."""
    before = shm_entries()
    yield
    assert_nothing_left(before)
