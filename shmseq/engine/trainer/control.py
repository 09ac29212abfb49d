"""The pipeline's periodic look at itself, from the consumer's step every ``TICK_S``: the
statistics' snapshot (``LoaderStats.tick``), and what the tuning rules (tuning.py) decide
from it: the worker count (``num_workers='auto'``: a ``WorkerTuner``) and the ring's active
slots (a ring sized by the rules, not by ``buffer``).

One ``Control`` per pipeline owns that state; the step pays a float comparison between two
looks. Before the ring, a look is the snapshot alone (``tick``). The decisions are the tuner's; the pool starts and stops workers (``resize``), the
ring counts slots (``set_active``).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

from .pool import WorkerPool
from .ring import Ring
from .stats import LoaderStats
from .tuning import Budget, Window, WorkerTuner, idle_share, ring_slots

TICK_S = 0.5  # seconds between two looks


class _Seen(NamedTuple):
    """The counters a window is the difference of, as of one look."""

    at: float
    batches: int
    trainer_wait_s: float
    worker_busy_s: float
    worker_cpu_s: float
    worker_idle_s: float
    process_cpu_s: float  # the training process's CPU, its thread workers' included
    changes: int          # the pool's starts and departures so far


class Control:
    """Looks at the pipeline every ``TICK_S`` (``due``, then ``look``). ``tuner``: the worker
    count's (None: fixed); ``sizes_ring``: the ring's active slots follow the workers and the
    most batches the consumer held at once; ``thread_workers``: the workers' CPU is the
    training process's own (subtracted from the trainer's); ``device_counts``: the device's
    statistics since the last call (its ``pop_counts``: a decode's or the copies' time)."""

    def __init__(self, stats: LoaderStats, tuner: WorkerTuner | None, *, sizes_ring: bool,
                 thread_workers: bool,
                 device_counts: Callable[[], dict[str, float]] = dict) -> None:
        self.stats = stats
        self.tuner = tuner
        self.sizes_ring = sizes_ring
        self.thread_workers = thread_workers
        self.device_counts = device_counts
        self.due = time.perf_counter() + TICK_S  # the step looks once ``now`` passes it
        self._seen: _Seen | None = None

    @classmethod
    def auto(cls, stats: LoaderStats, *, start_workers: int, max_workers: int,
             cpu_budget: float | None, memory_budget: int | None, sizes_ring: bool,
             thread_workers: bool,
             device_counts: Callable[[], dict[str, float]] = dict) -> "Control":
        """A control that tunes the worker count between 1 and ``max_workers``, starting at
        ``start_workers``, within ``cpu_budget`` cores (None: the usable cores) and
        ``memory_budget`` bytes for the workers and the ring (None: no bound)."""
        budget = (Budget(max_workers, memory_bytes=memory_budget) if cpu_budget is None
                  else Budget(max_workers, cpu=cpu_budget, memory_bytes=memory_budget))
        return cls(stats, WorkerTuner(budget, start_workers), sizes_ring=sizes_ring,
                   thread_workers=thread_workers, device_counts=device_counts)

    def tick(self, now: float) -> None:
        """The statistics' snapshot at ``now`` (the device's counts added first): all there is
        to look at before the ring."""
        self.due = now + TICK_S
        self.stats.add_counts(self.device_counts())
        self.stats.tick(now)

    def look(self, now: float, pool: WorkerPool, ring: Ring) -> None:
        """The snapshot (``tick``), then the worker count and the ring's active slots."""
        self.tick(now)
        if self.tuner is not None:
            if self.tuner.budget.memory_bytes is not None:
                self._measure_memory(self.tuner, ring)
            window = self._window(now, pool)
            if window is not None:
                pool.resize(self.tuner.observe(window))
            self.stats.workers_limit = self.tuner.limit()
            self.stats.workers_growing = self.tuner.growing()
        if self.sizes_ring:
            ring.set_active(ring_slots(ring.spec.slot_bytes, pool.size, max(ring.peak_held, 1),
                                       ring.spec.n_slots))

    def _measure_memory(self, tuner: WorkerTuner, ring: Ring) -> None:
        """A worker's cost: the most memory a worker process held alone (its own measure; a
        thread's is the trainer's), and its two slots; the rest of the ring's slots in use is
        the pipeline's whatever the count."""
        slot = ring.spec.slot_bytes
        shared = ring_slots(slot, 0, max(ring.peak_held, 1), ring.spec.n_slots) * slot
        tuner.measured_memory(self.stats.worker_private_bytes + 2 * slot, shared)

    def _window(self, now: float, pool: WorkerPool) -> Window | None:
        """What the pipeline did since the last look (None at the first)."""
        stats = self.stats
        seen = _Seen(now, stats.batches, stats.consumer_wait_s, stats.worker_busy_s,
                     stats.worker_cpu_s, stats.worker_idle_s, time.process_time(), pool.changes)
        last, self._seen = self._seen, seen
        if last is None:
            return None
        worker_cpu_s = seen.worker_cpu_s - last.worker_cpu_s
        process_cpu_s = seen.process_cpu_s - last.process_cpu_s
        trainer_cpu_s = process_cpu_s - worker_cpu_s if self.thread_workers else process_cpu_s
        idle_s = (now - last.at) * idle_share(seen.worker_idle_s - last.worker_idle_s,
                                              seen.worker_busy_s - last.worker_busy_s)
        return Window(seconds=now - last.at, batches=seen.batches - last.batches,
                      trainer_wait_s=seen.trainer_wait_s - last.trainer_wait_s,
                      worker_busy_s=seen.worker_busy_s - last.worker_busy_s,
                      worker_cpu_s=worker_cpu_s,
                      ring_full_s=idle_s, workers=pool.size,
                      trainer_cpu_s=max(trainer_cpu_s, 0.0),
                      steady=seen.changes == last.changes)
