import gc
import os
import threading
import time

import numpy as np
import pytest

import shmseq.engine.common.segments as segments_module
from shmseq.engine.common.errors import SharedMemoryFull, ShmSeqError
from shmseq.engine.trainer.ring import COPYING, DISPATCHED, FREE, LEASED, WRITTEN, IllegalTransition, Ring
from shmseq.engine.common.segments import WorkerRing
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
    return [ring.state(slot) for slot in range(ring.spec.n_slots)]


def test_slots_are_page_aligned_and_disjoint(ring):
    assert ring.spec.stride % 4096 == 0 and ring.spec.stride >= 10_000
    ring.region(0)[:] = 1
    ring.region(1)[:] = 2
    assert ring.region(0).max() == 1 and ring.region(1).min() == 2


def test_a_worker_sees_the_same_bytes_and_the_name_is_never_left_in_dev_shm(ring):
    assert ring.spec.name[1:] not in shm_entries()
    other = WorkerRing(ring.spec)
    other.region(2)[:4] = [1, 2, 3, 4]
    assert ring.region(2)[:4].tolist() == [1, 2, 3, 4]
    ring.region(2)[0] = 9
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


def test_slots_owed_to_batches_built_before_the_ring_are_kept_for_them(ring):
    ring.owe(2)
    assert ring.free_count() == 1  # of 3 slots, 2 are kept
    first = ring.acquire()
    assert ring.free_count() == 0
    placed = ring.acquire_owed()
    assert placed not in (None, first) and ring.free_count() == 0
    ring.unused(None)  # the other came back without a slot: its slot goes to new tasks
    assert ring.free_count() == 1 and ring.acquire() not in (None, first, placed)


def test_the_consumer_keeps_batches_in_place_until_it_would_hold_every_slot(ring):
    leases = {slot: ring.lease(slot) for slot in [written(ring) for _ in range(3)]}
    assert [ring.keep_in_place(slot) for slot in leases] == [True, True, False]
    leases.clear()  # the consumer dropped them: no longer held, once collected
    slot = written(ring)
    lease = ring.lease(slot)
    assert ring.keep_in_place(slot)
    del lease


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


def test_a_fence_is_taken_by_the_consumers_next_collect_after_the_last_view_died(ring):
    """The consumer's thread takes it (on its current stream), not the thread that dropped the
    view: a lease's death runs no Python code, where a Ctrl-C would be lost."""
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
    assert taken == [] and ring.has_news()
    assert states(ring)[slot] is COPYING and taken == [threading.current_thread().name]
    done.set()
    ring.finish_copies()
    assert states(ring)[slot] is FREE


def test_a_lease_dies_without_running_python_code(ring):
    """A KeyboardInterrupt can only be raised where Python code runs: none may run when the
    last view of a batch dies, or the interrupt is printed as "Exception ignored" and lost."""
    import sys
    slot = written(ring)
    lease = ring.lease(slot)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append((event, frame.f_code.co_name))
                   if event == "call" else None)
    try:
        del lease
    finally:
        sys.setprofile(None)
    assert calls == [] and states(ring)[slot] is FREE


def test_a_failed_fence_is_raised_once_and_the_slot_stays_leased(ring):
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access")

    ring.fence = broken
    slot = written(ring)
    lease = ring.lease(slot)
    del lease
    with pytest.raises(ShmSeqError, match=f"fencing the copies out of slot {slot} failed") as info:
        ring.collect()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert states(ring)[slot] is LEASED and not ring.has_news()


def test_a_report_interrupted_before_it_is_forgotten_is_not_applied_twice(ring):
    """A Ctrl-C between applying a lease's death and forgetting the report leaves the report
    behind: the next collect finds it stale instead of freeing the slot a second time."""
    slot = written(ring)
    lease = ring.lease(slot)
    del lease
    stale = dict(ring._died)  # a seam: no test can time an interrupt between the two steps
    ring.collect()
    again = ring.acquire()
    assert again == slot
    ring.written(slot)
    lease = ring.lease(slot)
    ring._died.update(stale)  # the report an interrupt left behind
    assert states(ring)[slot] is LEASED
    del lease
    assert states(ring)[slot] is FREE and ring.count(FREE) == 3


def test_closing_with_reports_pending_after_a_failed_reservation_returns(monkeypatch):
    """/dev/shm taken by another program after the up-front check: the reservation fails, and
    closing the ring with leases' deaths still to collect must not spin on that failure."""
    stride = 1 << 20
    monkeypatch.setattr(os, "posix_fallocate", fallocate_refusing_from(2 * stride))
    ring = Ring.create(4, stride, wake=lambda: None)
    with pytest.raises(SharedMemoryFull):
        ring.wait_reserved()
    lease = ring.lease(written(ring))
    del lease
    closer = threading.Thread(target=ring.close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "close() spins on the reservation's failure"


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
    steps = {FREE: [], DISPATCHED: ["acquire"], WRITTEN: ["acquire", "written"],
             LEASED: ["acquire", "written", "lease"]}[state]
    slot, lease = 0, None
    for step in steps:
        result = getattr(ring, step)() if step == "acquire" else getattr(ring, step)(slot)
        lease = result if step == "lease" else lease
    assert ring.state(slot) is state
    with pytest.raises(IllegalTransition, match=f"slot 0 is {state.value}"):
        getattr(ring, move)(slot)


def test_a_copy_is_tracked_only_on_a_leased_slot(ring):
    slot = written(ring)
    with pytest.raises(IllegalTransition, match="only a leased slot"):
        ring.track_copy(slot, lambda: None)


def test_acquire_hands_out_each_free_slot_once(ring):
    slots = [ring.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and ring.acquire() is None
    ring.unused(slots[1])
    assert ring.acquire() == slots[1]


def test_acquire_free_hands_out_every_free_slot_not_owed_and_unsent_ones_come_back(ring):
    ring.owe(1)
    slots = ring.acquire_free()
    assert len(slots) == 2 and ring.acquire_free() == [] and ring.free_count() == 0
    ring.unsent(slots)
    assert ring.acquire_free() == slots  # in the order they were given


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
    monkeypatch.setattr(segments_module, "shm_free_bytes", lambda: 64 << 20)
    with pytest.raises(SharedMemoryFull, match=r"--shm-size=...\), or lower buffer or slot_bytes"):
        Ring.create(10, 40 << 20, wake=lambda: None)
    assert shm_entries() <= before


def test_attach_to_a_closed_ring_fails():
    ring = Ring.create(1, 10, wake=lambda: None)
    ring.close()
    with pytest.raises(OSError):
        WorkerRing(ring.spec)


def allocated_bytes(ring) -> int:
    return os.fstat(ring.spec.owner_fd).st_blocks * 512


def test_the_ring_is_reserved_once_wait_reserved_returns():
    ring = Ring.create(4, 1 << 20, wake=lambda: None)
    try:
        ring.wait_reserved()
        assert allocated_bytes(ring) == ring.spec.total_bytes
    finally:
        ring.close()


def fallocate_refusing_from(offset: int):
    """``os.posix_fallocate`` as /dev/shm does when it has no room from ``offset`` on."""
    real = os.posix_fallocate

    def fallocate(fd, start, size):
        if start + size > offset:
            raise OSError(28, "No space left on device")
        real(fd, start, size)
    return fallocate


def test_a_reservation_that_fails_says_what_was_missing_and_is_raised_at_the_next_step(monkeypatch):
    stride = 1 << 20
    monkeypatch.setattr(os, "posix_fallocate", fallocate_refusing_from(2 * stride))
    ring = Ring.create(5, stride, wake=lambda: None)
    try:
        with pytest.raises(SharedMemoryFull, match=rf"the slot ring \(5 slots of {stride:,} bytes; "
                           rf"2 reserved\) needs {3 * stride:,} bytes.*missing"):
            ring.wait_reserved()
        with pytest.raises(SharedMemoryFull):
            ring.collect()
    finally:
        ring.close()


def refusing_once_a_batch_came(delivered: threading.Event):
    """``os.posix_fallocate`` as /dev/shm does once another program took it: the reservation's
    thread is refused its second slot on, once ``delivered`` is set (workers are not)."""
    real = os.posix_fallocate

    def fallocate(fd, start, size):
        if start and threading.current_thread().name == "shmseq-reservation":
            delivered.wait(10)
            raise OSError(28, "No space left on device")
        real(fd, start, size)
    return fallocate


def _full_after_a_batch(seq, delivered: threading.Event) -> bool:
    """Whether reading ``seq`` raised ``SharedMemoryFull`` once its first batch was in hand;
    the exception is dropped with the loop and the last batch it held."""
    try:
        with seq.start():
            for _ in seq:
                delivered.set()
    except SharedMemoryFull:
        return delivered.is_set()
    return False


@pytest.mark.parametrize("thread_type", ["proc", "thread"])
def test_a_reservation_failure_raised_mid_epoch_leaves_nothing_before_any_garbage_collection(
        monkeypatch, thread_type):
    """/dev/shm taken by another program once the ring passed its check: a ring sized by the
    first batches is reserved while they are delivered, and the failure is raised at a step of
    the loop. Kept anywhere, that exception would keep the frames it went through, with the
    loop's last batch, and so the ring's memory, until a garbage collection."""
    from shmseq import ShmSequence
    from workers import ImageWorker

    delivered = threading.Event()
    monkeypatch.setattr(os, "posix_fallocate", refusing_once_a_batch_came(delivered))
    seq = ShmSequence(ImageWorker(64), 400, batch_size=8, num_workers=2, buffer=4,
                      thread_type=thread_type, out_type="null", start_method="fork", timeout=30)
    gc.disable()
    try:
        assert _full_after_a_batch(seq, delivered)
        assert mapped_rings() == {} and shm_entries() == set()
    finally:
        gc.enable()


def test_the_space_held_by_a_finished_rings_views_is_named_until_they_die(monkeypatch):
    finished = Ring.create(2, 1 << 20, wake=lambda: None)
    finished.wait_reserved()
    view = finished.lease(written(finished))
    finished.close()
    monkeypatch.setattr(segments_module, "shm_free_bytes", lambda: 1 << 20)
    with pytest.raises(SharedMemoryFull, match=r"2,097,152 by a finished sequence's ring, kept by "
                       r"batches of it still referenced.*drop the batches of finished sequences, or lower"):
        Ring.create(4, 1 << 20, wake=lambda: None)
    del view
    with pytest.raises(SharedMemoryFull) as refused:
        Ring.create(4, 1 << 20, wake=lambda: None)
    assert "finished" not in str(refused.value)


class SmallShm:
    """A /dev/shm of ``size`` bytes, as ``os.posix_fallocate`` and the free-space check see it
    (slots are allocated a slot at a time)."""

    def __init__(self, size: int):
        self.size = size
        self.allocated: dict[tuple[int, int], int] = {}  # (inode, offset) -> bytes
        self._real = os.posix_fallocate

    def free(self) -> int:
        return self.size - sum(self.allocated.values())

    def fallocate(self, fd: int, start: int, size: int) -> None:
        key = (os.fstat(fd).st_ino, start)
        if key not in self.allocated and size > self.free():
            raise OSError(28, "No space left on device")
        self._real(fd, start, size)
        self.allocated[key] = size


def test_a_second_sequence_that_does_not_fit_is_refused_by_its_own_start(monkeypatch):
    """A validation loader opened mid-training in a 64 MiB /dev/shm: the training ring holds
    its 40 MiB from start() on, so the validation one is refused at once, never mid-epoch."""
    from shmseq import ShmSequence
    from workers import IndexWorker

    shm = SmallShm(64 << 20)
    monkeypatch.setattr(os, "posix_fallocate", shm.fallocate)
    monkeypatch.setattr(segments_module, "shm_free_bytes", shm.free)

    def sequence():
        return ShmSequence(IndexWorker, 80, batch_size=4, num_workers=2, thread_type="thread",
                           out_type="null", slot_bytes=10 << 20, buffer=4, timeout=30)
    train = sequence()
    with train.start():
        with pytest.raises(SharedMemoryFull, match=r"needs 41,[\d,]+ bytes .* \(16,[\d,]+ missing\): "
                           r"this process's shmseq rings hold 41,[\d,]+ bytes \(41,[\d,]+ by a live "
                           r"sequence's ring\)"):
            sequence().start()
        assert sum(1 for _ in train) == 20


def test_a_slot_dev_shm_cannot_allocate_is_refused_not_a_sigbus(monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", fallocate_refusing_from(0))
    ring = Ring.create(2, 1 << 20, wake=lambda: None)
    try:
        with pytest.raises(SharedMemoryFull, match="slot 1 of the ring needs .*--shm-size"):
            WorkerRing(ring.spec).region(1)
    finally:
        ring.close()


def test_a_ring_that_cannot_be_reserved_is_refused_by_start(monkeypatch):
    from shmseq import ShmSequence
    from workers import IndexWorker

    monkeypatch.setattr(os, "posix_fallocate", fallocate_refusing_from(0))
    seq = ShmSequence(IndexWorker, 40, batch_size=4, num_workers=1, out_type="null",
                      slot_bytes=1 << 16, start_method="fork", timeout=30)
    with pytest.raises(SharedMemoryFull, match="the slot ring .* needs"):
        seq.start()


def test_a_ring_error_is_a_shmseq_error():
    """What a user catches as shmseq's failures covers the ring's refusals too."""
    assert issubclass(IllegalTransition, ShmSeqError) and issubclass(SharedMemoryFull, ShmSeqError)
