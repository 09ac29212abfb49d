"""The limit: the loaders' work with nothing else, no transport, no consumer, no batches in flight.

The same batches are built with the very ``fill`` the loaders' workers call, by one process and
by ``NUM_WORKERS`` processes in turn, each rewriting one preallocated, already-faulted buffer: the
cheapest destination there is, since it stays in the CPU's caches wherever a batch fits. The
limit is the faster of the two, each timed after a warm-up.

Why both, and why one buffer: a loader keeps several batches in flight, each in memory of its
own, and hands them over; ``serial`` builds in the consumer's one process, into a buffer that
the allocator hands back batch after batch. Where the copies are bound by memory bandwidth,
two processes build no faster than one; where a batch fits in the last-level cache, a reused
buffer is written faster than a set of in-flight buffers that does not fit. (A limit measured
with two processes cycling through as many buffers as the loaders keep in flight, 96 MB of
imagenet64 batches against a 32 MB L3, was beaten by ``serial``.) No loader does less work than
this limit's faster configuration, so none is faster but by the machine's drift between the
windows in which each is timed.
"""
from __future__ import annotations

import multiprocessing
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, Callable

import numpy as np
from numpy.typing import DTypeLike

from .systems import JOIN_SECONDS, NUM_WORKERS, START_METHOD, stop_processes
from .workloads import Workload, fill, image_pool, one_operator_thread


def _faulted(shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    array = np.empty(shape, dtype)
    array.fill(1)  # touch every page now
    return array


def _build(workload: Workload, wid: int, processes: int, seconds: float, warmup_seconds: float,
           barrier: Barrier, rates: Queue) -> None:
    one_operator_thread()
    pool = image_pool(workload.side)
    images = _faulted((workload.batch_size, *workload.image_shape), np.uint8)
    labels = _faulted(workload.batch_size, np.int64)
    built, start = 0, time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        fill(pool, workload.indices(wid + built * processes), images, labels, workload.augment)
        built += 1
    barrier.wait()
    timed, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fill(pool, workload.indices(wid + (built + timed) * processes), images, labels,
             workload.augment)
        timed += 1
    rates.put(timed / elapsed)


def build_rate(workload: object, processes: int, seconds: float, warmup_seconds: float = 0.0, *,
               build: Callable = _build, slack: float = JOIN_SECONDS) -> float:
    """Batches per second that ``processes`` processes build together with ``build`` (by
    default the transport matrix's: each into one buffer); ``slack``: seconds to wait for them
    past the timed window."""
    context = multiprocessing.get_context(START_METHOD)
    barrier, rates = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=build, daemon=True,
                               args=(workload, wid, processes, seconds, warmup_seconds, barrier,
                                     rates)) for wid in range(processes)]
    for process in workers:
        process.start()
    try:
        return sum(rates.get(timeout=warmup_seconds + seconds + slack) for _ in workers)
    finally:
        stop_processes(workers)
        rates.close()
        rates.join_thread()


def limit_rate(workload: object, seconds: float, warmup_seconds: float = 0.0,
               **how: Any) -> float:
    """Batches per second: the faster of one process and ``NUM_WORKERS`` building them
    (``how``: ``build_rate``'s ``build`` and ``slack``)."""
    return max(build_rate(workload, processes, seconds, warmup_seconds, **how)
               for processes in sorted({1, NUM_WORKERS}))
