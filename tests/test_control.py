"""The pipeline's periodic look at itself (engine/trainer/control.py): due every ``TICK_S``
from the consumer's step, each look snapshots the statistics at its time (the device's counts
added first) and, once there is a ring, shows the tuner what happened since the last look,
resizes the pool to the count it answers, and sets the ring's active slots.

Looks are made at times the test gives (``look(now, ...)``), the statistics on a fake clock;
the pool (thread workers), the ring and the tuner are real. The tuner is ``WorkerTuner``
itself, which also keeps each window it was shown (``Recording``): the windows are what this
module makes, and nothing else shows them.
"""
from __future__ import annotations

import time

import pytest

from shmseq.engine.trainer.control import TICK_S, Control
from shmseq.engine.trainer.pipeline import Pipeline, PipelineSpec
from shmseq.engine.trainer.plan import BatchStream, EpochPlan, as_index_array
from shmseq.engine.trainer.pool import WorkerPool
from shmseq.engine.trainer.ring import Ring
from shmseq.engine.trainer.stats import LoaderStats
from shmseq.engine.trainer.tuning import Budget, WorkerTuner, ring_bytes_target
from shmseq.engine.trainer.waker import Waker
from workers import IndexWorker

# Slots larger than the ring's byte target: the ring's slots are then what the workers and the
# consumer need, with no extra ones for small batches (tuning.ring_slots).
SLOT = ring_bytes_target() + 4096
CAPACITY = 12


class Recording(WorkerTuner):
    """The real tuner, keeping each window it was shown."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shown: list = []

    def observe(self, window):
        self.shown.append(window)
        return super().observe(window)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Running:
    """A real pool of thread workers, given a real ring of large slots (one in use at first),
    and the statistics they count into, on a fake clock."""

    def __init__(self, workers: int = 2, max_workers: int = 4) -> None:
        self.clock = Clock()
        self.stats = LoaderStats(started=0.0, clock=self.clock)
        self.waker = Waker()
        self.pool = WorkerPool(IndexWorker, num_workers=workers, n_slots=CAPACITY,
                               backend="thread", context=None, stream=BatchStream(
                                   EpochPlan(as_index_array(40), 4, shuffle=False, seed=0)),
                               waker=self.waker, stats=self.stats, max_workers=max_workers)
        self.ring = Ring.create(CAPACITY, SLOT, wake=self.waker.wake_if_waiting, active=1)
        self.pool.use_ring(self.ring)

    def close(self) -> None:
        try:
            self.pool.stop()
        finally:
            self.ring.close()
            self.waker.close()


@pytest.fixture
def running():
    made = Running()
    yield made
    made.close()


def burn_cpu() -> None:
    """Spend some of this process's CPU time."""
    began = time.process_time()
    while time.process_time() == began:
        pass


def worked(stats: LoaderStats, batches=10, wait=0.1, busy=0.8, cpu=0.4, idle=0.2) -> None:
    """What a window of work adds to the statistics."""
    stats.batches += batches
    stats.consumer_wait_s += wait
    stats.worker_busy_s += busy
    stats.worker_cpu_s += cpu
    stats.worker_idle_s += idle


# -- when, and the statistics ------------------------------------------------------------------------
def test_a_look_is_due_a_tick_after_it_was_made_and_after_each_look(running):
    before = time.perf_counter()
    control = Control(running.stats, None, sizes_ring=False, thread_workers=False)
    after = time.perf_counter()
    assert before + TICK_S <= control.due <= after + TICK_S
    control.look(100.0, running.pool, running.ring)
    assert control.due == 100.0 + TICK_S


def test_each_look_snapshots_the_statistics_at_its_time_the_devices_counts_first(running):
    counts = iter([{"decode_s": 2.5, "copy_s": 1.0}, {"decode_s": 0.5}])
    stats = running.stats
    control = Control(stats, None, sizes_ring=False, thread_workers=False,
                      device_counts=lambda: next(counts))
    running.clock.now = 10.0
    control.tick(10.0)
    assert (stats.decode_s, stats.copy_s) == (2.5, 1.0)
    # a device's counts reach the breakdown at a snapshot only: this one had them
    assert stats.breakdown().decode_fraction == pytest.approx(0.25)
    assert stats.breakdown().copy_fraction == pytest.approx(0.1)
    running.clock.now = 20.0
    control.tick(20.0)
    assert stats.decode_s == 3.0 and stats.breakdown().decode_fraction == pytest.approx(0.15)


def test_before_the_ring_a_look_is_a_tick_which_neither_asks_the_tuner_nor_resizes(running):
    tuner = Recording(Budget(4, cpu=64.0), start_workers=3)
    control = Control(running.stats, tuner, sizes_ring=True, thread_workers=False)
    for now in (0.5, 1.0, 1.5):
        worked(running.stats)
        control.tick(now)
        assert control.due == now + TICK_S
    assert tuner.shown == [] and running.pool.size == 2 and running.ring.active == 1
    assert not running.stats.workers_growing and running.stats.workers_limit == ""


# -- the tuner -------------------------------------------------------------------------------------------
def test_each_look_shows_the_tuner_what_happened_since_the_last_one(running):
    tuner = Recording(Budget(4, cpu=64.0), start_workers=2)
    control = Control(running.stats, tuner, sizes_ring=False, thread_workers=False)
    control.look(1.0, running.pool, running.ring)
    assert tuner.shown == []  # the first look: nothing to compare with yet
    assert running.stats.workers_growing and running.stats.workers_limit == ""
    worked(running.stats, batches=3)  # fewer than the tuner judges alone: it keeps its count
    burn_cpu()
    control.look(1.5, running.pool, running.ring)
    (window,) = tuner.shown
    assert (window.batches, window.workers, window.steady) == (3, 2, True)
    assert [window.seconds, window.trainer_wait_s, window.worker_busy_s, window.worker_cpu_s,
            window.ring_full_s] == pytest.approx([0.5, 0.1, 0.8, 0.4, 0.5 * 0.2 / (0.2 + 0.8)])
    assert window.trainer_cpu_s > 0  # the training process's own CPU, thread workers apart
    running.pool.resize(3)  # a change in the window: it describes no one count
    control.look(2.0, running.pool, running.ring)
    assert not tuner.shown[1].steady and tuner.shown[1].workers == 3
    assert tuner.shown[1].batches == 0


def test_thread_workers_cpu_is_taken_out_of_the_trainers(running):
    tuner = Recording(Budget(4, cpu=64.0), start_workers=2)
    control = Control(running.stats, tuner, sizes_ring=False, thread_workers=True)
    control.look(1.0, running.pool, running.ring)
    worked(running.stats, batches=1, cpu=1000.0)  # more than the process spent: none left
    burn_cpu()
    control.look(1.5, running.pool, running.ring)
    assert tuner.shown[0].trainer_cpu_s == 0.0 and tuner.shown[0].worker_cpu_s == 1000.0


def test_an_input_bound_pipeline_is_grown_to_the_tuners_count(running):
    """The trainer waits half of each window with the ring never full: after two such windows
    the tuner wants twice the workers, which the look has the pool start."""
    tuner = Recording(Budget(4, cpu=64.0), start_workers=2)
    control = Control(running.stats, tuner, sizes_ring=False, thread_workers=False)
    control.look(0.5, running.pool, running.ring)
    for now in (1.0, 1.5):
        worked(running.stats, batches=20, wait=0.25, busy=1.0, cpu=0.5, idle=0.0)
        control.look(now, running.pool, running.ring)
    assert [w.workers for w in tuner.shown] == [2, 2]
    assert running.pool.size == 4 and running.stats.workers == 4
    assert running.stats.workers_limit == "max_workers" and not running.stats.workers_growing


def test_a_memory_budget_is_measured_from_the_statistics_and_shrinks_the_pool():
    running = Running(workers=3)
    try:
        stats, ring = running.stats, running.ring
        stats.worker_private_bytes = 5 << 20
        worker_bytes = stats.worker_private_bytes + 2 * SLOT  # its own memory and two slots
        shared = 2 * SLOT  # a held batch and a ready one, whatever the count
        control = Control.auto(stats, start_workers=3, max_workers=4, cpu_budget=64.0,
                               memory_budget=shared + worker_bytes * 3 // 2, sizes_ring=False,
                               thread_workers=True)
        control.look(0.5, running.pool, ring)
        assert control.tuner.worker_bytes == worker_bytes
        assert control.tuner.shared_bytes == shared
        assert stats.workers_limit == "memory_budget" and running.pool.size == 3
        control.look(1.0, running.pool, ring)
        assert running.pool.size == 1 and stats.workers == 1
    finally:
        running.close()


# -- the ring -------------------------------------------------------------------------------------------
def test_a_ring_sized_by_the_rules_follows_the_workers_and_the_most_the_consumer_held(running):
    ring, pool = running.ring, running.pool
    control = Control(running.stats, None, sizes_ring=True, thread_workers=False)
    control.look(0.5, pool, ring)
    assert ring.active == 2 * 2 + 1 + 1  # two a worker, one held, one ready
    leases = []
    for _ in range(3):
        slot = ring.acquire()
        ring.written(slot)
        leases.append(ring.lease(slot))
        assert ring.keep_in_place(slot)
    control.look(1.0, pool, ring)
    assert ring.active == 2 * 2 + 3 + 1
    leases.clear()
    pool.resize(3)
    control.look(1.5, pool, ring)
    assert ring.active == 2 * 3 + 3 + 1  # the most held, not what is held now
    Control(running.stats, None, sizes_ring=False, thread_workers=False).look(2.0, pool, ring)
    assert ring.active == 2 * 3 + 3 + 1  # a ring of a given size is left as it is


# -- from the consumer's step ------------------------------------------------------------------------
def test_the_consumers_step_looks_once_a_look_is_due():
    spec = PipelineSpec(IndexWorker, num_workers=1, buffer=4, start_method="fork",
                        out_type="null", timeout=30)
    pipeline = Pipeline(spec, EpochPlan(as_index_array(40), 4, shuffle=False, seed=0))
    try:
        number = pipeline.open(0)
        pipeline.control.due = 0.0  # due long ago
        before = time.perf_counter()
        assert pipeline.take(number, 0, 0).tolist() == [0, 1, 2, 3]
        assert pipeline.control.due >= before + TICK_S
    finally:
        pipeline.close()
