"""The limit: how fast the same worker processes build batches with no transport at all.

Each process fills batches into its own preallocated, already-faulted buffers
(as many in all as the loaders keep in flight), with the very ``fill`` the
loaders' workers call. No loader can deliver faster than this.
"""
from __future__ import annotations

import multiprocessing
import time

import numpy as np

from . import systems
from .systems import JOIN_SECONDS, NUM_WORKERS, START_METHOD, stop_processes
from .workloads import Workload, fill, image_pool, one_operator_thread


def _faulted(shape: tuple, dtype) -> np.ndarray:
    array = np.empty(shape, dtype)
    array.fill(1)  # touch every page now, as a slot ring does at start
    return array


def _build(workload: Workload, wid: int, seconds: float, barrier, rates) -> None:
    one_operator_thread()
    pool = image_pool(workload.side)
    buffers = [(_faulted((workload.batch_size, *workload.image_shape), np.uint8),
                _faulted(workload.batch_size, np.int64)) for _ in range(systems.IN_FLIGHT // NUM_WORKERS)]
    barrier.wait()
    built, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        images, labels = buffers[built % len(buffers)]
        fill(pool, workload.indices(wid + built * NUM_WORKERS), images, labels,
             workload.augment)
        built += 1
    rates.put(built / elapsed)


def limit_rate(workload: Workload, seconds: float) -> float:
    """Batches per second that ``NUM_WORKERS`` processes build together, started at once."""
    context = multiprocessing.get_context(START_METHOD)
    barrier, rates = context.Barrier(NUM_WORKERS), context.Queue()
    workers = [context.Process(target=_build, args=(workload, wid, seconds, barrier, rates),
                               daemon=True) for wid in range(NUM_WORKERS)]
    for process in workers:
        process.start()
    try:
        return sum(rates.get(timeout=seconds + JOIN_SECONDS) for _ in workers)
    finally:
        stop_processes(workers)
        rates.close()
        rates.join_thread()
