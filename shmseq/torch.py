"""``torch.utils.data.DataLoader``, behaviour for behaviour, with shmseq's ring behind it.

Switch by changing one import::

    from shmseq.torch import DataLoader      # was: from torch.utils.data import DataLoader

``DataLoader`` is a subclass of torch's: its constructor, samplers, ``generator``, attribute
guards, ``len()`` and error messages are torch's own, and frameworks treat it as torch's
(Lightning re-instantiates it with its ``DistributedSampler``). Only the iterator differs,
for datasets loaded by worker processes: each batch is fetched as torch's worker fetches it
(``__getitems__``, ``collate_fn``, an ``IterableDataset``'s stream in each worker), collated
straight into a slot of the ring
(``default_collate`` stacks every tensor, array and number column there), and delivered as
tensors that are views of the slot. Torch's sequence of events is kept: the workers' seeds
(``base_seed + worker_id``, drawn from ``generator`` when an iterator is made), batch ``k``
of a pass built by worker ``k % num_workers``, one intra-op thread in each worker, a new
pass for every ``iter()``, a worker's exception raised as its own type with the pass going
on after it. What differs on purpose, and why: docs/from-pytorch.md.
"""
from __future__ import annotations

import signal
from collections.abc import Hashable
from multiprocessing.context import BaseContext
from typing import (TYPE_CHECKING, Any, Callable, Collection, Iterable, Literal, Sequence, TypeVar,
                    cast)

import numpy as np

try:
    import torch
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise  # torch is there, but something it imports is not
    raise ModuleNotFoundError(
        "shmseq.torch is torch's DataLoader on shmseq's ring, and needs torch: pip install torch "
        "(or your CUDA build of it). Without torch, shmseq.ShmSequence and shmseq.DataLoader "
        "deliver numpy arrays (out_type='null').", name="torch") from missing
from torch.utils.data import DataLoader as TorchDataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map

from .checks import check_auto_bounds, check_int
from .engine import (START_WORKERS, BatchTimeout, Cursor, FrontEndHooks, LoaderStats, Pipeline,
                     PipelineClosed, Ragged, SamplerPlan, ShmSeqError, SlotAllocator, StreamEnded,
                     WorkerDied, as_ndarray, closing_finalizer, default_max_workers, make_leaf,
                     stack_into)
from .options import LoaderOptions

if TYPE_CHECKING:
    from numpy.typing import DTypeLike
    from torch.utils.data._utils.fetch import _BaseDatasetFetcher

    from .engine import Delivery



def slot_collate(samples: list, out: SlotAllocator | None = None) -> Any:
    """``default_collate(samples)``, each stackable column written straight into ``out``:
    tensors and arrays are stacked, numbers become a 1-D column (ints int64, floats float64),
    strings stay lists; mappings, namedtuples and sequences are collated field by field."""
    return collate(samples, collate_fn_map=_slot_collate_map(out or SlotAllocator(None)))


def _slot_collate_map(out: SlotAllocator) -> dict:
    def tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: dict) -> object:
        arrays = [as_ndarray(tensor) for tensor in batch]
        if arrays[0] is None:  # bfloat16, sparse, nested: collated by torch (or refused alike)
            return default_collate_fn_map[torch.Tensor](batch, collate_fn_map=collate_fn_map)
        return stack_into(cast("list[np.ndarray]", arrays), out)  # as the first: else it fails

    def arrays(batch: list[np.ndarray], *, collate_fn_map: dict) -> object:
        if batch[0].dtype.kind in "SaUO":  # torch refuses these: say so as it does
            return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
        return stack_into(batch, out)

    def column(dtype: DTypeLike | None = None) -> Callable[..., object]:
        def stack(batch: list, *, collate_fn_map: dict) -> object:
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


class _Index:
    """A sampler's item sent to a worker as it is (pickled): a key, a list for bulk loading."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _as_task(index: object) -> np.ndarray | _Index:
    """What a worker is sent for one item of the index sampler: a list of ints (what torch's
    samplers give) as int64 indices, the wire's fixed binary frame; anything else as is."""
    if type(index) is list and set(map(type, index)) == {int}:
        return np.array(index, dtype=np.int64)
    return _Index(index)


class _Fetcher:
    """Runs in each worker: fetches an item of the index sampler with torch's own fetcher (so
    ``__getitems__``, bulk loading, ``collate_fn`` and the end of an ``IterableDataset``'s
    stream behave as under torch's loader) and collates it straight into the slot when
    ``collate_fn`` is torch's ``default_collate``.

    For an ``IterableDataset`` a task is ``(pass, item)``: the worker iterates its copy of the
    dataset anew at each pass, as torch's workers do, and says when its stream has ended."""

    def __init__(self, dataset: Dataset, kind: int, auto_collation: bool,
                 collate_fn: Callable[[list], Any], drop_last: bool) -> None:
        self.dataset = dataset  # what get_worker_info().dataset is
        self.kind = kind
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._fetcher: _BaseDatasetFetcher | None = None
        self._pass: object = None  # the pass the fetcher iterates (an IterableDataset's)
        self._slot: SlotAllocator | None = None  # where the batch in hand is collated

    def fill_batch(self, task: np.ndarray | _Index, out: SlotAllocator) -> Any:
        item: Any = task.tolist() if isinstance(task, np.ndarray) else task.value
        if self.kind == _DatasetKind.Iterable:
            this_pass, item = item
            if this_pass != self._pass:
                self._fetcher, self._pass = None, this_pass
        if self._fetcher is None:  # in the worker, after its seeding and worker_init_fn
            collate_fn = self._into_slot if self.collate_fn is default_collate else self.collate_fn
            self._fetcher = _DatasetKind.create_fetcher(
                self.kind, self.dataset, self.auto_collation, collate_fn, self.drop_last)
        self._slot = out
        try:
            return self._fetcher.fetch(item)
        except StopIteration:
            if self.kind != _DatasetKind.Iterable:
                raise  # from a map-style dataset: an error, as under torch's loader
            raise StreamEnded from None
        finally:
            self._slot = None

    def _into_slot(self, samples: list) -> Any:
        return slot_collate(samples, self._slot)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fetcher": None, "_slot": None}

    def pickled_parts(self) -> dict:
        """What the user gave, by argument name: named when spawned workers cannot get it."""
        return {"dataset": self.dataset, "collate_fn": self.collate_fn}

    @staticmethod
    def unpicklable(what: str, value: object, exc: Exception, start_method: str) -> Exception:
        """The error when ``value`` (the argument ``what``) cannot be pickled: of the pickling
        error's type, as torch's loader raises it, saying what this front end takes."""
        message = (f"{what} {value!r} cannot be pickled, which multiprocessing_context="
                   f"{start_method!r} needs ({type(exc).__name__}: {exc}): define it at module "
                   "level, or pass multiprocessing_context='fork'")
        try:
            return type(exc)(message)
        except Exception:  # noqa: BLE001 - a type that takes other arguments: torch raises it as is
            return exc


T_co = TypeVar("T_co", covariant=True)


class DataLoader(TorchDataLoader[T_co]):
    """``torch.utils.data.DataLoader`` (its arguments, samplers, seeds and errors) with the
    batches that workers load delivered through shmseq's ring.

    Beyond torch's arguments, keyword-only: ``slot_bytes`` (the ring's slot size; by default,
    sized from the first batches) and ``worker_restarts`` (how many dead workers to replace).
    Beyond torch's values: ``num_workers='auto'`` (map-style datasets), the worker count
    tuned as the loader runs, bounded by the keyword-only ``max_workers``, ``cpu_budget`` and
    ``memory_budget`` (``shmseq.ShmSequence``'s); torch sees it start at ``num_workers=2`` (its
    attribute), each worker's ``get_worker_info().num_workers`` is ``max_workers``, and
    without ``prefetch_factor`` the ring's slots are counted by shmseq (with it, the ring has
    ``prefetch_factor * max_workers + 2``).
    Beyond its attributes: ``stats`` (what went through the ring) and ``close()`` (stop
    persistent workers now, rather than when the loader is dropped).
    """

    def __init__(self, dataset: Dataset[T_co], batch_size: int | None = 1,
                 shuffle: bool | None = None, sampler: Sampler | Iterable | None = None,
                 batch_sampler: Sampler[list] | Iterable[list] | None = None,
                 num_workers: int | Literal["auto"] = 0,
                 collate_fn: Callable[[list], Any] | None = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: str | BaseContext | None = None,
                 generator: torch.Generator | None = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 slot_bytes: int | None = None, worker_restarts: int = 0,
                 max_workers: int | None = None, cpu_budget: float | None = None,
                 memory_budget: int | None = None) -> None:
        self.max_workers = self._auto_workers(dataset, num_workers, max_workers, cpu_budget,
                                              memory_budget, prefetch_factor)
        self.cpu_budget, self.memory_budget = cpu_budget, memory_budget
        self._ring_slots = None if self.max_workers is None or prefetch_factor is None else (
            prefetch_factor * self.max_workers + 2)
        workers = (cast(int, num_workers) if self.max_workers is None  # torch checks it
                   else min(START_WORKERS, self.max_workers))  # torch sees an integer
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        check_int("slot_bytes", slot_bytes, 1, optional=True)
        check_int("worker_restarts", worker_restarts, 0)
        self.slot_bytes = slot_bytes
        self.worker_restarts = worker_restarts
        self._stats = LoaderStats()

    @staticmethod
    def _auto_workers(dataset: object, num_workers: object, max_workers: int | None,
                      cpu_budget: float | None, memory_budget: int | None,
                      prefetch_factor: int | None) -> int | None:
        """The bound of a tuned worker count (``num_workers='auto'``); None for torch's integer,
        left to torch to check. ``memory_budget`` bounds a ring whose slots shmseq counts: with
        ``'auto'`` and no ``prefetch_factor`` only."""
        auto = num_workers == "auto" and isinstance(num_workers, str)
        check_auto_bounds("auto" if auto else num_workers, max_workers, cpu_budget,
                          memory_budget, None)
        if memory_budget is not None and not (auto and prefetch_factor is None):
            raise ValueError(f"memory_budget={memory_budget!r} bounds a ring whose slots shmseq "
                             f"counts, which it does with num_workers='auto' and no "
                             f"prefetch_factor (got num_workers={num_workers!r}, "
                             f"prefetch_factor={prefetch_factor!r}): leave memory_budget out")
        if not auto:
            return None
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"num_workers='auto' needs a map-style dataset: the stream of "
                f"{type(dataset).__name__} (an IterableDataset) is split among the workers, so "
                "its batches would change with their number as the loader tunes it; pass an "
                "integer num_workers")
        return max_workers or default_max_workers()

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            return super()._get_iterator()  # nothing to carry: torch's own
        if self._dataset_kind == _DatasetKind.Iterable and self.worker_restarts:
            raise ValueError(
                f"worker_restarts={self.worker_restarts} needs a map-style dataset: a "
                f"replacement worker cannot resume the stream of {type(self.dataset).__name__} "
                "(an IterableDataset) where the dead one stopped; pass worker_restarts=0")
        return _RingIterator(self)  # more workers than cores: torch's constructor warned

    def tuned_arguments(self) -> dict[str, object]:
        """The arguments that make a loader tune its workers as this one does (``on_ring``'s
        rebuild: torch's attributes say ``num_workers=2`` and ``prefetch_factor=2``); empty
        for an integer ``num_workers``."""
        if self.max_workers is None:
            return {}
        return {"num_workers": "auto", "max_workers": self.max_workers,
                "cpu_budget": self.cpu_budget, "memory_budget": self.memory_budget,
                "prefetch_factor": None if self._ring_slots is None else self.prefetch_factor}

    @property
    def stats(self) -> LoaderStats:
        """Counters of the batches that came through the ring (all iterators of this loader)."""
        return self._stats

    @property
    def pipeline(self) -> Pipeline | None:
        """The persistent workers' pipeline, once an iterator started it (for inspection:
        ``shmseq.testing``); None without persistent workers."""
        iterator = self._iterator
        if iterator is None:
            return None
        assert isinstance(iterator, _RingIterator)  # kept (persistent) only with workers
        return iterator.pipeline

    def close(self) -> None:
        """Stop the persistent workers now (dropping the loader does it too)."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            assert isinstance(iterator, _RingIterator)  # kept (persistent) only with workers
            iterator._shutdown_workers()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _RingIterator(_BaseDataLoaderIter):
    """One pass over the dataset per ``iter()``, its batches built by worker processes into
    the ring; the workers stay for the next pass with ``persistent_workers``. An
    ``IterableDataset``'s pass ends once every worker's stream has ended; a worker whose
    stream ended gets no more tasks in the pass, as under torch's loader.

    ``_BaseDataLoaderIter`` (torch's) draws the workers' base seed and makes the index
    sampler's iterator; each pass hands that iterator to the pipeline, which draws from it as
    the workers need batches (an endless sampler is fine)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._in_order = loader.in_order
        self._plan = SamplerPlan(self._index_sampler, as_task=_as_task)
        context = loader.multiprocessing_context
        assert loader.prefetch_factor is not None  # torch's default with workers: 2
        tuned = loader.max_workers is not None
        self._worker = _Fetcher(self._dataset, self._dataset_kind, self._auto_collation,
                                self._collate_fn, self._drop_last)
        self._options = LoaderOptions(
            "auto" if tuned else self._num_workers,
            max_workers=loader.max_workers, cpu_budget=loader.cpu_budget,
            memory_budget=loader.memory_budget,
            buffer=(loader._ring_slots if tuned else
                    self._num_workers * loader.prefetch_factor + 2),
            slot_bytes=loader.slot_bytes,
            start_method=None if context is None else context.get_start_method(),
            out_type="cpu", pin_memory=self._pin_memory,
            pin_device_id=torch.cuda.current_device() if self._pin_memory else 0,
            timeout=self._timeout or None, worker_init_fn=loader.worker_init_fn,
            worker_restarts=loader.worker_restarts)
        # a tuned count of workers cannot deal batches in turn: the turns would change with it
        self._hooks = FrontEndHooks(deal_in_turn=not tuned, start_lazily=True,
                                    fresh_start="make a new DataLoader in the child")
        self._stats = loader.stats
        self._pipeline: Pipeline | None = None
        self._stopped: list = []  # the worker processes, once shut down
        self._dead: WorkerDied | None = None  # a worker that died, without its traceback
        self._epoch = -1
        self._reset(loader, first_iter=True)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """A new pass: torch's ``_reset`` makes the index sampler's iterator, the pipeline
        drops what is left of the pass before and gives the workers the first batches. The
        workers start here the first time, and again if an earlier failure stopped them."""
        super()._reset(loader, first_iter)
        dead = self._dead
        if dead is not None:
            restarts = "" if dead.starting else (
                ", or pass worker_restarts=1 to replace a worker that dies")
            raise WorkerDied(
                f"DataLoader worker (pid(s) {dead.pid}) exited unexpectedly in an earlier pass; "
                "persistent workers are not replaced, so this loader starts no other pass (as "
                f"torch's): make a new DataLoader{restarts}", pid=dead.pid,
                exitcode=dead.exitcode, starting=dead.starting)
        self._epoch += 1
        if self._pipeline is None:
            self._pipeline = Pipeline(self._options.spec(self._worker, int(self._base_seed),
                                                         self._hooks),
                                      self._plan, self._epoch, stats=self._stats)
            self._closer = closing_finalizer(self, self._pipeline)
        items, epoch = self._sampler_iter, self._epoch
        if self._dataset_kind == _DatasetKind.Iterable:  # each task says which pass it is of
            items = ((epoch, item) for item in items)  # (not self: no cycle through the plan)
        self._cursor: Cursor | None = Cursor(self._pipeline, epoch, 0, items)

    def _next_data(self) -> Any:
        while True:
            cursor = self._cursor
            if cursor is None:
                raise StopIteration
            number, delivery = self._next_delivery(cursor)
            if not delivery.ended:  # else a worker's stream had ended: nothing to hand over
                return cursor.hand_over(number, delivery)

    def _next_delivery(self, cursor: Cursor) -> tuple[int, Delivery]:
        """The cursor's next delivery, with failures of the pipeline worded as torch's (a
        worker's own exception is not one: it comes with its batch, from ``hand_over``)."""
        try:
            return cursor.next_delivery(self._in_order)
        except StopIteration:
            if not self._persistent_workers:
                self._shutdown_workers()
            raise
        except BatchTimeout as exc:
            raise BatchTimeout(f"DataLoader timed out after {self._timeout} seconds: {exc}") \
                from None
        except WorkerDied as exc:  # the pass goes on without it, as torch's
            self._dead = WorkerDied("", pid=exc.pid, exitcode=exc.exitcode, starting=exc.starting)
            # a worker that died while starting would die so again in a replacement: its stage
            # says what to change (a main guard to add, say), restarts could not help
            restarts = "" if exc.starting else (
                " (pass worker_restarts=1 to replace a worker that dies and lose none)")
            raise WorkerDied(f"{_torchs_words(exc)}: {exc}; the pass goes on without the "
                             f"batches it held{restarts}", pid=exc.pid, exitcode=exc.exitcode,
                             starting=exc.starting) from None
        except PipelineClosed as exc:
            raise PipelineClosed(f"this DataLoader iterator was shut down ({exc}): start a new "
                                 "pass with iter(loader)") from None
        except (ShmSeqError, KeyboardInterrupt, SystemExit):
            self._shutdown_workers()  # a failure of the pipeline, or Ctrl-C: nothing left running
            raise

    @property
    def pipeline(self) -> Pipeline | None:
        """The running pipeline (for inspection: ``shmseq.testing``); None once shut down."""
        return self._pipeline

    @property
    def _workers(self) -> list:
        """The worker processes (``multiprocessing.Process``), as torch's iterator lists them:
        tools and torch's own tests join and watch them (``is_alive()``, ``join()``, ``pid``,
        ``exitcode``), also once the iterator has shut them down."""
        if self._pipeline is None:
            return self._stopped
        assert self._pipeline.pool is not None  # made with the pipeline
        return [handle.runner for handle in self._pipeline.pool.handles]

    def _shutdown_workers(self) -> None:
        """Stop the workers and free the ring (Lightning calls this on persistent workers)."""
        if self._pipeline is not None:
            self._stopped = self._workers
            self._pipeline = self._cursor = None
            self._closer()


_TORCH_ARGUMENTS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                    "multiprocessing_context", "generator", "prefetch_factor",
                    "persistent_workers", "pin_memory_device", "in_order")


def on_ring(loader: TorchDataLoader, like: DataLoader | None = None) -> TorchDataLoader:
    """``loader`` reading through shmseq's ring again, after a framework rebuilt it as torch's.

    Accelerate's ``prepare()`` and ``skip_first_batches()`` build a torch ``DataLoader`` from
    the attributes of the one they are given (inside a ``DataLoaderShard`` for ``prepare``):
    its batches would no longer come through the ring. Given what they return, this gives it
    a shmseq ``DataLoader`` with the same arguments instead (and the ``slot_bytes`` and
    ``worker_restarts`` of ``like``); everything else Accelerate does (sharding, ``even_batches``,
    ``gather_for_metrics``, device placement) is unchanged; a ``like`` with
    ``num_workers='auto'`` gives its bounds, for the workers to be tuned again. A loader
    already on the ring is returned as it is."""
    base = getattr(loader, "base_dataloader", loader)
    if isinstance(base, DataLoader):
        return loader
    if not isinstance(base, TorchDataLoader):
        raise TypeError(f"loader must be a torch DataLoader or one Accelerate prepared, got "
                        f"{type(loader).__name__}")
    batching = ({"batch_sampler": base.batch_sampler} if base.batch_sampler is not None else
                {"batch_size": None, "sampler": base.sampler})
    arguments = {name: getattr(base, name) for name in _TORCH_ARGUMENTS}
    if isinstance(like, DataLoader):
        arguments.update(like.tuned_arguments())
    rebuilt: DataLoader = DataLoader(base.dataset, **batching, **arguments,
                         slot_bytes=getattr(like, "slot_bytes", None),
                         worker_restarts=getattr(like, "worker_restarts", 0))
    if base is loader:
        return rebuilt
    loader.base_dataloader = rebuilt
    return loader


class RaggedCollate:
    """``collate_fn`` that keeps the named fields of the samples ragged, where torch's
    ``default_collate`` fails on tensors whose first dimensions differ (detection boxes, token
    sequences, encoded images as ``bytes``).

    ``RaggedCollate("boxes")`` for dict samples, ``RaggedCollate(1)`` for tuple samples (by
    position): each named field becomes one ``torch.nested`` jagged tensor, its items back to
    back in ``values()`` with ``offsets()``; every other field is collated by
    ``default_collate``. Naming the fields, rather than going ragged wherever lengths differ,
    keeps each field's type the same in every batch, even one whose items happen to be equal.
    Items of a dtype torch lacks (numpy strings, records) become a ``shmseq.Ragged`` of numpy
    arrays instead. The result is a torch object, so torch's own ``DataLoader`` gives the same
    batches (its workers pickle a jagged tensor through its queues as any tensor); through
    ``shmseq.torch.DataLoader`` the jagged tensor is written into the slot once and delivered as
    views of it."""

    def __init__(self, *fields: str | int) -> None:
        if not fields:
            raise ValueError("RaggedCollate needs the fields to keep ragged: keys of dict samples "
                             "(RaggedCollate('boxes')) or positions of tuple samples (RaggedCollate(1))")
        unhashable = [field for field in fields if not isinstance(field, Hashable)]
        if unhashable:
            raise TypeError(f"RaggedCollate takes each field as an argument of its own, got "
                            f"{unhashable[0]!r}: write RaggedCollate('boxes', 'jpg'), not "
                            "RaggedCollate(['boxes', 'jpg'])")
        self.fields = fields

    def __call__(self, samples: list) -> Any:
        first = samples[0]
        if isinstance(first, dict):
            self._check_fields(list(first), "keys")
            return {key: self._column(key, [sample[key] for sample in samples]) for key in first}
        if isinstance(first, (tuple, list)):
            self._check_fields(range(len(first)), "positions")
            columns = [self._column(place, list(column)) for place, column in
                       enumerate(zip(*samples))]
            return type(first)(*columns) if hasattr(type(first), "_fields") else columns
        raise TypeError(f"RaggedCollate names fields of dict or tuple samples, got a "
                        f"{type(first).__name__}: return a dict or tuple from the dataset")

    def _check_fields(self, known: Collection[object], kind: str) -> None:
        missing = [field for field in self.fields if field not in known]
        if missing:
            raise ValueError(f"RaggedCollate{self.fields!r}: the samples have no field "
                             f"{missing[0]!r} (their {kind}: {list(known)}); name one of those")

    def _column(self, field: str | int, items: list) -> Any:
        if field not in self.fields:
            return default_collate(items)
        try:
            ragged = Ragged.from_items(items)
        except ValueError as exc:
            raise ValueError(f"RaggedCollate: field {field!r}: {exc}") from None
        return _jagged(ragged)


def _jagged(ragged: Ragged) -> Ragged | torch.Tensor:
    """The items as a jagged tensor; a ``Ragged`` of numpy arrays where torch has no dtype for
    them (strings, records), as the ring delivers such a leaf."""
    values = ragged.values
    if isinstance(values, np.ndarray):
        try:
            values = torch.as_tensor(values)
        except TypeError:
            return ragged
    return make_leaf(values, torch.from_numpy(ragged.offsets))


def _torchs_words(death: WorkerDied) -> str:
    """A dead worker as torch's loader reports it: by its signal, or as gone."""
    if death.exitcode is not None and death.exitcode < 0:
        return (f"DataLoader worker (pid {death.pid}) is killed by signal: "
                f"{signal.strsignal(-death.exitcode)}")
    return f"DataLoader worker (pid(s) {death.pid}) exited unexpectedly"


__all__ = ["DataLoader", "RaggedCollate", "on_ring", "slot_collate"]
