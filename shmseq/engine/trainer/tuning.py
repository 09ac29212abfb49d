"""How many workers a pipeline runs, and how many of its ring's slots it uses: pure rules.

``WorkerTuner`` is told what the pipeline saw over each control window (a ``Window``: wall
time, batches, how long the trainer waited, how busy the workers were, on how much CPU) and
answers the worker count it wants now. It holds its state explicitly and reads time only
from the clock it is given, so a test drives it with synthetic windows and a fake clock.
``ring_slots`` says how many of the ring's slots to use for a given count of workers, and
``ring_capacity`` how many to make a ring with.

The model behind both: a worker takes ``worker_busy_s / batches`` seconds of wall time per
batch, and the trainer wants one every ``(seconds - trainer_wait_s) / batches`` seconds, so
``busy / step`` workers just keep up; ``HEADROOM`` more absorb the jitter of real batches.
"""
from __future__ import annotations

import functools
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean
from typing import Callable, NamedTuple

INPUT_BOUND = 0.05       # the trainer waited more than this share of a window: input-bound
TRAINER_BOUND = 0.01     # ... less than this, with the ring mostly full: trainer-bound
RING_MOSTLY_FULL = 0.5   # share of a window with no slot free: workers idle for want of one
HEADROOM = 1.15          # workers kept beyond the model's exact need, for jitter
SHRINK_SLACK = 1.2       # a shrink leaves workers for the need (with HEADROOM) this much over
MIN_GAIN = 0.05          # a growth must raise the rate this much while the trainer waits
CPU_MARGIN = 0.5         # cores: below the budget by this much, the CPU is free; above, over
MIN_BATCHES = 4          # a window with fewer batches is added to the next before judging
JUDGE_WINDOWS = 2        # judged windows at a count before a change of it, or its judgement
SHRINK_WINDOWS = 3       # judged windows at this count, all trainer-bound, before a shrink
SHRINK_EVERY_S = 2.0     # the least time between two shrinks (and since any change)
COOL_DOWN_S = 10.0       # no growth for this long after one that did not pay ...
MAX_COOL_DOWN_S = 80.0   # ... doubled each time the next one does not pay either, up to this

# Slots of a ring used beyond what the workers need, for small batches: up to
# ``SMALL_BATCH_SLOTS``, and up to ``ring_bytes_target()`` in all. A ring whose batches fall out
# of the CPU's last-level cache is slower: on a 32 MiB cache, with 2 workers, 9.6 MB batches
# ran at 0.74x the rate on 4 slots they had on 2, and 0.8 MB batches at 0.57x on 64 slots
# of what 6 gave (``python -m shmseq.bench --autotune``, ring workloads); 38.5 MB batches, which
# fit no cache, ran alike on 2 to 10.
SMALL_BATCH_SLOTS = 10
_CACHE_INDEX = "/sys/devices/system/cpu/cpu0/cache/index3/size"
_CACHE_GUESS = 32 << 20


@functools.cache
def ring_bytes_target() -> int:
    """Half the last-level cache (the other half for what the workers read and the trainer
    computes); a 32 MiB cache assumed where the system does not say."""
    try:
        with open(_CACHE_INDEX) as size:
            text = size.read().strip()
        cache = int(text[:-1]) << 10 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        cache = _CACHE_GUESS
    return cache // 2


START_WORKERS = 2  # the workers a tuned pool starts with (at most its max_workers)
MAX_SLOTS = 64   # the most slots a ring sized by these rules is made with
HELD_ROOM = 4    # batches a consumer may hold at once that such a ring has room for


def ring_capacity(slot_bytes: int, max_workers: int, memory_bytes: int | None) -> int:
    """The slots to make a ring with when none were asked for: what ``ring_slots`` uses for
    ``max_workers`` and a consumer holding ``HELD_ROOM`` batches, within ``memory_bytes`` (at
    least 2 slots) and ``MAX_SLOTS``. The slots beyond those in use take no memory."""
    most = MAX_SLOTS if memory_bytes is None else min(MAX_SLOTS, memory_bytes // slot_bytes)
    return ring_slots(slot_bytes, max_workers, HELD_ROOM, max(2, most))


def ring_slots(slot_bytes: int, workers: int, held: int, capacity: int) -> int:
    """The ring's slots to use: two for each worker (the batch it builds and the next, as
    torch's ``prefetch_factor=2``: batches are taken in order, and with one each, workers done
    early would wait for a slot behind a slow one; 16 latency-bound workers ran at 0.74x the
    rate on 21 slots they had on 34), one for each of the ``held`` batches the trainer holds,
    one ready, more for small batches (``SMALL_BATCH_SLOTS`` within ``ring_bytes_target()``),
    never more than the ``capacity`` the ring was made with."""
    if slot_bytes <= 0 or workers < 0 or held < 0 or capacity < 1:
        raise ValueError(f"ring_slots({slot_bytes=}, {workers=}, {held=}, {capacity=})")
    needed = 2 * workers + held + 1
    small = min(SMALL_BATCH_SLOTS, ring_bytes_target() // slot_bytes)
    return min(capacity, max(needed, small))


def idle_share(idle_s: float, busy_s: float) -> float:
    """The share of the workers' time they waited for a task (no slot was free for one), of
    the time they reported (with each reply: busy building it, idle before it), not of their
    wall time: a worker given no task reports nothing until it gets one (while tasks are
    packed on one worker, say), and its wait would be missing from a share of the wall time."""
    reported = idle_s + busy_s
    return idle_s / reported if reported > 0 else 0.0


class Window(NamedTuple):
    """What the pipeline saw over one control window. Times are seconds, summed over the
    workers where they say so."""

    seconds: float            # wall time of the window
    batches: int              # batches delivered to the trainer
    trainer_wait_s: float     # the trainer waited for a batch
    worker_busy_s: float      # workers building batches (wall time, summed over workers)
    worker_cpu_s: float       # the workers' CPU time, summed
    ring_full_s: float        # wall time with no slot free for a new task: the window's
                              # seconds times the workers' ``idle_share``
    workers: int              # workers that ran through the window
    trainer_cpu_s: float = 0.0  # the training process's own CPU (worker processes excluded)
    steady: bool = True       # False: a worker restarted, started or stopped during the
                              # window; its numbers describe no one count, it is not judged

    @property
    def rate(self) -> float:
        return self.batches / self.seconds

    @property
    def wait_fraction(self) -> float:
        return self.trainer_wait_s / self.seconds

    @property
    def full_fraction(self) -> float:
        return self.ring_full_s / self.seconds

    @property
    def cpu_cores(self) -> float:
        """Cores the workers and the trainer used together."""
        return (self.worker_cpu_s + self.trainer_cpu_s) / self.seconds

    def needed_workers(self) -> float:
        """Workers that keep up with the trainer, with ``HEADROOM``: the module's model,
        ``busy / step``, its batches cancelling out."""
        trainer_s = self.seconds - self.trainer_wait_s
        return HEADROOM * self.worker_busy_s / trainer_s if trainer_s > 0 else math.inf

    def joined(self, later: Window) -> Window:
        """This window and the ``later`` one as one (the same steady count of workers)."""
        return Window(self.seconds + later.seconds, self.batches + later.batches,
                      self.trainer_wait_s + later.trainer_wait_s,
                      self.worker_busy_s + later.worker_busy_s,
                      self.worker_cpu_s + later.worker_cpu_s,
                      self.ring_full_s + later.ring_full_s, later.workers,
                      self.trainer_cpu_s + later.trainer_cpu_s, self.steady and later.steady)


def default_max_workers() -> int:
    """The most workers a tuned pool may run when not told: 16, or the usable cores if more."""
    return max(16, usable_cores())


def usable_cores() -> int:
    """The cores this process may run on (its affinity), or the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Budget:
    """What the workers may use. ``cpu`` counts the trainer's own CPU too."""

    max_workers: int
    cpu: float = field(default_factory=usable_cores)  # cores
    memory_bytes: int | None = None  # for the workers and the ring (``measured_memory``)
    min_workers: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers or self.cpu <= 0:
            raise ValueError(f"a budget needs 1 <= min_workers <= max_workers and cpu > 0: "
                             f"{self}")


class _Change(NamedTuple):
    """A change of the count, until windows at the new count judge it."""

    before: int
    rate_before: float  # batches/s at ``before``
    grew: bool


class WorkerTuner:
    """The worker count that keeps the trainer fed with the least CPU and memory.

    Each judged window (``observe``) applies the first rule that fits:

    * over budget (the workers' memory exceeds ``budget.memory_bytes``, checked at every
      call, or the CPU used exceeds ``budget.cpu`` by ``CPU_MARGIN``): shrink to fit, at
      once;
    * a change not judged yet waits for ``JUDGE_WINDOWS`` windows at the new count. A growth
      that raised the rate by less than ``MIN_GAIN`` while the trainer still waits is undone,
      and no growth is tried again for ``COOL_DOWN_S``, doubled each time in a row it fails:
      more workers do not help CPU-bound work on a full machine, nor a shared bottleneck
      (storage, the GIL), and retries come ever more rarely there. A shrink after which the
      trainer waits is undone, and the count it came from is kept as a floor until a growth;
    * input-bound (the trainer waited over ``INPUT_BOUND`` of each of the last
      ``JUDGE_WINDOWS``, a single slow window being no trend) with CPU free (the CPU used at
      least ``CPU_MARGIN`` below the budget) and slots free (the ring full for less than
      ``RING_MOSTLY_FULL``: more workers would find none): grow toward the model's need
      over those windows (the module's text), by at least one and at most doubling; the
      need is reached in a few steps, not one worker at a time. Bounded by
      ``max_workers``, memory, and the CPU budget: each worker is counted busy, at the
      cores a busy one uses now (``worker_cpu_s / worker_busy_s``), beside the trainer's,
      and one fits once half of it does, since an idle core costs more than a slightly
      full machine;
    * trainer-bound (over the last ``SHRINK_WINDOWS``, the trainer waited under
      ``TRAINER_BOUND`` in each, and the ring was full for most of them: some worker always
      idle for want of a slot): one worker less, at most every ``SHRINK_EVERY_S``, while the
      model says the rest keep up with ``SHRINK_SLACK`` to spare.

    Hysteresis: between the two thresholds of waiting nothing changes; a growth aims at the
    need, a shrink stops ``SHRINK_SLACK`` above it, and both read several windows, so that
    the need's noise from window to window moves neither: a steady load keeps its count.

    A window that is not ``steady`` is not judged; one with fewer than ``MIN_BATCHES`` is
    joined to the next. A steady window at another count than asked for means the pool
    settled there (it could not start more, or was set from outside): the tuner takes it as
    its own count.
    """

    def __init__(self, budget: Budget, start_workers: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.worker_bytes: int | None = None  # one worker's memory, once measured
        self.shared_bytes = 0  # what the pipeline takes whatever the count, once measured
        self.clock = clock
        self.workers = self._bounded(start_workers)
        self.reason = "started"  # why the count is what it is: the last decision, for a log
        self._windows: deque[Window] = deque(maxlen=SHRINK_WINDOWS)  # the last at this count
        self._short: Window | None = None  # too few batches yet: joined to the next window
        self._change: _Change | None = None
        self._changed_at = clock()
        self._grow_after = -math.inf
        self._cool_down = COOL_DOWN_S
        self._floor = budget.min_workers

    def measured_memory(self, worker_bytes: int, shared_bytes: int) -> None:
        """What one more worker costs (its own memory and its slots) and what the pipeline
        takes whatever the count (the rest of the ring): the memory budget's ceiling, checked
        at every ``observe``, follows them from now on."""
        self.worker_bytes, self.shared_bytes = worker_bytes, shared_bytes

    def ceiling(self) -> int:
        """The most workers ``max_workers`` and the memory budget allow."""
        most = self.budget.max_workers
        if self.budget.memory_bytes is not None and self.worker_bytes:
            most = min(most, (self.budget.memory_bytes - self.shared_bytes) // self.worker_bytes)
        return max(self.budget.min_workers, most)

    def limit(self) -> str:
        """The bound the count is held at, by name ('max_workers', 'memory_budget'); '' below
        both."""
        ceiling = self.ceiling()
        if self.workers < ceiling:
            return ""
        return "max_workers" if ceiling >= self.budget.max_workers else "memory_budget"

    def growing(self) -> bool:
        """Whether the count may still rise on its own: below its ceiling, not cooling down
        after a growth that did not raise the rate, and with room for one more worker in the
        CPU budget at the last window judged. While it does, an input-bound loader's fix is
        the tuner's next growth, not more workers or cores from the user."""
        if self.workers >= self.ceiling() or self.clock() < self._grow_after:
            return False
        if not self._windows:  # a change being judged, or no window yet
            return True
        last = self._windows[-1]
        return (last.cpu_cores <= self.budget.cpu - CPU_MARGIN
                and self._cpu_ceiling(last) > self.workers)

    def observe(self, window: Window) -> int:
        """Judge one window; the worker count wanted now."""
        if self.workers > self.ceiling():  # a worker's memory measured since
            self._set(self.ceiling(), "over budget: memory")
            self._change = None
        judged = self._judgeable(window)
        if judged is None:
            return self.workers
        if judged.workers != self.workers:
            self._set(judged.workers, "the pool settled at this count")
            self._change = None
        self._windows.append(judged)
        now = self.clock()
        if not (self._shrink_to_cpu_budget(judged) or self._judging(now)
                or self._grow(judged, now)):
            self._shrink(now)
        return self.workers

    def _judgeable(self, window: Window) -> Window | None:
        """The window to judge: None for one that is not steady, or too short yet."""
        if not window.steady or window.seconds <= 0:
            self._short = None
            return None
        if self._short is not None and self._short.workers == window.workers:
            window = self._short.joined(window)
        self._short = window if window.batches < MIN_BATCHES else None
        return None if self._short is not None else window

    def _shrink_to_cpu_budget(self, window: Window) -> bool:
        if window.cpu_cores <= self.budget.cpu + CPU_MARGIN:
            return False
        wanted = self._bounded(self._cpu_ceiling(window))
        if wanted >= self.workers:
            return False
        self._set(wanted, f"over budget: {window.cpu_cores:.1f} cores used")
        self._change = None
        return True

    def _judging(self, now: float) -> bool:
        """Judge the last change once it has ``JUDGE_WINDOWS``: True while it waits for them,
        or when it was undone."""
        change = self._change
        if change is None:
            return False
        if len(self._windows) < JUDGE_WINDOWS:
            return True
        self._change = None
        rate = fmean(w.rate for w in self._windows)
        waited = fmean(w.wait_fraction for w in self._windows)
        if change.grew:
            if waited > INPUT_BOUND and rate < change.rate_before * (1 + MIN_GAIN):
                self._grow_after = now + self._cool_down
                self._cool_down = min(2 * self._cool_down, MAX_COOL_DOWN_S)
                self._set(change.before, f"undone: {rate:.0f} batches/s did not rise")
                return True
            self._cool_down = COOL_DOWN_S
        elif waited > TRAINER_BOUND:
            self._floor = change.before
            self._set(change.before, f"undone: the trainer waited {waited:.0%}")
            return True
        return False

    def _grow(self, window: Window, now: float) -> bool:
        recent = list(self._windows)[-JUDGE_WINDOWS:]
        if (len(recent) < JUDGE_WINDOWS or now < self._grow_after
                or any(w.wait_fraction <= INPUT_BOUND or w.full_fraction >= RING_MOSTLY_FULL
                       for w in recent)
                or window.cpu_cores > self.budget.cpu - CPU_MARGIN):
            return False
        needed = fmean(w.needed_workers() for w in recent)
        target = self.workers * 2 if math.isinf(needed) else math.ceil(needed)
        wanted = min(max(target, self.workers + 1), 2 * self.workers, self.ceiling(),
                     self._cpu_ceiling(window))
        if wanted <= self.workers:
            return False
        self._change = _Change(self.workers, self._recent_rate(), grew=True)
        self._floor = self.budget.min_workers
        self._set(wanted, f"input-bound: the trainer waited {window.wait_fraction:.0%}")
        return True

    def _shrink(self, now: float) -> None:
        recent = self._windows
        if (len(recent) < SHRINK_WINDOWS or now - self._changed_at < SHRINK_EVERY_S
                or any(w.wait_fraction >= TRAINER_BOUND for w in recent)):
            return
        full = fmean(w.full_fraction for w in recent)
        needed = SHRINK_SLACK * fmean(w.needed_workers() for w in recent)
        fewer = self.workers - 1
        if full > RING_MOSTLY_FULL and fewer >= max(self._floor, needed):
            self._change = _Change(self.workers, self._recent_rate(), grew=False)
            self._set(fewer, f"trainer-bound: the ring was full {full:.0%}")

    def _cpu_ceiling(self, window: Window) -> int:
        """The most workers the CPU budget holds beside the trainer, each busy at the cores a
        busy worker uses now; one fits once half of it does."""
        share = window.worker_cpu_s / window.worker_busy_s if window.worker_busy_s > 0 else 0
        if share <= 0:
            return self.ceiling()  # no CPU measured: the budget says nothing
        trainer_cores = window.trainer_cpu_s / window.seconds
        fits = (self.budget.cpu - trainer_cores) / share + 0.5
        if math.isnan(fits):  # inf - inf: a window too short to measure (nanoseconds)
            return 0
        return math.floor(min(max(fits, 0), self.ceiling()))

    def _recent_rate(self) -> float:
        return fmean(w.rate for w in self._windows)

    def _bounded(self, workers: int) -> int:
        return max(self.budget.min_workers, min(workers, self.ceiling()))

    def _set(self, workers: int, reason: str) -> None:
        self.workers = self._bounded(workers)
        self.reason = reason
        self._windows.clear()
        self._changed_at = self.clock()
