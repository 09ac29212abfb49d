"""Sample-level loaders on shmseq's engine, and the MXNet Gluon-style ``DataLoader``.

Workers fetch ``dataset[i]`` for each index of a batch and stack the samples
straight into the slot (``default_batchify`` allocates each field in the slot),
so there is no intermediate batch array and no pickling of the batch.
``SampleLoader`` is what this loader and the torch-style one (``shmseq.torch``) share.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, cast

import numpy as np

from .checks import check_bool, check_int, check_num_workers
from .engine import SamplerPlan, SlotAllocator, as_ndarray, default_max_workers, is_tensor, stack_into
from .sampler_state import SamplerPasses
from .samplers import BatchSampler, RandomSampler, SequentialSampler
from .sequence import Batching, ShmSequence, Stage

if TYPE_CHECKING:

    from .engine import Plan


def default_batchify(samples: list, out: SlotAllocator | None = None) -> object:
    """Stack samples into a batch, field by field, writing each field straight into ``out``.

    Arrays (and torch tensors) of one shape are stacked; numbers become a 1-D array;
    tuples and dicts are batched field by field; anything else (strings) is kept as a list.
    """
    out = out or SlotAllocator(None)
    first = samples[0]
    if isinstance(first, tuple):
        return tuple(default_batchify(list(field), out) for field in zip(*samples))
    if isinstance(first, dict):
        return {key: default_batchify([s[key] for s in samples], out) for key in first}
    if is_tensor(first) and as_ndarray(first) is None:  # a dtype numpy lacks (bfloat16)
        return sys.modules["torch"].stack(samples)
    arrays = [as_ndarray(s) for s in samples]
    if arrays[0] is None and isinstance(first, (bool, int, float, complex, np.generic)):
        arrays = [np.asarray(s) for s in samples]
    if arrays[0] is None:
        return list(samples)
    return stack_into(cast("list[np.ndarray]", arrays), out)  # as the first: else stacking fails


def check_dataset(dataset: object) -> None:
    """A dataset whose samples are read by index. A stream of samples is refused here, not at
    its first batch: a torch ``IterableDataset`` has ``__getitem__`` (torch's, which raises),
    and may have a ``__len__``."""
    data = sys.modules.get("torch.utils.data")  # loaded wherever a torch dataset exists
    stream = data is not None and isinstance(dataset, data.IterableDataset)
    if not stream and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return
    stream = stream or hasattr(dataset, "__iter__")
    raise TypeError(
        f"dataset must have __getitem__ and __len__ (samples read by index), got "
        f"{type(dataset).__name__}" + (
            ", a stream of samples (an IterableDataset): shmseq.torch.DataLoader reads one as "
            "torch's DataLoader does, each worker iterating its copy, on shmseq's ring, with "
            "state_dict() checkpoints" if stream else ""))


class SampleWorker:
    """Runs in each worker: fetches the samples of a batch and batchifies them into the slot."""

    def __init__(self, dataset: Any, batchify_fn: Callable[[list], object] | None = None,
                 collate_name: str = "batchify_fn") -> None:
        self.dataset = dataset
        self.batchify_fn = batchify_fn
        self.collate_name = collate_name

    def pickled_parts(self) -> dict:
        """What the user gave, by argument name: named when the worker cannot be pickled."""
        return {"dataset": self.dataset, self.collate_name: self.batchify_fn}

    def fill_batch(self, indices: np.ndarray | list[np.ndarray], out: SlotAllocator) -> object:
        if isinstance(indices, list):  # a multi-shard batch: one batch per shard
            return [self._batch(part, out) for part in indices]
        return self._batch(indices, out)

    def _batch(self, indices: np.ndarray, out: SlotAllocator) -> object:
        samples = [self.dataset[int(index)] for index in indices]
        if self.batchify_fn is not None:
            return self.batchify_fn(samples)
        return default_batchify(samples, out)


class SamplerStage(Stage):
    """A loader's batches drawn from its batch sampler, when it has one; its state then says
    what the sampler's pass is drawn from (``shmseq.sampler_state``), so that a resume draws
    the pass the saved run drew, or the one it would have drawn next."""

    def __init__(self, batch_sampler: Iterable | None) -> None:
        self.passes = None if batch_sampler is None else SamplerPasses(batch_sampler)

    def plan(self, batching: Batching) -> Plan:
        if self.passes is None:
            return super().plan(batching)
        return SamplerPlan(self.passes.batch_sampler, passes=self.passes.draw)

    def saved(self, sequence: ShmSequence, state: dict) -> dict:
        """With the sampler's: a state other than the next iteration's start is inside (or at
        the end of) the pass drawn last, which a resume draws again."""
        if self.passes is None:
            return state
        drawn = (state["epoch"], state["position"]) != sequence.resume_point
        return {**state, "sampler": self.passes.state(state["epoch"], drawn)}

    def loading(self, sequence: ShmSequence, state: dict) -> dict:
        """The sampler's, for the next pass (a state saved without one has nothing to set)."""
        if self.passes is not None and state.get("sampler") is not None:
            self.passes.load(state["sampler"])
        return state


class SampleLoader(ShmSequence):
    """A sequence over a dataset of samples: started by the first iteration, closed by
    ``close()``; its batches come from a batch sampler when one is given
    (``self.batch_sampler``), else from shmseq's own seeded plan."""

    batch_sampler: Iterable | None = None
    _collate_name = "collate_fn"  # the argument naming the collate function
    dataset: Any  # anything with __getitem__ and __len__

    @property
    def dset_size(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        if self._runtime is None:
            self.start()
        return super().__iter__()

    def close(self) -> None:
        """Stop the workers (they otherwise stay up between epochs)."""
        self.finish()


class DataLoader(SampleLoader):
    """Gluon's ``DataLoader(dataset, batch_size, shuffle, sampler, last_batch, batch_sampler,
    batchify_fn, num_workers, pin_memory, pin_device_id, prefetch, thread_pool, timeout)``.

    ``dataset`` is anything with ``__getitem__`` and ``__len__`` (numpy arrays included).
    Iterate it directly: workers start at the first iteration and stay up across epochs
    until ``close()``. ``num_workers=0`` runs in the calling thread. Batches are numpy
    arrays (``out_type='null'``) or torch tensors (``'cpu'``, ``'cuda'``). A ``batch_sampler``
    that yields lists of index lists gives lists of batches, one per shard (GluonNLP's
    ``ShardedDataLoader``). Beyond Gluon: ``seed``, ``rank``/``world_size`` (distributed
    sharding of the default samplers), ``state_dict()``, ``set_epoch()``, ``worker_init_fn``,
    ``worker_restarts``; ``num_workers='auto'`` with ``max_workers``, ``cpu_budget`` and
    ``memory_budget`` (``ShmSequence``'s). Without ``prefetch``, the ring's slots are counted
    from the batch size, the workers and the batches the consumer holds (``ShmSequence``'s
    ``buffer=None``); with it, the ring has ``max(prefetch, workers) + 2`` slots.
    """

    _collate_name = "batchify_fn"

    def __init__(self, dataset: Any, batch_size: int | None = None, shuffle: bool = False,
                 sampler: Iterable[int] | None = None, last_batch: str | None = None,
                 batch_sampler: Iterable | None = None,
                 batchify_fn: Callable[[list], object] | None = None,
                 num_workers: int | Literal["auto"] = 0, pin_memory: bool = False,
                 pin_device_id: int = 0,
                 prefetch: int | None = None, thread_pool: bool = False,
                 timeout: float | None = 120,
                 *, out_type: str = "null", seed: int | None = None, rank: int | None = None,
                 world_size: int | None = None,
                 worker_init_fn: Callable[[int], object] | None = None,
                 slot_bytes: int | None = None, start_method: str | None = None,
                 worker_restarts: int = 0, max_workers: int | None = None,
                 cpu_budget: float | None = None, memory_budget: int | None = None) -> None:
        check_dataset(dataset)
        self._check(batch_size, shuffle, num_workers, prefetch, thread_pool)
        self.dataset = dataset
        self.batch_sampler = self._batch_sampler(batch_size, shuffle, sampler, last_batch,
                                                 batch_sampler)
        if self.batch_sampler is not None and (rank is not None or world_size is not None):
            raise ValueError("rank and world_size shard the default samplers: with your own sampler "
                             "or batch_sampler, deal the indices to the ranks in it")
        most = num_workers if num_workers != "auto" else max_workers or default_max_workers()
        super().__init__(SampleWorker(dataset, batchify_fn, self._collate_name), len(dataset),
                         batch_size=batch_size or 1,  # None: the batch_sampler's batches
                         slot_bytes=slot_bytes,
                         buffer=None if prefetch is None else max(prefetch, most, 1) + 2,
                         num_workers=num_workers, max_workers=max_workers,
                         cpu_budget=cpu_budget, memory_budget=memory_budget,
                         shuffle=shuffle, seed=seed, last_batch=last_batch or "keep",
                         thread_type="thread" if thread_pool else "proc", out_type=out_type,
                         start_method=start_method, timeout=timeout, pin_memory=pin_memory,
                         pin_device_id=pin_device_id, rank=rank, world_size=world_size,
                         worker_init_fn=worker_init_fn, worker_restarts=worker_restarts,
                         stage=SamplerStage(self.batch_sampler))

    @staticmethod
    def _check(batch_size: object, shuffle: object, num_workers: object, prefetch: object,
               thread_pool: object) -> None:
        """The arguments used here before ``ShmSequence`` checks the rest: a 0 or a string
        would otherwise turn into some other loader (``batch_size or 1``, ``2 * '2'``)."""
        check_int("batch_size", batch_size, 1, optional=True)
        check_bool("shuffle", shuffle)
        check_num_workers(num_workers)
        check_int("prefetch", prefetch, 0, optional=True)
        check_bool("thread_pool", thread_pool)

    @staticmethod
    def _batch_sampler(batch_size: int | None, shuffle: bool, sampler: Iterable[int] | None,
                       last_batch: str | None, batch_sampler: Iterable | None) -> Iterable | None:
        """Gluon's argument rules; None when the default, seeded plan does the job."""
        if batch_sampler is not None:
            if batch_size is not None or shuffle or sampler is not None or last_batch is not None:
                raise ValueError("batch_size, shuffle, sampler and last_batch must not be given "
                                 "with batch_sampler: it decides the batches itself")
            return batch_sampler
        if batch_size is None:
            raise ValueError("batch_size must be given unless batch_sampler is")
        if sampler is not None:
            if shuffle:
                raise ValueError("shuffle must not be given with sampler: the sampler decides the "
                                 "order (use RandomSampler to shuffle)")
            return BatchSampler(sampler, batch_size, last_batch or "keep")
        return None


__all__ = ["DataLoader", "default_batchify", "SequentialSampler", "RandomSampler", "BatchSampler"]
