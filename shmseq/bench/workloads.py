"""The benchmark's workloads: image batches copied row by row from an in-memory pool.

Building a batch costs one memcpy's worth of work, so what a system adds on top
of it is its transport; the ``augment`` workload instead runs a training augmentation on
every sample with torch's operators (resized crop, flip, normalization), so that the
workers' CPU is what is measured. Every sample carries its identity: its label is its
sample index, and the first and last byte of its image are markers of the pool
row it was copied from. The consumer checks a few bytes of every row, so a torn,
stale or misordered batch stops the run instead of producing a number.
"""
from __future__ import annotations

import functools
import mmap
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


POOL_ROWS = 512          # samples held in memory per image size (77 MB at 224x224)
EPOCH_BATCHES = 1000     # sample indices wrap after this many batches (one shmseq epoch)
_HEAD_MOD, _TAIL_MOD = 251, 241   # coprime markers: together they tell every pool row apart


class BatchMismatch(AssertionError):
    """A delivered batch is not the one expected at its position in the stream."""


class ImageBatches:
    """What every workload delivers: batches of ``batch_size`` uint8 ``side`` x ``side`` x 3
    images and their int64 labels (the fields are the dataclasses' own)."""

    batch_size: int
    side: int

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.side, self.side, 3)

    @property
    def batch_bytes(self) -> int:
        return self.batch_size * (self.side * self.side * 3 + np.dtype(np.int64).itemsize)


@dataclass(frozen=True)
class Workload(ImageBatches):
    """Images copied from the pool; ``augment``: each image augmented on its way (see
    ``augmented``)."""

    name: str
    batch_size: int
    side: int
    augment: bool = False

    @property
    def epoch_samples(self) -> int:
        return self.batch_size * EPOCH_BATCHES

    def indices(self, k: int) -> np.ndarray:
        """Sample indices of the ``k``-th batch of the stream every system delivers."""
        start = (k * self.batch_size) % self.epoch_samples
        return np.arange(start, start + self.batch_size, dtype=np.int64)


WORKLOADS = {w.name: w for w in (Workload("cifar32", 32, 32),   # 0.1 MB: the per-batch floor
                                 Workload("cifar", 256, 32),
                                 Workload("imagenet64", 64, 224),
                                 Workload("imagenet256", 256, 224),
                                 Workload("augment", 32, 224, augment=True))}
TRANSPORT_WORKLOADS = [name for name, workload in WORKLOADS.items() if not workload.augment]


def _head(rows: np.ndarray) -> np.ndarray:
    return (rows % _HEAD_MOD).astype(np.uint8)


def _tail(rows: np.ndarray) -> np.ndarray:
    return (rows % _TAIL_MOD).astype(np.uint8)


@functools.lru_cache(maxsize=None)
def image_pool(side: int) -> np.ndarray:
    """The marked sample pool for one image size, built once and inherited by forked workers."""
    pool = np.random.default_rng(side).integers(0, 256, (POOL_ROWS, side, side, 3), dtype=np.uint8)
    rows = np.arange(POOL_ROWS)
    pool[:, 0, 0, 0] = _head(rows)
    pool[:, -1, -1, -1] = _tail(rows)
    return pool


def fill(pool: np.ndarray, indices: np.ndarray, images: np.ndarray, labels: np.ndarray,
         augment: bool = False) -> None:
    """The per-batch work of every system: copy (or augment) the rows, write the labels.

    ``mode='clip'`` lets ``np.take`` write straight into ``images``; the default
    ``'raise'`` goes through a temporary and copies twice.
    """
    if augment:
        for row, index in enumerate(indices):
            images[row] = augmented(pool[index % POOL_ROWS], int(index))
    else:
        np.take(pool, indices % POOL_ROWS, axis=0, out=images, mode="clip")
    labels[:] = indices


def one_operator_thread() -> None:
    """In a worker process: torch's operators on one thread, as every loader's workers run them
    (torch's DataLoader, shmseq): each worker takes one core."""
    import sys
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def augmented(image: np.ndarray, index: int) -> np.ndarray:
    """A training augmentation with torch's operators, as a transform pipeline runs it: a crop
    resized back (bilinear), a horizontal flip for odd samples, normalization and back to
    bytes. The marker bytes are put back, so that the batch still says where it came from."""
    import torch
    side = image.shape[0]
    margin = 8 + index % 16
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    crop = pixels[..., margin:side - margin, margin:side - margin]
    resized = torch.nn.functional.interpolate(crop, size=(side, side), mode="bilinear",
                                              align_corners=False)
    if index % 2:
        resized = resized.flip(-1)
    normalized = (resized - resized.mean((2, 3), keepdim=True)) / (resized.std((2, 3), keepdim=True) + 1)
    out = (normalized * 32 + 128).clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy().copy()
    out[0, 0, 0], out[-1, -1, -1] = image[0, 0, 0], image[-1, -1, -1]
    return out


class _PoolWorker:
    def __init__(self, workload: Workload):
        self.shape = (workload.batch_size, *workload.image_shape)
        self.pool = image_pool(workload.side)
        self.augment = workload.augment


class ReturningWorker(_PoolWorker):
    """A plain worker: fresh arrays for every batch, as most user code returns them."""

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        images = np.empty(self.shape, np.uint8)
        labels = np.empty(len(indices), np.int64)
        fill(self.pool, indices, images, labels, self.augment)
        return images, labels


class Allocator(Protocol):
    """Where an in-place worker makes its arrays: a slot's ``SlotAllocator``, or fresh ones."""

    def empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        """An array of ``shape`` and ``dtype``, not initialised."""


class InPlaceWorker(_PoolWorker):
    """A worker that builds its batch inside the slot: its single write is the only one."""

    def fill_batch(self, indices: np.ndarray, out: Allocator) -> tuple[np.ndarray, np.ndarray]:
        images = out.empty(self.shape, np.uint8)
        labels = out.empty(len(indices), np.int64)
        fill(self.pool, indices, images, labels, self.augment)
        return images, labels


class DyingWorker(InPlaceWorker):
    """An in-place worker whose process kills itself at every ``die_every``-th batch the pool
    builds: one worker at a time, never twice on the same batch (for ``worker_restarts``).
    The count lives in memory shared by every worker forked from the consumer."""

    def __init__(self, workload: Workload, die_every: int = 200) -> None:
        super().__init__(workload)
        self.die_every = die_every
        self.built = np.frombuffer(mmap.mmap(-1, 8), np.int64)  # anonymous and shared

    def fill_batch(self, indices: np.ndarray, out: Allocator) -> tuple[np.ndarray, np.ndarray]:
        self.built[0] += 1
        if self.built[0] % self.die_every == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().fill_batch(indices, out)


def check_any_batch(workload: Workload, batch: Sequence) -> None:
    """``check_batch`` for a loader that keeps no order: which batch it is, its labels say."""
    first = int(np.asarray(batch[1])[0])
    check_batch(workload, first // workload.batch_size, batch)


def check_batch(workload: Workload, k: int, batch: Iterable) -> None:
    """Raise ``BatchMismatch`` unless ``batch`` is the ``k``-th of the stream, untorn.

    Reads the labels and two bytes per image: cheap next to any transport.
    """
    images, labels = (np.asarray(part) for part in batch)
    expected = workload.indices(k)
    if images.shape != (workload.batch_size, *workload.image_shape) or images.dtype != np.uint8:
        raise BatchMismatch(f"batch {k}: images {images.dtype}{images.shape}")
    if not np.array_equal(labels, expected):
        raise BatchMismatch(f"batch {k}: labels {labels[:4]}... expected {expected[:4]}...")
    rows = expected % POOL_ROWS
    if not (np.array_equal(images[:, 0, 0, 0], _head(rows))
            and np.array_equal(images[:, -1, -1, -1], _tail(rows))):
        raise BatchMismatch(f"batch {k}: image markers do not match labels (torn or stale batch)")
