"""The consumer's side of the workers (engine/trainer/pool.py), driven as the pipeline drives it:
the consumer's thread calls ``exchange`` at each of its steps, and reads each ``Reply`` it gets
(a batch in its slot, an encoded batch, an error, a batch that will never come).

Real worker processes (fork) and threads, a real ring, a real plan; the test plays the
consumer: it leases each reply's slot, reads the batch and drops the lease, as the converter
does (convert.py is not in the way, so a reply is checked as the pool makes it).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

from shmseq.engine.common.errors import WorkerDied, WorkerError
from shmseq.engine.common.layout import read_batch, slot_bytes_for
from shmseq.engine.trainer.deaths import brief, describe_exit, its_own_doing
from shmseq.engine.trainer.plan import BatchStream, EpochPlan, as_index_array
from shmseq.engine.trainer.pool import WorkerPool
from shmseq.engine.trainer.ring import WRITTEN, Ring
from shmseq.engine.trainer.stats import LoaderStats
from shmseq.engine.trainer.waker import Waker
from jobs import running
from workers import Crash, FailingInit, Hang, IndexWorker, KillOnce, SizedWorker, TypeErrorAt

BATCH = 4
WAIT_S = 30  # the most a test waits for its workers; never reached when the pool works


class Informed:
    """Tells who built the batch: the worker's id, its ``num_workers`` and seed
    (``get_worker_info()``), its process id, and the batch's first sample; then the indices."""

    def __getitem__(self, indices):
        import shmseq
        info = shmseq.get_worker_info()
        return np.array([info.id, info.num_workers, info.seed, os.getpid(), indices[0]]), indices


class Consumer:
    """A pool, its ring (made up front, or later with ``make_ring``), its plan, and what the
    consumer read so far: batch number -> the batch (copied out of its slot), or the reply
    itself for an error or a batch that will never come."""

    def __init__(self, worker, *, workers=2, slots=4, slot_bytes=1 << 16, backend="proc",
                 samples=24, hold=False, **options):
        self.hold = hold  # keep every batch's lease: no slot comes free
        self.held: list = []
        self.plan = EpochPlan(as_index_array(samples), BATCH, shuffle=False, seed=0)
        self.stream = BatchStream(self.plan)
        self.waker = Waker()
        self.stats = LoaderStats()
        self.slots = slots
        self.ring: Ring | None = None
        self.got: dict = {}
        self.seen: list = []  # every reply, as the pool made it
        self.pool = WorkerPool(worker, num_workers=workers, n_slots=slots, backend=backend,
                               context=multiprocessing.get_context("fork"), stream=self.stream,
                               waker=self.waker, stats=self.stats, **options)
        if slot_bytes is not None:
            self.make_ring(slot_bytes)

    def make_ring(self, slot_bytes: int) -> None:
        self.ring = Ring.create(self.slots, slot_bytes, wake=self.waker.wake_if_waiting)
        self.pool.use_ring(self.ring)

    def expected(self, number: int) -> np.ndarray:
        """The indices of batch ``number`` (the stream numbers batches from 0, epoch after
        epoch, with no going back here)."""
        per_epoch = self.plan.length(0)
        return self.plan.batch(number // per_epoch, number % per_epoch)

    def step(self, timeout: float = 0.5) -> list:
        replies = self.pool.exchange(timeout, 0)
        self.seen += replies
        for reply in replies:
            assert reply.number not in self.got, f"batch {reply.number} came twice"
            if reply.slot is not None:
                assert self.ring is not None and self.ring.state(reply.slot) is WRITTEN
                lease = self.ring.lease(reply.slot)
                self.got[reply.number] = copied(read_batch(lease))
                if self.hold:
                    self.held.append(lease)
                del lease  # the slot is free at the ring's next collect (unless held)
            elif reply.payload is not None:
                self.got[reply.number] = copied(read_batch(reply.payload))
            else:
                self.got[reply.number] = reply
        return replies

    def until(self, done, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s: got {sorted(self.got)}"
            self.step()

    def batches(self, count: int) -> None:
        self.until(lambda: all(number in self.got for number in range(count)),
                   f"batches 0 to {count - 1}")

    def close(self, grace: float = 3.0) -> None:
        self.held.clear()
        try:
            self.pool.stop(grace)
        finally:
            if self.ring is not None:
                self.ring.close()
            self.waker.close()


def copied(batch):
    if isinstance(batch, np.ndarray):
        return batch.copy()
    return type(batch)(copied(item) for item in batch)


@contextlib.contextmanager
def consumer(worker, grace: float = 3.0, **options):
    reader = Consumer(worker, **options)
    try:
        yield reader
    finally:
        reader.close(grace)


# -- starting, and the way tasks go ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_workers_start_with_their_id_seed_and_count_and_are_stopped(backend):
    """Worker ``k`` is seeded with ``base_seed + k`` and told ``max_workers``; a process worker
    is named with its pid; ``stop()`` ends every worker and may be called twice."""
    with consumer(Informed(), backend=backend, base_seed=100, max_workers=3) as reader:
        pool = reader.pool
        reader.until(pool.started, "workers started")
        reader.batches(6)
        assert pool.size == 2 and reader.stats.workers == 2
        handles = pool.handles
        assert [handle.wid for handle in handles] == [0, 1]
        for handle in handles:
            if backend == "proc":
                assert handle.pid != os.getpid() and running(handle.pid)
                assert handle.describe() == f"worker {handle.wid} (pid {handle.pid})"
            else:
                assert handle.pid is None and handle.describe() == f"worker {handle.wid}"
        pids = {handle.wid: handle.pid or os.getpid() for handle in handles}
        for number in range(6):
            wid, num_workers, seed, pid, first = reader.got[number][0].tolist()
            assert (num_workers, seed, pid) == (3, 100 + wid, pids[wid])
            assert first == reader.expected(number)[0]
        pool.stop()
        assert not any(handle.runner.is_alive() for handle in handles)
        pool.stop()  # safe twice


def test_each_batch_comes_back_once_written_in_the_slot_it_was_sent_with_the_work_spread():
    """Every batch of the stream, across epochs, arrives once, in a slot the ring has as
    WRITTEN (``Consumer.step`` checks both). Once both workers have started, free slots go to
    the least busy one: the first four batches alternate."""
    with consumer(Informed(), workers=2, slots=4, samples=24) as reader:
        taken = reader.ring.acquire_free()  # no slot for a task until both workers started
        reader.until(reader.pool.started, "workers started")
        reader.ring.unsent(taken)
        reader.batches(12)  # two epochs of 6
        firsts = [reader.got[number][0][4] for number in range(12)]
        assert firsts == [reader.expected(number)[0] for number in range(12)]
        assert [int(reader.got[number][0][0]) for number in range(4)] == [0, 1, 0, 1]


def test_indices_arrive_whole_in_the_batch():
    with consumer(IndexWorker, workers=2, slots=3, samples=20) as reader:
        reader.batches(10)
        for number in range(10):
            assert reader.got[number].tolist() == reader.expected(number).tolist()


def test_in_turn_batch_k_of_an_epoch_goes_to_worker_k_mod_n():
    with consumer(Informed(), workers=3, slots=6, samples=24, backend="thread",
                  in_turn=True) as reader:
        reader.batches(12)
        per_epoch = reader.plan.length(0)
        assert [int(reader.got[n][0][0]) for n in range(12)] == [n % per_epoch % 3 for n in range(12)]


def test_before_the_ring_each_worker_holds_one_batch_until_use_ring_places_it():
    """Without a ring, each worker gets one batch without a slot and tells its size
    (``built_sizes``), delivering nothing; ``use_ring`` gives each held batch a slot, which its
    worker writes it into, and the stream goes on through the ring."""
    with consumer(IndexWorker, workers=2, slot_bytes=None) as reader:
        pool = reader.pool
        reader.until(lambda: len(pool.built_sizes()) == 2, "batch built before the ring")
        for _ in range(3):
            reader.step(0.05)
        assert reader.got == {} and len(pool.built_sizes()) == 2  # one each, held
        assert pool.started(mapped=True)  # no ring to map yet
        reader.make_ring(slot_bytes_for(max(pool.built_sizes())))
        assert pool.built_sizes() == []
        reader.batches(8)
        assert pool.started(mapped=True)
        for number in range(8):
            assert reader.got[number].tolist() == reader.expected(number).tolist()


def test_a_batch_larger_than_its_slot_comes_back_encoded_and_its_slot_is_free():
    sizes = [100, 100, 100, 100, 50_000]  # the batch whose first sample is 4 takes 50,000 bytes
    with consumer(SizedWorker(sizes), workers=1, slots=2, slot_bytes=4096,
                  samples=12) as reader:
        reader.batches(3)
        seen = reader.seen
        big = next(reply for reply in seen if reply.number == 1)
        assert big.overflowed and big.slot is None and big.payload is not None
        payload, indices = reader.got[1]
        assert len(payload) == 50_000 and indices.tolist() == [4, 5, 6, 7]
        assert not any(reply.overflowed for reply in seen if reply.number != 1)


# -- what goes wrong --------------------------------------------------------------------------------
def test_a_workers_exception_is_its_batchs_reply_made_into_its_own_type_each_time():
    with consumer(TypeErrorAt(at=5), workers=2) as reader:
        reader.batches(4)
        reply = reader.got[1]
        assert reply.slot is None and reply.error is not None and not reply.ended
        first, second = reply.error(), reply.error()
        assert first is not second  # made when raised: no exception kept with the reply
        assert isinstance(first, TypeError) and str(first) == "sample 5 is bad"
        cause = first.__cause__
        assert isinstance(cause, WorkerError)
        assert cause.batch_number == 1 and cause.batch_indices.tolist() == [4, 5, 6, 7]
        assert any("failed on batch 1 of epoch 0 (sample indices [4, 5, 6, 7])" in note
                   for note in first.__notes__)
        for number in (0, 2, 3):
            assert reader.got[number].tolist() == reader.expected(number).tolist()


def test_a_worker_that_cannot_start_raises_its_own_error_naming_it():
    with consumer(FailingInit, workers=1) as reader:
        with pytest.raises(OSError, match="cannot open the dataset file") as raised:
            reader.until(lambda: False, "failure to start")
        (handle,) = reader.pool.handles
        assert isinstance(raised.value.__cause__, WorkerError)
        assert f"shmseq: worker 0 (pid {handle.pid}) failed to start" in raised.value.__notes__


@pytest.mark.parametrize("how, code, words", [
    ("SIGKILL", -signal.SIGKILL, "was killed by signal SIGKILL"),
    ("exit", 3, "exited with code 3"),
])
def test_a_dead_worker_is_named_with_its_pid_exit_and_batch_and_its_batches_end(how, code, words):
    """Sample 9 kills the only worker while it builds batch 2, batch 3 queued for it (the
    consumer holds batches 0 and 1: no slot for more): the death is raised once, naming the
    worker, its pid, how it ended and the batch; its unfinished batches then come as replies
    with no batch, and it gets no task again."""
    with consumer(Crash(how, at=9), workers=1, slots=4, hold=True) as reader:
        (handle,) = reader.pool.handles
        with pytest.raises(WorkerDied) as died:
            reader.until(lambda: False, "death")
        error = died.value
        assert (error.pid, error.exitcode, error.starting) == (handle.pid, code, False)
        assert str(error) == (f"worker 0 (pid {handle.pid}) {words} while building batch 2 of "
                              "epoch 0 (sample indices [8, 9, 10, 11]); batch 3 of epoch 0 were "
                              "queued for it")
        reader.until(lambda: {2, 3} <= set(reader.got), "ended replies")
        assert reader.got[2].ended and reader.got[3].ended
        assert reader.got[2].slot is None and reader.got[2].error is None
        assert [reader.got[n].tolist() for n in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        for _ in range(3):
            assert reader.step(0.05) == []  # nobody is left to build the next batches
        assert reader.pool.holder_of(4).startswith("no worker")
        assert not handle.accepting and not running(handle.pid)


def test_a_dead_worker_is_replaced_with_the_same_id_and_its_batches_built_again(tmp_path):
    with consumer(KillOnce(tmp_path, at=[9], seconds=0.01), workers=1, slots=4,
                  restarts=1) as reader:
        (dead,) = reader.pool.handles
        with pytest.warns(RuntimeWarning, match=(
                rf"worker 0 \(pid {dead.pid}\) was killed by signal SIGKILL while building batch 2 "
                r"of epoch 0 \(sample indices \[8, 9, 10, 11\]\): a new worker takes its place "
                r"and builds its batches again \(0 more restarts allowed\)")):
            reader.batches(8)
        for number in range(8):
            images, indices = reader.got[number]
            assert indices.tolist() == reader.expected(number).tolist()
            assert (images[:, 0, 0, 0] == indices % 251).all()
        (heir,) = reader.pool.handles
        assert heir.wid == 0 and heir.pid != dead.pid and reader.stats.restarts == 1


# -- resizing ---------------------------------------------------------------------------------------
def test_resize_starts_the_lowest_free_ids_and_lets_workers_leave_without_a_death():
    with consumer(Informed(), workers=1, slots=8, slot_bytes=None, max_workers=3,
                  samples=400) as reader:
        pool = reader.pool
        changes = pool.changes
        pool.resize(3)
        assert pool.size == 1 and pool.changes == changes  # no ring yet: nothing changes
        reader.until(lambda: pool.built_sizes(), "batch built before the ring")
        reader.make_ring(slot_bytes_for(max(pool.built_sizes())))

        pool.resize(5)  # bounded by max_workers
        assert [h.wid for h in pool.handles] == [0, 1, 2] and reader.stats.workers == 3
        assert pool.changes == changes + 2
        reader.until(pool.started, "workers started")
        reader.batches(12)

        # those with the fewest open tasks leave, the highest ids first
        staying, *leaving = sorted(pool.handles, key=lambda h: (-len(h.open), h.wid))
        pool.resize(0)  # at least one
        assert pool.handles == [staying] and reader.stats.workers == 1
        assert pool.changes == changes + 4
        sent_before = max(reader.got) + reader.slots  # the last batch sent to those leaving
        reader.until(lambda: not any(h.runner.is_alive() for h in leaving), "departures")
        reader.batches(sent_before + 9)  # none missing: those that left built theirs
        builders = {int(reader.got[n][0][0]) for n in range(sent_before + 1, sent_before + 9)}
        assert builders == {staying.wid}

        pool.resize(2)
        assert pool.handles[0] is staying and reader.stats.workers == 2
        assert pool.handles[1].wid == min({0, 1, 2} - {staying.wid})  # the lowest free id
        assert pool.handles[1].pid not in [h.pid for h in leaving]
        reader.until(pool.started, "worker started")


# -- the consumer's wait ----------------------------------------------------------------------------
def test_a_wake_from_another_thread_cuts_the_wait_short_and_holder_of_names_the_builder():
    with consumer(Hang(at=0), workers=1, grace=0.1) as reader:
        pool = reader.pool
        reader.until(pool.started, "worker started")
        (handle,) = pool.handles
        assert pool.holder_of(0) == handle.describe()
        assert pool.holder_of(10_000).startswith("no worker (it was never dispatched")

        def wake_once_waiting():
            while not reader.waker.waiting:
                time.sleep(0.001)
            reader.waker.wake()
        waker = threading.Thread(target=wake_once_waiting)
        waker.start()
        try:
            assert pool.exchange(None, 0) == []  # no reply: the wake ended the wait
        finally:
            waker.join()


# -- how a death is told ------------------------------------------------------------------------
@pytest.mark.parametrize("code, out_of_memory, own", [
    (3, None, True), (None, None, True),
    (-signal.SIGSEGV, None, True), (-signal.SIGABRT, None, True),
    (-signal.SIGKILL, True, True), (-signal.SIGKILL, None, True),  # not known: assumed
    (-signal.SIGKILL, False, False), (-signal.SIGTERM, None, False), (-signal.SIGINT, None, False),
])
def test_a_death_is_charged_on_its_batch_only_when_it_was_its_own_doing(code, out_of_memory, own):
    assert its_own_doing(code, out_of_memory) is own


def test_an_exit_and_indices_are_told_briefly():
    assert describe_exit(-signal.SIGKILL, True) == (
        "was killed by signal SIGKILL (the kernel's out-of-memory killer)")
    assert describe_exit(-signal.SIGKILL, None) == "was killed by signal SIGKILL"
    assert describe_exit(0, None) == "exited with code 0"
    assert brief(np.arange(4)) == "[0, 1, 2, 3]"
    assert brief(np.arange(100)).count(",") < 15 and "..." in brief(np.arange(100))
    assert brief(None) == "unknown" and len(brief(list(range(1000)))) == 120
