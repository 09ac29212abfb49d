"""The loaders under test, each in its best honest configuration.

A system is a context manager: entering it starts the loader (worker pool and
all, so the runner's clock includes the start) and gives an endless iterator
whose ``k``-th batch holds ``workload.indices(k)`` as torch CPU tensors (numpy
arrays where torch is not installed); leaving it stops every process. All use 2
workers, about 10 batches in flight and fork. PyTorch's own loaders are in
``TORCH_SYSTEMS``: they need torch.
"""
from __future__ import annotations

import functools
import itertools
import multiprocessing
import warnings
from contextlib import contextmanager
from multiprocessing.queues import Queue
from typing import Any, Callable, ContextManager, Final, Iterator

import numpy as np

from shmseq import DataLoader as ShmDataLoader
from shmseq import ShmSequence
from shmseq.engine import torch_available

if torch_available():
    import torch
    from torch.utils.data import BatchSampler, DataLoader

from .bare_ring import bare_ring
from .workloads import (POOL_ROWS, DyingWorker, InPlaceWorker, ReturningWorker, Workload, augmented,
                        image_pool, one_operator_thread)

NUM_WORKERS = 2
IN_FLIGHT = 10             # shmseq's ring slots, DataLoader's prefetch, the queue's open tasks
                           # (``--buffer`` sets it: every system reads it when it starts)
SLOT_SLACK = 64 * 1024     # room for a slot's header and alignment
START_METHOD: Final = "fork"
JOIN_SECONDS = 5.0

Batches = Iterator[tuple]
System = Callable[[Workload], ContextManager[Batches]]


def _to_torch(batch: tuple) -> tuple:
    """What a training loop gets: torch tensors, where torch is installed."""
    if not torch_available():
        return batch
    return tuple(torch.from_numpy(part) for part in batch)


# -- shmseq ------------------------------------------------------------------------------------
def _epochs(seq: ShmSequence) -> Batches:
    """Iterating again yields the next epoch; shmseq's workers run on across the boundary."""
    while True:
        yield from seq


@contextmanager
def _shmseq(workload: Workload, worker_class: type, thread_type: str,
            worker_restarts: int = 0) -> Iterator[Batches]:
    """Slots sized to the batch up front, which spares the first batches' trip through the pipe."""
    seq = ShmSequence(worker_class(workload), workload.epoch_samples,
                      batch_size=workload.batch_size, slot_bytes=workload.batch_bytes + SLOT_SLACK,
                      buffer=IN_FLIGHT, num_workers=NUM_WORKERS, shuffle=False, seed=0,
                      thread_type=thread_type, out_type="cpu" if torch_available() else "null",
                      start_method=START_METHOD,
                      worker_restarts=worker_restarts)
    try:
        with warnings.catch_warnings():
            if worker_restarts:
                warnings.filterwarnings("ignore", "worker .* a new worker takes its place")
            yield _epochs(seq.start())
    finally:
        seq.finish()


def _shmseq_dataloader(workload: Workload) -> ContextManager[Batches]:
    """shmseq's sample-level DataLoader: one sample per index, stacked straight into the slot."""
    loader = ShmDataLoader(_Samples(workload), batch_size=workload.batch_size,
                           num_workers=NUM_WORKERS, prefetch=IN_FLIGHT - 2,
                           out_type="cpu" if torch_available() else "null",
                           slot_bytes=workload.batch_bytes + SLOT_SLACK, start_method=START_METHOD)
    return _running(loader)


@contextmanager
def _running(loader: ShmDataLoader) -> Iterator[Batches]:
    try:
        yield _epochs(loader)
    finally:
        loader.close()


# -- PyTorch DataLoader ------------------------------------------------------------------------
class _Endless:
    """Sample indices 0, 1, ... wrapping at the epoch: the loader never meets an epoch end."""

    def __init__(self, workload: Workload) -> None:
        self.size = workload.epoch_samples

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from range(self.size)


class _Samples:
    """Map-style, one sample per index: a view of its pool row (augmented, for a workload that
    augments), and its label."""

    def __init__(self, workload: Workload) -> None:
        self.pool = image_pool(workload.side)
        self.size = workload.epoch_samples
        self.augment = workload.augment

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        image = self.pool[index % POOL_ROWS]
        return (augmented(image, index) if self.augment else image), index


class _Batches:
    """Map-style, a whole batch per list of indices, built as the other systems build it."""

    def __init__(self, workload: Workload) -> None:
        self.worker = ReturningWorker(workload)

    def __getitem__(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self.worker[np.asarray(indices, dtype=np.int64)]


@contextmanager
def _dataloader(dataset: object, strategy: str,
                loader_class: type[DataLoader] | None = None, **kwargs: Any) -> Iterator[Batches]:
    """Persistent workers; ``strategy`` is how torch shares a batch's tensors with the consumer
    (``loader_class``: torch's DataLoader unless given)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:  # the type ignored: any map-style object loads, where torch's stubs ask a Dataset
        loader = (loader_class or DataLoader)(
            dataset, num_workers=NUM_WORKERS, persistent_workers=True,  # type: ignore[arg-type]
            prefetch_factor=IN_FLIGHT // NUM_WORKERS, multiprocessing_context=START_METHOD,
            **kwargs)
        batches = iter(loader)
        try:
            yield batches
        finally:
            # what its __del__ does; DataLoader has no public close (the type ignored: a method of
            # the iterators with workers, as these are, not of every iterator torch's stubs know)
            batches._shutdown_workers()  # type: ignore[attr-defined]
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def torch_samples(workload: Workload, strategy: str = "file_descriptor") -> ContextManager[Batches]:
    """Sample-level: default collate stacks each batch straight into fresh shared memory."""
    return _dataloader(_Samples(workload), strategy, batch_size=workload.batch_size,
                       sampler=_Endless(workload))


def shmseq_torch(workload: Workload) -> ContextManager[Batches]:
    """shmseq.torch's DataLoader, given exactly the arguments torch-sample's loader is given."""
    from shmseq.torch import DataLoader as RingLoader
    return _dataloader(_Samples(workload), "file_descriptor", RingLoader,
                       batch_size=workload.batch_size, sampler=_Endless(workload))


def torch_batches(workload: Workload, strategy: str = "file_descriptor") -> ContextManager[Batches]:
    """Batch-level: one ``__getitem__`` per batch, ``batch_size=None`` turns off collation."""
    return _dataloader(_Batches(workload), strategy, batch_size=None,
                       sampler=BatchSampler(_Endless(workload), workload.batch_size, drop_last=False))


# -- a pickling queue, in the manner of MDNC -----------------------------------------------------
def _queue_worker(workload: Workload, tasks: Queue, results: Queue) -> None:
    one_operator_thread()
    worker = ReturningWorker(workload)
    results.cancel_join_thread()  # at shutdown, exit without waiting for the consumer to drain
    while (task := tasks.get()) is not None:
        seq, indices = task
        results.put((seq, worker[indices]))


def _in_order(workload: Workload, tasks: Queue, results: Queue) -> Batches:
    """Keep ``IN_FLIGHT`` tasks open and hand batches over in order, as MDNC's sequences do."""
    for seq in range(IN_FLIGHT):
        tasks.put((seq, workload.indices(seq)))
    arrived = {}
    for seq in itertools.count():
        while seq not in arrived:
            done, batch = results.get()
            arrived[done] = batch
        tasks.put((seq + IN_FLIGHT, workload.indices(seq + IN_FLIGHT)))
        yield _to_torch(arrived.pop(seq))


@contextmanager
def pickling_queue(workload: Workload) -> Iterator[Batches]:
    """Worker processes put whole numpy batches on a ``multiprocessing.Queue`` (pickled)."""
    context = multiprocessing.get_context(START_METHOD)
    tasks, results = context.Queue(), context.Queue()
    workers = [context.Process(target=_queue_worker, args=(workload, tasks, results), daemon=True)
               for _ in range(NUM_WORKERS)]
    for process in workers:
        process.start()
    try:
        yield _in_order(workload, tasks, results)
    finally:
        for _ in workers:
            tasks.put(None)
        stop_processes(workers)
        for queue in (tasks, results):
            queue.close()
            queue.join_thread()


def stop_processes(processes: list) -> None:
    """Join, and kill whatever does not exit in time."""
    for process in processes:
        process.join(JOIN_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


# -- serial ------------------------------------------------------------------------------------
@contextmanager
def serial(workload: Workload, worker: Any = None) -> Iterator[Batches]:
    """Everything in the consumer's thread: no transport, and no overlap either (``worker``:
    what builds each batch, ``worker[indices]``; by default the pool's copy into fresh arrays)."""
    worker = worker or ReturningWorker(workload)
    yield (_to_torch(worker[workload.indices(k)]) for k in itertools.count())


UNORDERED = ("bare-ring",)  # batches come as they are done: the check reads which one it is

TORCH_SYSTEMS: dict[str, System] = {
    "shmseq-torch": shmseq_torch,
    "torch-sample": torch_samples,
    "torch-batch": torch_batches,
    "torch-sample-fs": functools.partial(torch_samples, strategy="file_system"),
    "torch-batch-fs": functools.partial(torch_batches, strategy="file_system"),
}
SYSTEMS: dict[str, System] = {
    "bare-ring": lambda workload: bare_ring(workload, slots=IN_FLIGHT, workers=NUM_WORKERS,
                                            start_method=START_METHOD),
    "shmseq-proc": functools.partial(_shmseq, worker_class=ReturningWorker, thread_type="proc"),
    "shmseq-inplace": functools.partial(_shmseq, worker_class=InPlaceWorker, thread_type="proc"),
    "shmseq-thread": functools.partial(_shmseq, worker_class=InPlaceWorker, thread_type="thread"),
    "shmseq-restarting": functools.partial(_shmseq, worker_class=DyingWorker, thread_type="proc",
                                           worker_restarts=10**9),
    "shmseq-dataloader": _shmseq_dataloader,
    **TORCH_SYSTEMS,
    "mp-queue": pickling_queue,
    "serial": serial,
}

# What each system is, for the report's readers: one line each.
ABOUT: dict[str, str] = {
    "bare-ring": "the least a shared-memory ring can cost: forked workers write each batch in "
                 "place into one preallocated segment, slot ids through kernel message queues; "
                 "no order, no leases, no error handling (bare_ring.py)",
    "shmseq-proc": "ShmSequence, worker processes returning each batch's arrays (written into "
                   "its slot)",
    "shmseq-inplace": "ShmSequence, worker processes building each batch in its slot "
                      "(fill_batch)",
    "shmseq-thread": "ShmSequence, worker threads building each batch in its slot",
    "shmseq-restarting": "shmseq-inplace with a worker killed every ~200 batches and replaced "
                         "(worker_restarts): what self-healing costs",
    "shmseq-dataloader": "shmseq.DataLoader: one dataset[i] per sample, stacked straight into "
                         "the slot",
    "shmseq-torch": "shmseq.torch.DataLoader, given exactly torch-sample's arguments",
    "torch-sample": "PyTorch's DataLoader, one sample per index, default collate, persistent "
                    "workers",
    "torch-batch": "PyTorch's DataLoader, a whole batch per __getitem__ through a BatchSampler "
                   "(batch_size=None), persistent workers",
    "torch-sample-fs": "torch-sample with torch's file_system sharing strategy",
    "torch-batch-fs": "torch-batch with torch's file_system sharing strategy",
    "mp-queue": "worker processes put whole numpy batches, pickled, on a multiprocessing.Queue, "
                "handed over in order (as MDNC's sequences do)",
    "serial": "every batch built in the consumer's own thread: no transport, and no overlap",
}

# Run only when asked for: torch's ``file_system`` sharing is faster on small batches, but the
# files of batches still in flight when a loader stops stay in /dev/shm until this process exits;
# shmseq-restarting (a worker killed every ~200 batches, replaced by worker_restarts) shows what
# self-healing costs, beside shmseq-inplace.
OPT_IN = ("torch-sample-fs", "torch-batch-fs", "shmseq-restarting")
