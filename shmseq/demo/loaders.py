"""The loaders the demo compares, each started fresh and stopped, as context managers that give
an endless iterator of ``(images, labels)`` batches: uint8 N x H x W x 3 and int64 N.

Every loader draws the same samples with the same per-sample work (``worker.load_into``: a
random crop and flip from the array store, or a JPEG decode), with as many worker processes:

* ``shmseq``: ``ShmSequence`` with the in-place worker, each sample written straight into
  its row of a shared-memory slot, batches handed over as views;
* ``torch DataLoader``: as its documentation recommends, a sample-level dataset, the
  default collate, persistent workers, ``pin_memory`` on a CUDA machine;
* ``torch DataLoader, batch-level``: one ``__getitem__`` per batch (``batch_size=None``
  over a ``BatchSampler``), which spares the per-sample pickling of the first.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Generator, Iterable, Iterator

import numpy as np
import torch

from .. import ShmSequence, SlotAllocator
from ..vision import ImageArrayWorker, ImageFolderWorker

Loader = Callable[..., ContextManager[Iterator[tuple]]]
Worker = ImageArrayWorker | ImageFolderWorker  # the in-place worker every loader draws from


def endless(loader: Iterable) -> Generator[Any, None, None]:
    """Epoch after epoch, for as long as the caller takes batches."""
    while True:
        yield from loader


def shmseq_sequence(worker: Worker, batch_size: int, workers: int, seed: int,
                    device: torch.device) -> ShmSequence:
    return ShmSequence(worker, len(worker), batch_size=batch_size, num_workers=workers,
                       seed=seed, out_type="cuda" if device.type == "cuda" else "cpu")


@contextlib.contextmanager
def shmseq_loader(worker: Worker, batch_size: int, workers: int, seed: int,
                  device: torch.device) -> Iterator[Iterator[tuple]]:
    with shmseq_sequence(worker, batch_size, workers, seed, device).start() as seq:
        yield endless(seq)


class SampleDataset(torch.utils.data.Dataset):
    """The worker's per-sample work, one sample at a time, for torch's DataLoader.

    Each DataLoader worker process draws from its own generator, seeded by the worker's
    seed and the DataLoader worker id."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.worker)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.rng is None:
            info = torch.utils.data.get_worker_info()
            self.rng = np.random.default_rng([self.worker.seed, info.id if info else 0])
        row = np.empty((self.worker.size, self.worker.size, 3), np.uint8)
        self.worker.load_into(index, row, self.rng)
        return torch.from_numpy(row), int(self.worker.labels[index])


class BatchDataset(torch.utils.data.Dataset):
    """The worker's whole batch in one ``__getitem__``, into fresh arrays (DataLoader's
    batch-level use, ``batch_size=None``)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def __len__(self) -> int:
        return len(self.worker)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.worker.fill_batch(np.asarray(indices, np.int64), SlotAllocator(None))
        return torch.from_numpy(images), torch.from_numpy(labels)


@contextlib.contextmanager
def _dataloader(dataset: torch.utils.data.Dataset, workers: int, device: torch.device,
                **options: Any) -> Iterator[Iterator]:
    loader = torch.utils.data.DataLoader(dataset, num_workers=workers,
                                         persistent_workers=workers > 0,
                                         pin_memory=device.type == "cuda", **options)
    batches = endless(loader)
    try:
        yield batches
    finally:
        batches.close()
        del loader, batches  # the last references: its persistent workers exit now


def torch_samples(worker: Worker, batch_size: int, workers: int, seed: int,
                  device: torch.device) -> ContextManager[Iterator[tuple]]:
    return _dataloader(SampleDataset(worker), workers, device, batch_size=batch_size,
                       shuffle=True, generator=torch.Generator().manual_seed(seed))


def torch_batches(worker: Worker, batch_size: int, workers: int, seed: int,
                  device: torch.device) -> ContextManager[Iterator[tuple]]:
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(range(len(worker)),
                                       generator=torch.Generator().manual_seed(seed)),
        batch_size, drop_last=False)
    return _dataloader(BatchDataset(worker), workers, device, batch_size=None, sampler=sampler)


LOADERS: dict[str, Loader] = {"shmseq": shmseq_loader, "torch DataLoader": torch_samples,
                              "torch DataLoader, batch-level": torch_batches}
