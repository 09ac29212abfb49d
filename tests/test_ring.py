import os
import threading
import time

import numpy as np
import posix_ipc
import pytest

import shmseq.ring as ring_module
from shmseq.errors import SharedMemoryFull, ShmSeqError
from shmseq.ring import (COPYING, DISPATCHED, FREE, LEASED, WRITTEN, IllegalTransition, Ring,
                         RingSpec, WorkerRing)
from leaks import mapped_rings, shm_entries


@pytest.fixture
def ring():
    ring = Ring.create(3, 10_000, wake=lambda: None)
    yield ring
    ring.close()


def written(ring) -> int:
    slot = ring.acquire()
    ring.written(slot)
    return slot


def states(ring) -> list:
    ring.collect()
    return list(ring._states)


def test_slots_are_page_aligned_and_disjoint(ring):
    assert ring.spec.stride % 4096 == 0 and ring.spec.stride >= 10_000
    ring.region(0)[:] = 1
    ring.region(1)[:] = 2
    assert ring.region(0).max() == 1 and ring.region(1).min() == 2


def test_a_worker_sees_the_same_bytes_and_unlink_removes_the_name(ring):
    other = WorkerRing(ring.spec)
    other.region(2)[:4] = [1, 2, 3, 4]
    assert ring.region(2)[:4].tolist() == [1, 2, 3, 4]
    ring.unlink()
    assert ring.spec.name[1:] not in shm_entries()
    ring.region(2)[0] = 9  # mappings outlive the name
    assert other.region(2)[0] == 9
    other.close()


def test_a_slot_goes_round_and_the_last_view_frees_it(ring):
    slot = written(ring)
    lease = ring.lease(slot)
    view = np.ndarray((4,), np.int64, buffer=lease, offset=64)[1:]
    del lease
    assert states(ring)[slot] is LEASED
    del view
    assert states(ring)[slot] is FREE and ring.count(FREE) == 3


def test_a_copy_keeps_the_slot_until_it_completes(ring):
    slot = written(ring)
    done = threading.Event()
    lease = ring.lease(slot)
    ring.track_copy(slot, done.wait)
    del lease
    assert states(ring)[slot] is COPYING
    done.set()
    ring.finish_copies()
    assert states(ring)[slot] is FREE


def test_a_fence_is_taken_when_the_last_view_dies_in_its_thread(ring):
    taken, done = [], threading.Event()

    def fence():
        taken.append(threading.current_thread().name)
        return done.wait

    ring.fence = fence
    slot = written(ring)
    holder = [ring.lease(slot)]
    dropper = threading.Thread(target=holder.clear, name="dropper")
    dropper.start()
    dropper.join()
    assert taken == ["dropper"] and states(ring)[slot] is COPYING
    done.set()
    ring.finish_copies()
    assert states(ring)[slot] is FREE


def test_a_failed_copy_is_raised_with_its_cause(ring):
    def sticky():
        raise RuntimeError("CUDA error: misaligned address")

    slot = written(ring)
    lease = ring.lease(slot)
    ring.track_copy(slot, sticky)
    del lease
    assert states(ring)[slot] is COPYING
    deadline = time.monotonic() + 5
    while not ring.has_news() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ShmSeqError, match=f"copy out of slot {slot} failed") as info:
        ring.collect()
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("move, state", [
    ("written", FREE), ("lease", FREE), ("lease", DISPATCHED), ("discard", DISPATCHED),
    ("unused", WRITTEN), ("lease", LEASED), ("discard", LEASED), ("unused", LEASED)])
def test_a_move_from_the_wrong_state_raises(ring, move, state):
    slot = 0
    ring._free.remove(slot)
    ring._states[slot] = state
    with pytest.raises(IllegalTransition, match=f"slot 0 is {state.value}"):
        getattr(ring, move)(slot)
    ring._states[slot] = FREE
    ring._free.append(slot)


def test_a_copy_is_tracked_only_on_a_leased_slot(ring):
    slot = written(ring)
    with pytest.raises(IllegalTransition, match="only a leased slot"):
        ring.track_copy(slot, lambda: None)


def test_acquire_hands_out_each_free_slot_once(ring):
    slots = [ring.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and ring.acquire() is None
    ring.unused(slots[1])
    assert ring.acquire() == slots[1]


def test_close_with_live_views_unmaps_when_the_last_dies():
    ring = Ring.create(2, 10_000, wake=lambda: None)
    view = ring.lease(written(ring))
    view[:3] = 7
    ring.close()
    assert view[:3].tolist() == [7, 7, 7] and ring.spec.name[1:] in mapped_rings()
    del view
    assert ring.spec.name[1:] not in mapped_rings()


def test_refuses_a_ring_larger_than_dev_shm(monkeypatch):
    before = shm_entries()
    monkeypatch.setattr(ring_module, "shm_free_bytes", lambda: 64 << 20)
    with pytest.raises(SharedMemoryFull, match=r"--shm-size.*buffer or slot_bytes"):
        Ring.create(10, 40 << 20, wake=lambda: None)
    assert shm_entries() <= before


def test_attach_to_a_missing_ring_fails():
    with pytest.raises(posix_ipc.ExistentialError):
        WorkerRing(RingSpec("/shmseq-missing", 1, 10))


def test_a_new_ring_removes_the_rings_of_consumers_killed_before_they_unlinked():
    import subprocess
    import sys

    from shmseq.lifeline import ProcessId
    from shmseq.ring import _pid_namespace, unlink_segment

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    started = ProcessId.of(child.pid).started
    child.wait()
    me = ProcessId.of(os.getpid())
    names = {"dead": f"/shmseq-{child.pid}-{started}-{_pid_namespace()}-left",
             "alive": f"/shmseq-{me.pid}-{me.started}-{_pid_namespace()}-mine",
             "elsewhere": f"/shmseq-{child.pid}-{started}-1-other-namespace"}
    for name in names.values():
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        Ring.create(1, 4096, wake=lambda: None).close()
        left = {key for key, name in names.items() if name[1:] in os.listdir("/dev/shm")}
        assert left == {"alive", "elsewhere"}
    finally:
        for name in names.values():
            unlink_segment(name)


def allocated_bytes(ring) -> int:
    return os.fstat(ring.spec.owner_fd).st_blocks * 512


def test_slots_are_allocated_as_they_are_first_written_not_all_at_start():
    ring = Ring.create(4, 1 << 20, wake=lambda: None)
    try:
        assert allocated_bytes(ring) == 0, "the first batch must not wait for the whole ring"
        worker = WorkerRing(ring.spec)
        worker.region(2)[:] = 7
        assert allocated_bytes(ring) == ring.spec.stride
        ring.region(0)[:1] = 1  # the consumer writes a slot too (the sizing probe's batch)
        assert allocated_bytes(ring) == 2 * ring.spec.stride
        ring.allocate_all()  # before page-locking
        assert allocated_bytes(ring) == ring.spec.total_bytes
        worker.close()
    finally:
        ring.close()


def test_a_slot_dev_shm_cannot_allocate_is_refused_not_a_sigbus(monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    ring = Ring.create(2, 1 << 20, wake=lambda: None)
    monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        with pytest.raises(SharedMemoryFull, match="--shm-size"):
            WorkerRing(ring.spec).region(1)
    finally:
        ring.close()


def test_a_worker_that_cannot_allocate_its_slot_says_so(monkeypatch):
    from shmseq import SharedMemoryFull, ShmSequence
    from workers import IndexWorker

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # forked workers inherit it
    seq = ShmSequence(IndexWorker, 40, batch_size=4, num_workers=1, out_type="null",
                      slot_bytes=1 << 16, start_method="fork", timeout=30)
    with seq.start():
        with pytest.raises(SharedMemoryFull, match="the slot ring needs"):
            next(iter(seq))
