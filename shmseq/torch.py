"""``torch.utils.data.DataLoader``'s signature and meanings on shmseq's ring.

Switch by changing one import::

    from shmseq.torch import DataLoader      # was: from torch.utils.data import DataLoader

Workers fetch ``dataset[i]`` for each index of a batch and collate the samples as
``torch.utils.data.default_collate`` does, except that every tensor, array and number
column is stacked straight into the batch's slot: the training loop gets tensors that are
views of the slot, not tensors unpickled from per-batch shared memory. What differs from
torch's loader, and why: docs/from-pytorch.md.
"""
from __future__ import annotations

import multiprocessing
import weakref

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler, SequentialSampler
from torch.utils.data._utils.collate import collate, default_collate_fn_map, default_convert

from .dataloader import SampleLoader, SampleWorker, stack_into
from .errors import warn_user
from .layout import SlotAllocator, as_ndarray
from .plan import distributed_ranks

_PIN_DEVICES = ("", "cuda")


def slot_collate(samples: list, out: SlotAllocator | None = None):
    """``default_collate(samples)``, each stackable column written straight into ``out``:
    tensors and arrays are stacked, numbers become a 1-D column (ints int64, floats float64),
    strings stay lists; mappings, namedtuples and sequences are collated field by field."""
    return collate(samples, collate_fn_map=_slot_collate_map(out or SlotAllocator(None)))


def _slot_collate_map(out: SlotAllocator) -> dict:
    def tensors(batch, *, collate_fn_map):
        arrays = [as_ndarray(tensor) for tensor in batch]
        if arrays[0] is None:  # a dtype numpy lacks (bfloat16): stacked by torch, then copied
            return default_collate_fn_map[torch.Tensor](batch, collate_fn_map=collate_fn_map)
        return stack_into(arrays, out)

    def arrays(batch, *, collate_fn_map):
        if batch[0].dtype.kind in "SaUO":  # torch refuses these: say so as it does
            return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
        return stack_into(batch, out)

    def column(dtype=None):
        def stack(batch, *, collate_fn_map):
            values = np.asarray(batch, dtype)
            if values.dtype.kind == "O":
                return torch.as_tensor(batch)  # raises as torch's collation does
            placed = out.empty(values.shape, values.dtype)
            placed[...] = values
            return placed
        return stack

    return {**default_collate_fn_map, torch.Tensor: tensors, np.ndarray: arrays,
            (np.bool_, np.number, np.object_): column(), float: column(np.float64),
            int: column()}


class TorchSampleWorker(SampleWorker):
    """Collates with ``collate_fn`` (default: ``slot_collate``). Without automatic batching
    (``batch_size=None``) each batch is one sample, converted as torch's loader does."""

    def __init__(self, dataset, collate_fn, auto_collation: bool):
        super().__init__(dataset, collate_fn)
        self.auto_collation = auto_collation

    def _batch(self, indices: np.ndarray, out: SlotAllocator):
        if not self.auto_collation:
            return (self.batchify_fn or default_convert)(self.dataset[int(indices[0])])
        samples = [self.dataset[int(index)] for index in indices]
        if self.batchify_fn is not None:
            return self.batchify_fn(samples)
        return slot_collate(samples, out)


class DataLoader(SampleLoader):
    """``torch.utils.data.DataLoader`` with the same arguments and attributes.

    Batches are torch CPU tensors sharing memory with their slot, delivered in order.
    The default order (``shuffle`` without a ``sampler``) is shmseq's seeded plan: drawn
    from ``generator`` (or torch's global generator) once, resumable through
    ``state_dict()``, and dealt to the ranks of ``torch.distributed`` as they are when each
    epoch starts (as a ``DistributedSampler`` would; a ``sampler`` or ``batch_sampler`` of
    your own is used as is). Beyond torch's arguments: ``seed``, ``rank``/``world_size``,
    ``slot_bytes``, ``worker_restarts``, ``out_type``. The full list: docs/from-pytorch.md.
    """

    _ways_around_pickling = "or use multiprocessing_context='fork'"

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler=None, batch_sampler=None, num_workers: int = 0, collate_fn=None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 slot_bytes: int | None = None, worker_restarts: int = 0, out_type: str = "cpu"):
        _check_dataset(dataset, sampler, batch_sampler)
        _check_workers(num_workers, prefetch_factor, persistent_workers, multiprocessing_context)
        _check_batching(batch_size, shuffle, sampler, batch_sampler, drop_last)
        if isinstance(timeout, (int, float)) and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds (0: wait as long as it takes), "
                             f"got {timeout!r}")
        if (sampler is not None or batch_sampler is not None) and (
                rank is not None or world_size is not None):
            raise ValueError("rank and world_size deal shmseq's own plan to the ranks: with your "
                             "own sampler or batch_sampler, deal the indices in it "
                             "(a DistributedSampler, say)")
        self.dataset = dataset
        self.generator = generator
        self.collate_fn = collate_fn
        self.drop_last = bool(drop_last)
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = bool(persistent_workers)
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory_device = pin_memory_device
        self.in_order = bool(in_order)  # batches always come in order, which in_order=False allows
        self._batch_size = batch_size
        self._given = (sampler, batch_sampler)
        self._warned_ranks = False
        if batch_sampler is None and sampler is not None:  # batch_size=None: batches of one
            batch_sampler = BatchSampler(sampler, batch_size or 1, self.drop_last)
        self.batch_sampler = batch_sampler
        buffer = num_workers * (2 if prefetch_factor is None else prefetch_factor) + 2
        super().__init__(
            TorchSampleWorker(dataset, collate_fn, auto_collation=batch_size is not None),
            len(dataset) if hasattr(dataset, "__len__") else 0,
            batch_size=batch_size or 1, slot_bytes=slot_bytes, buffer=buffer,
            num_workers=num_workers, shuffle=bool(shuffle), seed=seed,
            last_batch="discard" if self.drop_last else "keep", out_type=out_type,
            start_method=_start_method(multiprocessing_context), timeout=timeout or None,
            pin_memory=pin_memory, pin_device_id=_pin_device_id(pin_memory_device),
            rank=rank, world_size=world_size, worker_init_fn=worker_init_fn,
            worker_restarts=worker_restarts)
        if self.batch_sampler is None:  # shmseq's plan: shown as torch's samplers would show it
            self.sampler = _PlanSampler(self)
            if batch_size is not None:
                self.batch_sampler = _PlanBatches(self, self.sampler)
        else:
            self.sampler = sampler if sampler is not None else SequentialSampler(dataset)

    def _default_seed(self) -> int:
        """Drawn from ``generator``, or torch's global one: ``torch.manual_seed`` repeats it."""
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def timeout(self) -> float:
        """As torch has it: 0 waits as long as it takes."""
        return 0 if self._timeout is None else self._timeout

    def __len__(self) -> int:
        """Batches in a whole epoch, as torch's ``len(batch_sampler)``, also when resumed
        mid-epoch: trainers count the batches taken before themselves (Lightning sizes every
        epoch by this, once, after restoring the loader's state)."""
        epoch, _ = self._epoch_in_view()
        return self._plan.length(epoch)

    def __iter__(self):
        self._warn_if_each_rank_reads_everything()
        batches = super().__iter__()
        if self.persistent_workers or not self.num_workers:
            return batches
        return self._then_stop(batches)

    def _then_stop(self, batches):
        """``persistent_workers=False``: the workers go once the epoch is done, as torch's do."""
        yield from batches
        self.finish()

    def _warn_if_each_rank_reads_everything(self) -> None:
        sampler, batch_sampler = self._given
        if sampler is None and batch_sampler is None:
            return
        _, world_size = distributed_ranks()
        dealt = any(hasattr(s, "num_replicas") for s in
                    (sampler, batch_sampler, getattr(batch_sampler, "sampler", None)))
        if world_size > 1 and not dealt and not self._warned_ranks:
            self._warned_ranks = True
            warn_user(f"torch.distributed runs {world_size} ranks but the sampler given to "
                      "this DataLoader does not deal samples to them: every rank reads the "
                      "whole dataset. Use a DistributedSampler, or leave sampler out and let "
                      "shmseq deal the samples (shuffle=True or False)")


class _PlanSampler(Sampler):
    """``loader.sampler`` for shmseq's own plan: this rank's sample order of the epoch the
    loader is at. ``set_epoch`` sets the loader's epoch (trainers call it before each one)."""

    def __init__(self, loader: DataLoader):
        self._loader = weakref.ref(loader)  # no cycle: the loader must go when dropped

    def _loader_alive(self) -> DataLoader:
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the DataLoader of this sampler is gone")
        return loader

    def _plan_and_epoch(self):
        loader = self._loader_alive()
        return loader._plan, loader._epoch_in_view()[0]

    def __iter__(self):
        plan, epoch = self._plan_and_epoch()
        return iter(plan.order(epoch).tolist())

    def __len__(self) -> int:
        plan, _ = self._plan_and_epoch()
        return plan.samples_per_epoch

    def set_epoch(self, epoch: int) -> None:
        self._loader_alive().set_epoch(epoch)


class _PlanBatches(Sampler):
    """``loader.batch_sampler`` for shmseq's own plan: the batches of the epoch the loader is
    at, as lists of indices (what ``accelerate.skip_first_batches`` reads)."""

    def __init__(self, loader: DataLoader, sampler: _PlanSampler):
        self.sampler = sampler
        self.batch_size = loader.batch_size
        self.drop_last = loader.drop_last

    def __iter__(self):
        plan, epoch = self.sampler._plan_and_epoch()
        return (batch.tolist() for batch in plan.batches(epoch))

    def __len__(self) -> int:
        plan, epoch = self.sampler._plan_and_epoch()
        return plan.length(epoch)


def _check_dataset(dataset, sampler, batch_sampler) -> None:
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"dataset is an IterableDataset ({type(dataset).__name__}): shmseq's "
                        "workers build each batch from sample indices, so they need a map-style "
                        "dataset (__getitem__ and __len__); keep torch's DataLoader for this one")
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(f"dataset must have __getitem__, got {type(dataset).__name__}")
    if sampler is None and batch_sampler is None and not hasattr(dataset, "__len__"):
        raise TypeError(f"dataset {type(dataset).__name__} has no __len__: give it one, or pass "
                        "a sampler that yields its indices")


def _check_workers(num_workers, prefetch_factor, persistent_workers, context) -> None:
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if num_workers == 0:
        for name, value, default in (("prefetch_factor", prefetch_factor, None),
                                     ("persistent_workers", persistent_workers, False),
                                     ("multiprocessing_context", context, None)):
            if value != default:
                raise ValueError(f"{name}={value!r} needs worker processes: set num_workers > 0 "
                                 f"(num_workers=0 loads in the main process), or leave {name} out")
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be an integer >= 1, got {prefetch_factor!r}")


def _check_batching(batch_size, shuffle, sampler, batch_sampler, drop_last) -> None:
    if sampler is not None and shuffle:
        raise ValueError("shuffle must not be set with sampler: the sampler decides the order "
                         "(use a RandomSampler to shuffle)")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
        raise ValueError("batch_sampler decides the batches itself: leave batch_size, shuffle, "
                         "sampler and drop_last out")
    if batch_size is None and drop_last:
        raise ValueError("batch_size=None turns automatic batching off, so there is no last "
                         "batch to drop: leave drop_last out")


def _start_method(context) -> str | None:
    """``multiprocessing_context`` as a start method: a name, or a context object."""
    if context is None or isinstance(context, str):
        if context is not None and context not in multiprocessing.get_all_start_methods():
            raise ValueError(f"multiprocessing_context must be one of "
                             f"{multiprocessing.get_all_start_methods()} or a context, "
                             f"got {context!r}")
        return context
    get = getattr(context, "get_start_method", None)
    if get is None:
        raise TypeError(f"multiprocessing_context must be a start method's name or a "
                        f"multiprocessing context, got {type(context).__name__}")
    return get()


def _pin_device_id(device: str) -> int:
    """The CUDA device to page-lock for: ``''``/``'cuda'`` the current one, ``'cuda:N'``."""
    if device in _PIN_DEVICES:
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise ValueError(f"pin_memory_device must be '', 'cuda' or 'cuda:N', got {device!r}: shmseq "
                     "page-locks its ring for CUDA devices only")


__all__ = ["DataLoader", "slot_collate"]
