"""The streaming workloads: shmseq's ``ShardSequence`` against PyTorch's ``DataLoader`` over the
same tar shards, with the same decode; and, on the JPEG shards, the decode moved into the trainer.

Both loaders run the very same reading code: torch's is ``DataLoader(ShardWorker(index,
decode), batch_size=None, sampler=<the ShardPlan's batches, epoch after epoch>, num_workers=2,
persistent_workers=True, prefetch_factor=5, fork)``, so each of its workers calls
``worker[ids]`` as shmseq's do, on the same ids in the same order; ``ShardSequence`` is given
that plan's arguments (seed, ``shuffle_window``, ``last_batch='discard'``), 2 workers, 10 slots
sized by its first batches (no ``slot_bytes``, as a user writes it), fork. Both hand over torch
CPU tensors. Two kinds of shards
(``shard_data``): photo-like JPEGs decoded and random-resized-cropped to 224 x 224 in the
workers (``shards-jpeg``: decode-bound), and raw 224 x 224 x 3 uint8 images (``shards-uint8``:
no decoding, the transport and the reading are what is left).

The third system (``STAGE``, JPEG shards only) is what ``shmseq.decode`` is for: the workers
read each JPEG's encoded bytes (``encoded_sample()``) and a ``DecodeStage`` decodes, crops and
normalizes every batch in the trainer's process, with nvJPEG where there is CUDA
(``shmseq-gpu-decode``), or else in the trainer's own threads with simplejpeg
(``shmseq-trainer-decode``: the stage's CPU path, which spends the trainer's CPU by design).

The consumer checks every batch: its labels (each sample's id) against the plan's, and for
the uint8 shards each image's marker bytes; the stage's images are read whole, as a trainer's
first layer reads them (a mean per image, which on a GPU also waits for the decode). The runs
interleave the systems, as the transport matrix's do; the report gives images/s and the
trainer's CPU a batch and an image, the first batch, the PSS of the trainer and its workers
(``memory.py``), medians and min-max over the repeats, shmseq's ratio to torch (and the
stage's to both) within each repeat, and each worker-decoding loader's rate
over the limit: the same ``worker[ids]`` calls by 1 and by 2 processes with no transport
(``limit_rate``).

The workloads and the systems' names are ``streaming_workloads``'s, the report
``streaming_report``'s; their names stay importable from here.
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, Callable, ContextManager, Iterator

import numpy as np

from shmseq import ShmSequence
from shmseq.decode import encoded_sample
from shmseq.engine import torch_available
from shmseq.shards import ShardIndex, ShardPlan, ShardSequence, ShardWorker
from shmseq.vision import IMAGENET_MEAN, IMAGENET_STD

from . import limit, systems
from .runner import LIMIT, Run, timed_run
from .shard_data import largest_sample
from .streaming_report import (COLUMNS, LIMIT_COLUMN, REMOTE_COLUMNS, STAGE_ON_CPU, RemotePart,
                               cells_of, highlights, images_per_s, images_rate, markdown, paired,
                               ratios, shown, stage_note, table)
from .streaming_workloads import (QUICK_IMAGES, SEED, SHMSEQ, STAGE, STAGE_DEVICE, STREAM_WORKLOADS,
                                  TORCH, Prepared, ShardWorkload, decode_stage, quick)
from .workloads import BatchMismatch, _head, _tail

__all__ = ["COLUMNS", "LIMIT_COLUMN", "NORMALIZED", "QUICK_IMAGES", "REMOTE_COLUMNS", "SEED",
           "SHMSEQ", "STAGE", "STAGE_DEVICE", "STAGE_ON_CPU", "STREAM_SYSTEMS",
           "STREAM_SYSTEM_NAMES", "STREAM_TORCH_SYSTEMS", "STREAM_WORKLOADS", "TORCH",
           "EpochBatches", "Expected", "Prepared", "RemotePart", "ShardWorkload", "cells_of",
           "checker", "cpu_out", "decode_stage", "highlights", "images_per_s", "images_rate",
           "limit_rate", "markdown", "measurer", "paired", "quick", "ratios", "runs_on",
           "shard_sequence", "shmseq_decode_stage", "shmseq_shards", "shown", "stage_checker",
           "stage_note", "started", "table", "torch_shards"]


# -- the loaders -------------------------------------------------------------------------------
class EpochBatches:
    """torch's sampler: the plan's batches (int64 id arrays), epoch 0, 1, ... without end."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            yield from self.plan.batches(epoch)


def shard_sequence(shards: ShardIndex | str, workload: ShardWorkload,
                   decode: Callable[[dict], object], batch_bytes: int | None = None,
                   **options: Any) -> ShardSequence:
    """``ShardSequence`` over ``shards`` (an index, or its URL) with the plan's arguments,
    slots sized to ``batch_bytes`` up front where batches vary in size (so that none takes the
    overflow path), else (None) by the first batches."""
    slot_bytes = None if batch_bytes is None else batch_bytes + systems.SLOT_SLACK
    return ShardSequence(shards, decode, **workload.bounded, batch_size=workload.batch_size,
                         shuffle=True, seed=SEED, last_batch="discard", slot_bytes=slot_bytes,
                         buffer=systems.IN_FLIGHT, num_workers=systems.NUM_WORKERS,
                         start_method=systems.START_METHOD, **options)


@contextmanager
def started(seq: ShmSequence) -> Iterator[Iterator]:
    """The sequence's batches, epoch after epoch; finished after the block."""
    try:
        yield systems._epochs(seq.start())
    finally:
        seq.finish()


def cpu_out() -> str:
    """What the worker-decoding systems hand over: torch CPU tensors, or numpy without torch."""
    return "cpu" if torch_available() else "null"


def shmseq_shards(prepared: Prepared) -> ContextManager[Iterator]:
    """``ShardSequence`` decoding in its workers, its ring sized by its first batches (its
    default: crops of one size, batches of one size)."""
    return started(shard_sequence(prepared.index, prepared.workload, prepared.decode,
                                  out_type=cpu_out()))


def shmseq_decode_stage(prepared: Prepared) -> ContextManager[Iterator]:
    """``ShardSequence`` whose workers only read the encoded JPEGs, decoded in the trainer by a
    ``DecodeStage`` on ``STAGE_DEVICE`` into normalized float ``(N, 3, side, side)``."""
    workload = prepared.workload
    return started(shard_sequence(prepared.index, workload, encoded_sample(),
                                  workload.batch_size * largest_sample(prepared.index),
                                  out_type=STAGE_DEVICE, device=decode_stage(workload.side)))


def torch_shards(prepared: Prepared, **options: Any) -> ContextManager[Iterator]:
    """torch's ``DataLoader`` over a ``ShardWorker``: one ``worker[ids]`` per batch
    (``options``: the worker's, ``storage_options`` say)."""
    return systems._dataloader(ShardWorker(prepared.index, prepared.decode, **options),
                               "file_descriptor", batch_size=None,
                               sampler=EpochBatches(prepared.workload.plan(prepared.index)))


STREAM_SYSTEMS: dict[str, Callable[[Prepared], ContextManager[Iterator]]] = {
    SHMSEQ: shmseq_shards,
    TORCH: torch_shards,
    STAGE: shmseq_decode_stage,
}
STREAM_TORCH_SYSTEMS = (TORCH, STAGE)
STREAM_SYSTEM_NAMES = [LIMIT, *STREAM_SYSTEMS]  # the limit is timed apart (``limit_rate``)


def runs_on(name: str, workload: ShardWorkload) -> bool:
    """Whether a system runs on a workload: the decode stage decodes JPEGs only."""
    return name != STAGE or workload.kind == "jpeg"


# -- the limit: the workers' own work, no transport --------------------------------------------
def _build(prepared: Prepared, wid: int, processes: int, seconds: float, warmup_seconds: float,
           barrier: Barrier, rates: Queue) -> None:
    worker = ShardWorker(prepared.index, prepared.decode)
    expected = Expected(prepared.workload, prepared.index)
    built, start = 0, time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        worker[expected(wid + built * processes)]
        built += 1
    barrier.wait()
    timed, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or not timed:
        worker[expected(wid + (built + timed) * processes)]
        timed += 1
    rates.put(timed / elapsed)


def limit_rate(prepared: Prepared, seconds: float, warmup_seconds: float = 0.0) -> float:
    """The faster of 1 and ``NUM_WORKERS`` processes (as the transport matrix's limit)."""
    return limit.limit_rate(prepared, seconds, warmup_seconds, build=_build, slack=60.0)


# -- checking and timing -----------------------------------------------------------------------
class Expected:
    """The ``k``-th batch's ids in the endless stream of the plan's epochs."""

    def __init__(self, workload: ShardWorkload, index: ShardIndex) -> None:
        self.plan = workload.plan(index)
        self.length = self.plan.length(0)
        self._epoch = -1
        self._batches: list[np.ndarray] = []

    def __call__(self, k: int) -> np.ndarray:
        epoch, position = divmod(k, self.length)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self.plan.batches(epoch)
        return self._batches[position]


def _check_labels(workload: ShardWorkload, k: int, labels: np.ndarray, ids: np.ndarray) -> None:
    if not np.array_equal(labels, ids):
        raise BatchMismatch(f"{workload.name} batch {k}: labels {labels[:4]}... expected "
                            f"{ids[:4]}...")


def checker(prepared: Prepared, system: str = SHMSEQ) -> Callable[[int, object], None]:
    """``check(k, batch)``: raise ``BatchMismatch`` unless ``batch`` is the ``k``-th of the
    plan's stream: its shape, its labels (the samples' ids), and for raw images their markers
    (the decode stage's batches: ``stage_checker``)."""
    if system == STAGE:
        return stage_checker(prepared)
    workload = prepared.workload
    expected = Expected(workload, prepared.index)
    shape = (workload.batch_size, *workload.image_shape)

    def check(k: int, batch: Any) -> None:
        images, labels = (np.asarray(part) for part in batch)
        ids = expected(k)
        if images.shape != shape or images.dtype != np.uint8:
            raise BatchMismatch(f"{workload.name} batch {k}: images {images.dtype}{images.shape}")
        _check_labels(workload, k, labels, ids)
        if workload.kind == "uint8" and not (np.array_equal(images[:, 0, 0, 0], _head(ids)) and
                                             np.array_equal(images[:, -1, -1, -1], _tail(ids))):
            raise BatchMismatch(f"{workload.name} batch {k}: image markers do not match labels "
                                "(torn or stale batch)")
    return check


NORMALIZED = (min(-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)),
              max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)))


def stage_checker(prepared: Prepared) -> Callable[[int, object], None]:
    """``check(k, batch)`` for the decode stage's float ``(N, 3, side, side)`` batches: their
    shape, their labels, and every pixel read, as a trainer's first layer reads them (one mean
    per image, which on a GPU waits for the batch's decode: no work is left pending), each
    within what normalizing ``[0, 1]`` can give."""
    workload = prepared.workload
    expected = Expected(workload, prepared.index)
    shape = (workload.batch_size, 3, workload.side, workload.side)

    def check(k: int, batch: Any) -> None:
        images, labels = batch
        means = images.mean(dim=(1, 2, 3)).cpu().numpy()
        if tuple(images.shape) != shape or not images.is_floating_point():
            raise BatchMismatch(f"{workload.name} batch {k}: images {images.dtype}"
                                f"{tuple(images.shape)}, expected floats of {shape}")
        _check_labels(workload, k, labels.cpu().numpy(), expected(k))
        if not (np.isfinite(means).all() and NORMALIZED[0] <= means.min() <= means.max()
                <= NORMALIZED[1]):
            raise BatchMismatch(f"{workload.name} batch {k}: image means {means.min():.2f} to "
                                f"{means.max():.2f}, outside the normalized range "
                                f"{NORMALIZED[0]:.2f} to {NORMALIZED[1]:.2f}")
    return check


def measurer(prepared: dict[str, Prepared]) -> Callable[..., Run]:
    """``run_matrix``'s ``measure`` for the streaming workloads (by name, prepared)."""
    def measure(name: str, workload: ShardWorkload, repeat: int, seconds: float,
                warmup_seconds: float) -> Run:
        ready = prepared[workload.name]
        if name == LIMIT:
            return Run(name, workload.name, repeat, limit_rate(ready, seconds, warmup_seconds))
        return timed_run(name, workload.name, repeat, lambda: STREAM_SYSTEMS[name](ready),
                         checker(ready, name), seconds, warmup_seconds,
                         workload.early_batches)
    return measure
