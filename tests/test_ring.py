import gc

import numpy as np
import posix_ipc
import pytest

from shmseq.errors import SharedMemoryFull
from shmseq.ring import Ring, RingSpec
import shmseq.ring as ring_module

from leaks import shm_entries


@pytest.fixture
def ring():
    ring = Ring.create(3, 10_000)
    yield ring
    ring.unlink()
    ring.close()


def test_slots_are_page_aligned_and_disjoint(ring):
    assert ring.spec.stride % 4096 == 0 and ring.spec.stride >= 10_000
    ring.region(0)[:] = 1
    ring.region(1)[:] = 2
    assert ring.region(0).max() == 1 and ring.region(1).min() == 2


def test_attach_sees_the_same_bytes_and_unlink_removes_the_name(ring):
    other = Ring.attach(ring.spec)
    other.region(2)[:4] = [1, 2, 3, 4]
    assert ring.region(2)[:4].tolist() == [1, 2, 3, 4]
    ring.unlink()
    assert ring.spec.name[1:] not in shm_entries()
    ring.region(2)[0] = 9  # mappings outlive the name
    assert other.region(2)[0] == 9
    other.close()


def test_a_lease_returns_its_slot_when_the_last_view_dies(ring):
    returned = []
    ring.on_release = returned.append
    lease = ring.lease(1)
    view = np.ndarray((4,), np.int64, buffer=lease, offset=64)[1:]
    ring.held[1] = True
    del lease
    gc.collect()
    assert returned == [] and ring.held_count() == 1
    del view
    assert returned == [1] and ring.held_count() == 0


def test_a_slot_cannot_be_leased_twice(ring):
    lease = ring.lease(0)
    with pytest.raises(RuntimeError, match="leased twice"):
        ring.lease(0)
    del lease
    ring.lease(0)


def test_close_with_live_views_keeps_them_valid(ring):
    view = ring.lease(0)
    view[:3] = 7
    ring.unlink()
    ring.close()
    assert view[:3].tolist() == [7, 7, 7]


def test_refuses_a_ring_larger_than_dev_shm(monkeypatch):
    before = shm_entries()
    monkeypatch.setattr(ring_module, "shm_free_bytes", lambda: 64 << 20)
    with pytest.raises(SharedMemoryFull, match=r"--shm-size.*buffer or slot_bytes"):
        Ring.create(10, 40 << 20)
    assert shm_entries() <= before


def test_attach_to_a_missing_ring_fails():
    with pytest.raises(posix_ipc.ExistentialError):
        Ring.attach(RingSpec("/shmseq-missing", 1, 10))
