"""Measures one system on one workload, and runs the whole matrix round-robin.

The repeats interleave the systems (each repeat goes through all of them, in a
rotated order), so that drift on a shared machine hits every system alike.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

from .limit import limit_rate
from .memory import SAMPLE_SECONDS, PeakPss
from .systems import SYSTEMS, UNORDERED
from .workloads import Workload, check_any_batch, check_batch

LIMIT = "limit"
EARLY_BATCHES = 100  # the first batches after the first, timed apart: how soon the rate is steady
MIN_BATCHES = 5


@dataclass
class Run:
    """One measurement. The limit has no consumer, hence no CPU time, first batch nor PSS."""

    system: str
    workload: str
    repeat: int
    batches_per_second: float
    cpu_us_per_batch: float | None = None
    first_batch_seconds: float | None = None
    early_batches_per_second: float | None = None  # over the EARLY_BATCHES after the first
    peak_pss_bytes: int | None = None  # the trainer's and its children's (memory.py)
    # a remote loader's, over its timed window (streaming's remote mode):
    requests_per_sample: float | None = None  # requests the server answered
    read_amplification: float | None = None   # bytes it sent over the bytes of the samples
    cache_peak_bytes: int | None = None       # the most its shard cache held
    # the first epoch's batches over its time from the start, making the loader included (a
    # remote loader's, from a cold cache): what a short job, or a user's first try, sees
    epoch_batches_per_second: float | None = None


class Window:
    """What a run observes over its timed window besides the rate: ``begin(k)`` as it starts at
    batch ``k``, ``end(k)`` as it ends before batch ``k``, returning ``Run`` fields."""

    def begin(self, k: int) -> None:
        pass

    def end(self, k: int) -> dict:
        return {}


def _consume(batches: Iterator, check: Callable[[int, object], None], k: int, minimum: int,
             seconds: float, whole: int = 1) -> int:
    """Take and check batches ``k``, ``k + 1``, ... for at least ``minimum`` batches and
    ``seconds``, up to a multiple of ``whole``; the next ``k``."""
    first, since = k, time.perf_counter()
    while k - first < minimum or time.perf_counter() - since < seconds or k % whole:
        check(k, next(batches))
        k += 1
    return k


def measure(name: str, workload: Workload, repeat: int, seconds: float,
            warmup_seconds: float) -> Run:
    """Start the system, take and check its first batch, time the ``EARLY_BATCHES`` after it
    (the rate before the steady state), warm up, then time ``seconds`` (the steady state).

    The consumer's CPU time is ``process_time``: every thread of this process.
    """
    if name == LIMIT:
        return Run(name, workload.name, repeat, limit_rate(workload, seconds, warmup_seconds))
    if name in UNORDERED:
        def check(k: int, batch: Any) -> None:
            check_any_batch(workload, batch)
    else:
        def check(k: int, batch: Any) -> None:
            check_batch(workload, k, batch)
    return timed_run(name, workload.name, repeat, lambda: SYSTEMS[name](workload), check,
                     seconds, warmup_seconds)


def timed_run(name: str, workload: str, repeat: int, system: Callable[[], ContextManager[Iterator]],
              check: Callable[[int, object], None], seconds: float, warmup_seconds: float,
              early_batches: int = EARLY_BATCHES, whole: int = 1,
              window: Window | None = None, window_at: float = 0.0,
              pss_every: float | None = SAMPLE_SECONDS, epoch: int | None = None) -> Run:
    """``measure``'s timing for any system (``system()`` makes it, on the clock: a context
    manager giving its batches) and any ``check(k, batch)`` of the ``k``-th batch: the first
    batch, the ``early_batches`` after it, a warm-up, then ``seconds`` of the steady state; the
    process tree's peak PSS, sampled every ``pss_every`` seconds of the warm-up (None: only as
    it begins and ends) and at the end (none of its timed windows pays for the sampling).
    ``whole``: the timed window begins and ends at a multiple of that many batches (an
    epoch's); ``window`` observes it; ``window_at``: it begins no sooner than that many seconds
    after the start (a loader that tunes itself is timed once it has had that long); ``epoch``:
    the first epoch's batches, taken before the warm-up and timed from the start."""
    window = window or Window()
    observed: dict = {}
    start = time.perf_counter()
    with system() as batches:
        k = _consume(batches, check, 0, 1, 0)
        first_batch = time.perf_counter() - start
        k = _consume(batches, check, k, early_batches, 0)
        early = early_batches / (time.perf_counter() - start - first_batch)
        if epoch is not None:
            k = _consume(batches, check, k, epoch - k, 0)
            observed = {"epoch_batches_per_second": k / (time.perf_counter() - start)}
        with PeakPss(pss_every) as memory:
            warmup = max(warmup_seconds, window_at - (time.perf_counter() - start))
            k = _consume(batches, check, k, 0, warmup, whole)
        window.begin(k)
        cpu0, t0 = time.process_time(), time.perf_counter()
        timed = _consume(batches, check, k, MIN_BATCHES, seconds, whole) - k
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        observed.update(window.end(k + timed))
        memory.sample()
    return Run(name, workload, repeat, timed / elapsed, cpu / timed * 1e6, first_batch, early,
               memory.peak, **observed)


def _everywhere(name: str, workload: object) -> bool:
    return True


def run_matrix(systems: list[str], workloads: list, *, repeats: int, seconds: float,
               warmup_seconds: float, log: Callable[[str], None],
               measure: Callable[..., Run] = measure,
               runs_on: Callable[[str, Any], bool] = _everywhere) -> list[Run]:
    """Every system on every workload it ``runs_on``, ``repeats`` times, round-robin
    (``measure(name, workload, repeat, seconds, warmup_seconds)`` times one)."""
    runs = []
    for repeat in range(repeats):
        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        for workload in workloads:
            for name in (name for name in order if runs_on(name, workload)):
                run = measure(name, workload, repeat, seconds, warmup_seconds)
                gc.collect()
                log(f"repeat {repeat + 1}/{repeats} {workload.name:<12} {name:<21} "
                    f"{run.batches_per_second:9.1f} batches/s")
                runs.append(run)
    return runs
