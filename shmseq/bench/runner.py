"""Measures one system on one workload, and runs the whole matrix round-robin.

The repeats interleave the systems (each repeat goes through all of them, in a
rotated order), so that drift on a shared machine hits every system alike.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

from .limit import limit_rate
from .systems import SYSTEMS
from .workloads import Workload, check_batch

LIMIT = "limit"
WARMUP_BATCHES = 3
MIN_BATCHES = 5


@dataclass
class Run:
    """One measurement. The limit has no consumer, hence no CPU time nor first batch."""

    system: str
    workload: str
    repeat: int
    batches_per_second: float
    cpu_us_per_batch: float | None = None
    first_batch_seconds: float | None = None


def _enough(count: int, minimum: int, since: float, seconds: float) -> bool:
    return count >= minimum and time.perf_counter() - since >= seconds


def measure(name: str, workload: Workload, repeat: int, seconds: float,
            warmup_seconds: float) -> Run:
    """Start the system, take and check its first batch, warm up, then time ``seconds``.

    The consumer's CPU time is ``process_time``: every thread of this process.
    """
    if name == LIMIT:
        return Run(name, workload.name, repeat, limit_rate(workload, seconds))
    system = SYSTEMS[name]
    start = time.perf_counter()
    with system(workload) as batches:
        check_batch(workload, 0, next(batches))
        first_batch = time.perf_counter() - start
        k, since = 1, time.perf_counter()
        while not _enough(k - 1, WARMUP_BATCHES, since, warmup_seconds):
            check_batch(workload, k, next(batches))
            k += 1
        k0, cpu0, t0 = k, time.process_time(), time.perf_counter()
        while not _enough(k - k0, MIN_BATCHES, t0, seconds):
            check_batch(workload, k, next(batches))
            k += 1
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    timed = k - k0
    return Run(name, workload.name, repeat, timed / elapsed, cpu / timed * 1e6, first_batch)


def run_matrix(systems: list[str], workloads: list[Workload], *, repeats: int, seconds: float,
               warmup_seconds: float, log: Callable[[str], None]) -> list[Run]:
    """Every system on every workload, ``repeats`` times, round-robin."""
    runs = []
    for repeat in range(repeats):
        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        for workload in workloads:
            for name in order:
                run = measure(name, workload, repeat, seconds, warmup_seconds)
                gc.collect()
                log(f"repeat {repeat + 1}/{repeats} {workload.name:<12} {name:<15} "
                    f"{run.batches_per_second:9.1f} batches/s")
                runs.append(run)
    return runs
