"""num_workers='auto': the pool resized while it runs (grown, shrunk, a leaving worker killed)
delivers the batches of a fixed pool in the same order; the ring uses no more slots than
its active count; the periodic look (control.py) turns the stats into windows for the tuner,
driven here by a fake clock and a fake pool; a memory budget bounds the workers."""
import os
import signal
import time
import warnings

import numpy as np
import pytest

from shmseq import ShmSequence
from shmseq.engine.trainer.control import Control
from shmseq.engine.trainer.ring import FREE, Ring
from shmseq.engine.trainer.stats import MIN_JUDGED_S, LoaderStats
from shmseq.engine.trainer.tuning import (HELD_ROOM, SMALL_BATCH_SLOTS, Budget, Window,
                                          ring_bytes_target, ring_capacity)
from shmseq.engine.worker.batch import MEMORY_EVERY_S, MemoryMeter
from shmseq.testing import ring_of


class SlowIndexWorker:
    """Returns its indices after ``seconds``: batches pile up in the workers' queues."""

    def __init__(self, seconds=0.002):
        self.seconds = seconds

    def __getitem__(self, indices):
        time.sleep(self.seconds)
        return indices.astype(np.int64)


def make(worker=None, **options):
    options = {"batch_size": 3, "shuffle": True, "seed": 5, "out_type": "null", "timeout": 60,
               "num_workers": 2, **options}
    return ShmSequence(SlowIndexWorker() if worker is None else worker, 300, **options)


def reference(epochs: int = 1) -> list:
    with make().start() as seq:
        return [[batch.tolist() for batch in seq] for _ in range(epochs)]


def resized_run(seq, sizes: dict[int, int]) -> list:
    """One epoch, the pool resized to ``sizes[k]`` workers as batch ``k`` is taken."""
    got = []
    for position, batch in enumerate(seq):
        got.append(batch.tolist())
        if position in sizes:
            seq.pipeline.pool.resize(sizes[position])
    return got


@pytest.mark.parametrize("thread_type", ["proc", "thread"])
def test_a_pool_grown_and_shrunk_mid_epoch_delivers_a_fixed_pools_batches(thread_type):
    expected = reference(epochs=2)
    with make(thread_type=thread_type, num_workers="auto", max_workers=4).start() as seq:
        pool = seq.pipeline.pool
        got = [resized_run(seq, {5: 4, 30: 1, 60: 3}), resized_run(seq, {0: 1, 40: 4})]
        assert pool.size == seq.stats.workers == 4
        assert {h.info.num_workers for h in pool.handles} == {4}  # max_workers, as documented
    assert got == expected


def test_a_leaving_worker_killed_with_tasks_open_costs_a_restart_and_no_batch():
    expected = reference()[0]
    with make(num_workers="auto", max_workers=3, worker_restarts=1).start() as seq:
        pool, got = seq.pipeline.pool, []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for position, batch in enumerate(seq):
                got.append(batch.tolist())
                if position == 3:
                    pool.resize(3)
                if position == 10:
                    pool.resize(1)
                    leaving = max(pool.leaving, key=lambda h: len(h.open))
                    assert leaving.open  # it still had batches to build
                    os.kill(leaving.pid, signal.SIGKILL)
        assert seq.stats.restarts == 1 and pool.size == 1
        assert any("other workers build its batches again" in str(w.message) for w in caught)
    assert got == expected


def test_leaving_workers_exit_as_asked_with_no_restart_and_no_warning():
    expected = reference()[0]
    with make(num_workers="auto", max_workers=4).start() as seq:
        pool = seq.pipeline.pool
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = resized_run(seq, {2: 4, 20: 1})
        deadline = time.monotonic() + 10
        while pool.leaving and time.monotonic() < deadline:
            pool.resize(1)
            time.sleep(0.01)
        assert not pool.leaving and seq.stats.restarts == 0
    assert got == expected


def test_auto_tunes_with_threads_and_says_what_bounds_the_rate():
    with make(thread_type="thread", num_workers="auto", max_workers=3).start() as seq:
        got = [batch.tolist() for batch in seq]
        assert 1 <= seq.stats.workers <= 3
        while seq.stats.elapsed_s < MIN_JUDGED_S:  # epochs until summary() judges
            for _ in seq:
                pass
        assert "bound" in seq.stats.summary()
        assert seq.stats.worker_cpu_s > 0 and seq.stats.as_dict()["workers"] == seq.stats.workers
    assert got == reference()[0]


class HoldsMemory(SlowIndexWorker):
    """A latency-bound worker that holds ``megabytes`` of its own once made in its process."""

    def __init__(self, megabytes: int, seconds: float = 0.02):
        super().__init__(seconds)
        self.megabytes, self.held = megabytes, None

    def __getitem__(self, indices):
        if self.held is None:
            self.held = np.ones(self.megabytes << 17)  # 8-byte floats, every page written
        return super().__getitem__(indices)


def test_a_worker_measures_the_memory_it_holds_alone():
    with make(worker=HoldsMemory(96)).start() as seq:
        next(iter(seq))
        for _ in zip(range(10), seq):  # the first batches' counts come with their replies
            pass
        assert seq.stats.worker_private_bytes >= 96 << 20
        assert seq.stats.as_dict()["worker_private_bytes"] == seq.stats.worker_private_bytes


def test_the_memory_meter_measures_at_once_then_every_so_often():
    now = [0.0]
    meter = MemoryMeter(clock=lambda: now[0])
    first = meter.counts()["worker_private_bytes"]
    held = np.ones(32 << 17)  # 32 MB, written
    now[0] = MEMORY_EVERY_S - 0.001
    assert meter.counts() == {}  # not due yet
    now[0] = MEMORY_EVERY_S
    assert meter.counts()["worker_private_bytes"] >= first + (30 << 20)
    del held


def test_the_memory_budget_bounds_the_workers_that_auto_runs():
    """Latency-bound workers that hold 96 MB each: 'auto' would grow toward 16 of them; each
    costs what it holds and its two slots, beside the rest of the ring."""
    budget = 260 << 20  # room for 2 workers of about 105 MB, by 50 MB; not for 3
    with make(worker=HoldsMemory(96), num_workers="auto", max_workers=16,
              memory_budget=budget).start() as seq:
        slot, most = ring_of(seq).spec.slot_bytes, 0
        for _ in range(3):
            for _ in seq:
                most = max(most, seq.stats.workers)
                held = seq.stats.worker_private_bytes + 2 * slot
                assert seq.stats.workers == 1 or seq.stats.workers * held < budget, (
                    seq.stats.workers, held)
        assert seq.stats.workers_limit == "memory_budget"  # what summary() names
    assert most == 2  # the budget's room


class SlowFirstBatch(SlowIndexWorker):
    """Its first batch takes 1.2 s (a run long enough to judge), the others no time: looks
    fall in the wait, none after."""

    def __init__(self):
        super().__init__(1.2)

    def __getitem__(self, indices):
        batch = super().__getitem__(indices)
        self.seconds = 0.0
        return batch


def test_the_summary_after_an_epoch_takes_in_its_last_batches():
    with make(worker=SlowFirstBatch(), num_workers=1).start() as seq:
        assert sum(1 for _ in seq) == 100
        window = seq.stats.breakdown()
        assert window.batches_per_s * window.window_s == pytest.approx(100)
        assert not seq.stats.summary().startswith(("no batches asked for", "too short")), window


# -- the ring's active slots ----------------------------------------------------------------------
def test_the_ring_never_has_more_slots_in_use_than_its_active_count():
    ring = Ring.create(8, 4096, wake=lambda: None, active=3)
    try:
        touched = set()
        rng = np.random.default_rng(0)
        in_use: list[int] = []
        for step in range(500):
            if step == 250:
                ring.set_active(2)  # lowered with three in use: takes effect as they free
            in_use += ring.acquire_free()
            assert len(in_use) <= max(ring.active, 3 if step < 260 else 2)
            touched.update(in_use)
            for slot in [s for s in in_use if rng.random() < 0.5]:
                ring.unused(slot)
                in_use.remove(slot)
        assert touched == {0, 1, 2}  # the slots beyond stay cold
        assert all(ring.state(slot) is FREE for slot in range(3, 8))
    finally:
        ring.close()


def test_a_default_ring_is_made_for_the_most_workers_and_uses_those_running():
    with make(num_workers="auto", max_workers=6).start() as seq:
        next(iter(seq))
        ring = seq.pipeline.ring
        assert ring.spec.n_slots == ring_capacity(ring.spec.slot_bytes, 6, None)
        assert ring.active <= ring.spec.n_slots
    with make(buffer=5).start() as seq:
        next(iter(seq))
        assert seq.pipeline.ring.spec.n_slots == seq.pipeline.ring.active == 5


def test_ring_capacity_stays_within_the_memory_budget_and_its_bound():
    mib = 1 << 20
    assert ring_capacity(38 * mib, max_workers=2, memory_bytes=None) == 2 * 2 + HELD_ROOM + 1
    assert ring_capacity(38 * mib, max_workers=16, memory_bytes=200 * mib) == 5
    assert ring_capacity(1024, max_workers=2, memory_bytes=None) == SMALL_BATCH_SLOTS
    assert ring_capacity(1024, max_workers=16, memory_bytes=None) == 2 * 16 + HELD_ROOM + 1
    assert ring_capacity(mib, 2, None) == max(2 * 2 + HELD_ROOM + 1,
                                               min(SMALL_BATCH_SLOTS, ring_bytes_target() // mib))
    assert ring_capacity(38 * mib, 2, memory_bytes=1) == 2


# -- the periodic look, on a fake clock and a fake pool ---------------------------------------------
class FakePool:
    def __init__(self, size: int):
        self.size, self.changes, self.asked = size, 0, []

    def resize(self, workers: int) -> None:
        self.asked.append(workers)
        if workers != self.size:
            self.size, self.changes = workers, self.changes + 1


class ScriptedTuner:
    """Answers the counts it is given, one a window, and keeps the windows."""

    budget = Budget(8)

    def __init__(self, answers):
        self.answers, self.windows = list(answers), []

    def observe(self, window: Window) -> int:
        self.windows.append(window)
        return self.answers.pop(0)

    def limit(self) -> str:
        return "max_workers" if self.windows else ""

    def growing(self) -> bool:
        return not self.windows


class FakeRing:
    class spec:
        slot_bytes, n_slots = 38 << 20, 32
    peak_held = 0

    def __init__(self):
        self.active = None

    def set_active(self, slots: int) -> None:
        self.active = slots


def test_each_look_makes_a_window_of_the_stats_since_the_last_and_resizes_the_pool(monkeypatch):
    cpu = iter([10.0, 10.4, 10.9, 11.0])
    monkeypatch.setattr("shmseq.engine.trainer.control.time.process_time", lambda: next(cpu))
    stats, pool, ring = LoaderStats(started=0.0, workers=2), FakePool(2), FakeRing()
    tuner = ScriptedTuner([3, 3])
    control = Control(stats, tuner, sizes_ring=True, thread_workers=True)
    control.look(0.5, pool, ring)  # the first look: nothing to compare with yet
    assert stats.workers_growing  # the tuner's, for the summary
    stats.batches, stats.consumer_wait_s, stats.worker_busy_s = 40, 0.2, 0.9
    stats.worker_cpu_s, stats.worker_idle_s = 0.3, 0.1
    control.look(1.0, pool, ring)
    window = tuner.windows[0]
    assert window == Window(seconds=0.5, batches=40, trainer_wait_s=0.2, worker_busy_s=0.9,
                            worker_cpu_s=0.3, ring_full_s=0.05, workers=2,
                            trainer_cpu_s=pytest.approx(0.1), steady=True)
    assert pool.asked == [3] and ring.active == 2 * 3 + 1 + 1 and control.due == 1.5
    assert stats.workers_limit == "max_workers" and not stats.workers_growing
    control.look(1.5, pool, ring)  # the pool grew in the window: not steady
    assert not tuner.windows[1].steady and tuner.windows[1].workers == 3


def test_a_fixed_pool_is_not_resized_but_its_default_ring_follows_what_the_consumer_holds():
    stats, pool, ring = LoaderStats(started=0.0, workers=2), FakePool(2), FakeRing()
    control = Control(stats, None, sizes_ring=True, thread_workers=False)
    ring.peak_held = 3
    control.look(0.5, pool, ring)
    assert pool.asked == [] and ring.active == 2 * 2 + 3 + 1
    explicit = FakeRing()
    Control(stats, None, sizes_ring=False, thread_workers=False).look(1.0, pool, explicit)
    assert explicit.active is None


def test_each_look_adds_the_devices_counts_before_the_snapshot():
    counts = iter([{"copy_s": 0.25}, {"copy_s": 0.5, "decode_s": 0.1}])
    stats = LoaderStats(started=0.0, workers=2, clock=lambda: 1.0)
    control = Control(stats, None, sizes_ring=False, thread_workers=False,
                      device_counts=lambda: next(counts))
    control.tick(0.5)
    control.tick(1.0)
    assert (stats.copy_s, stats.decode_s) == (0.75, 0.1)
    assert stats.breakdown().copy_fraction == pytest.approx(0.75)


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("options, error, words", [
    ({"num_workers": "many"}, TypeError, "num_workers must be an integer >= 0 or 'auto'"),
    ({"num_workers": 2, "max_workers": 4}, ValueError, "max_workers=4 bounds num_workers='auto'"),
    ({"num_workers": "auto", "cpu_budget": 0}, ValueError, "cpu_budget must be a number of cores"),
    ({"num_workers": "auto", "max_workers": 0}, ValueError, "max_workers must be an integer >= 1"),
    ({"buffer": 4, "memory_budget": 1 << 30}, ValueError, "buffer=4 fixes them"),
])
def test_arguments_out_of_range_are_named(options, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        make(**options)


def test_torch_refuses_auto_for_an_iterable_dataset_and_keeps_integers_for_torch():
    torch = pytest.importorskip("torch")
    from shmseq.torch import DataLoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(ValueError, match="num_workers='auto' needs a map-style dataset"):
        DataLoader(Stream(), num_workers="auto")
    dataset = torch.utils.data.TensorDataset(torch.arange(60))
    loader = DataLoader(dataset, batch_size=6, num_workers="auto", max_workers=3)
    try:
        assert loader.num_workers == 2 and loader.max_workers == 3
        got = [batch.tolist() for (batch,) in loader]
    finally:
        loader.close()
    assert got == [list(range(k, k + 6)) for k in range(0, 60, 6)]
