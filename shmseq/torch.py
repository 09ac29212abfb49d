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
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, TypeVar, cast

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
from torch.utils.data.dataloader import (_BaseDataLoaderIter, _DatasetKind,
                                        _SingleProcessDataLoaderIter)

from .checks import check_auto_bounds, check_int
from .engine import (START_WORKERS, BatchTimeout, Cursor, FrontEndHooks, LoaderStats, Pipeline,
                     PipelineClosed, SamplerPlan, ShmSeqError, WorkerDied, closing_finalizer,
                     default_max_workers)
from .options import LoaderOptions
from .torch_collate import RaggedCollate, slot_collate
from .torch_dataset_state import (has_state, load_dataset_state, load_iterator_state,
                                  load_stream_state, snapshot)
from .torch_spread import Spread, dealt_again, rest_of_pass, spread_of
from .torch_state import (VERSION as STATE_VERSION, PassRecord, PassStart, Samplers,
                          WorkerRecords, check_workers, drawn_as_saved, generators_of,
                          draws_now, kept_torch_rng, loader_state, passed_over, records_in,
                          restore_now)
from .torch_worker import Fetcher, Resumed, as_task, tell_torch

if TYPE_CHECKING:
    from .engine import Delivery



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

    Checkpoints, as torchdata's ``StatefulDataLoader``: ``state_dict()`` between any two
    batches (a plain, JSON-serialisable dict), ``load_state_dict()`` before ``iter()``; the
    resumed loader yields the batches the uninterrupted one would have, with any number of
    workers (``snapshot_every_n_steps``: how often a worker's stream notes its own state). See
    ``shmseq.torch_state``.
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
                 memory_budget: int | None = None,
                 snapshot_every_n_steps: int | None = 1) -> None:
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
        check_int("snapshot_every_n_steps", snapshot_every_n_steps, 0, optional=True)
        self.slot_bytes = slot_bytes
        self.worker_restarts = worker_restarts
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._stats = LoaderStats()
        self._resume: dict | None = None  # a loaded state, for the next iterator
        self._record: PassRecord | None = None  # the pass state_dict() describes

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
        if self.num_workers and self._dataset_kind == _DatasetKind.Iterable and \
                self.worker_restarts:
            raise ValueError(
                f"worker_restarts={self.worker_restarts} needs a map-style dataset: a "
                f"replacement worker cannot resume the stream of {type(self.dataset).__name__} "
                "(an IterableDataset) where the dead one stopped; pass worker_restarts=0")
        resume, self._resume = self._resume, None
        make = _SingleIterator if self.num_workers == 0 else _RingIterator  # more workers than
        # cores: torch's constructor warned
        return make(self, resume)

    def state_dict(self) -> dict:
        """Where the loader stands (torchdata's ``StatefulDataLoader.state_dict``): loaded into
        a loader built the same way, its next ``iter()`` goes on from here."""
        if self._resume is not None:
            return dict(self._resume)
        now = draws_now(self._generators(), Samplers(self._index_sampler))
        if self._record is None:
            workers = WorkerRecords(self.num_workers, self._is_iterable())
            return loader_state(False, 0, False, None, None, [], now, workers.state())
        return self._record.state(now)

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` at the next ``iter()``: the rest of the pass it was
        taken in (nothing, if it was taken after its last batch), or else the next pass."""
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state with keys {sorted(state)} is not one shmseq.torch.DataLoader.state_dict() "
                f"gave (version {STATE_VERSION}): a torchdata StatefulDataLoader's state does not "
                "load here; resume from a state this loader saved, or start the pass afresh")
        check_workers(state, self.num_workers, self._is_iterable())
        restore_now(state, self._generators(), Samplers(self._index_sampler), _mid_pass(state))
        self.close()  # persistent workers: the resumed pass is a new iterator's
        self._resume = dict(state)

    def _generators(self) -> list[torch.Generator]:
        return generators_of(self, self.sampler, self.batch_sampler)

    def _is_iterable(self) -> bool:
        return self._dataset_kind == _DatasetKind.Iterable

    def _carries_datasets(self) -> bool:
        """Whether a dataset's state carries over from one pass to the next: the same object
        reads every pass (no workers), or a persistent worker's copy does."""
        return self.num_workers == 0 or self.persistent_workers

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


class _Checkpointed(_BaseDataLoaderIter):
    """What an iterator of ``DataLoader`` adds to torch's for ``state_dict()``: where its pass
    was drawn from (``PassStart``), and whether it ended; a resumed pass drawn again."""

    _in_order = True  # batches handed over in order (torch's in_order, with workers)
    _pass: PassStart
    _record: PassRecord
    _generators: list[torch.Generator]
    _skipped: tuple[int, frozenset[int]] = (0, frozenset())  # a resumed pass's: the batches
    # handed over before it, in order and ahead of their turn (in_order=False)
    _dealt_again = False  # a resumed pass whose rest was dealt to another world size

    def _begin_pass(self, loader: DataLoader, resume: dict | None) -> None:
        """After torch's ``_reset`` made the index sampler's iterator: read it through a
        ``PassStart``; resumed mid-pass, draw the saved pass again past the batches handed
        over (a map-style dataset's: a stream is fast-forwarded by its workers)."""
        self._generators = generators_of(loader, loader.sampler, loader.batch_sampler)
        samplers = Samplers(self._index_sampler)
        spread = spread_of(self._index_sampler)
        if resume is not None and _mid_pass(resume):
            self._base_seed = resume["base_seed"]
        if resume is None or not _mid_pass(resume) or resume["pass"] is None:  # none drawn yet
            self._pass = PassStart(self._sampler_iter, self._generators, samplers)
        else:
            spread = self._draw_again(resume, samplers, spread)
        self._sampler_iter = self._pass
        self._record = loader._record = PassRecord(self._pass, int(self._base_seed),
                                                   self._workers_from(loader, resume), spread)

    def _draw_again(self, resume: dict, samplers: Samplers,
                    spread: Spread | None) -> Spread | None:
        """The saved pass drawn again past the batches handed over; or, saved on another world
        size with a ``DistributedSampler``, what the ranks had not read of it dealt again."""
        saved = resume.get("distributed")
        if saved is not None and dealt_again(self._index_sampler, saved):
            samplers.restore(resume["pass"])
            spread, items = rest_of_pass(self._index_sampler, saved)
            self._dealt_again = True
        else:
            ahead = frozenset(resume["ahead"])
            if self._dataset_kind != _DatasetKind.Iterable:
                self._skipped = (resume["num_yielded"] - len(ahead), ahead)
            with drawn_as_saved(self._generators, resume["pass"], samplers):
                items = passed_over(self._index_sampler, *self._skipped)
        self._pass = PassStart(items, self._generators, samplers, resume["pass"])
        return spread

    def _workers_from(self, loader: DataLoader, resume: dict | None) -> WorkerRecords:
        """Where the pass's datasets start: as saved (resumed mid-pass), as the pass before
        left them (when they carry their states over), or afresh."""
        iterable = self._dataset_kind == _DatasetKind.Iterable
        if resume is not None:
            saved = WorkerRecords(loader.num_workers, iterable, resume)
            return saved if _mid_pass(resume) or not loader._carries_datasets() else \
                saved.next_pass()
        if loader._record is not None and loader._carries_datasets():
            return loader._record.workers.next_pass()
        return WorkerRecords(loader.num_workers, iterable)

    def _count_handed(self, resume: dict | None) -> None:
        """A pass resumed mid-way has handed over the saved batches already (not one whose
        rest was dealt again: its batches are new)."""
        if _mid_pass(resume) and not self._dealt_again:
            assert resume is not None
            self._num_yielded = self._record.num_yielded = resume["num_yielded"]
            self._record.ahead = sorted(self._skipped[1])

    def __next__(self) -> Any:
        try:
            batch = super().__next__()
        except StopIteration:
            self._record.finished = True
            raise
        self._record.num_yielded = self._num_yielded
        if self._skipped[1] or not self._in_order:
            self._record.ahead = self._handed_ahead()
        return batch

    def _handed_ahead(self) -> list[int]:
        """The batches of the pass handed over before their turn: none, in order."""
        return []


class _SingleIterator(_Checkpointed, _SingleProcessDataLoaderIter):
    """torch's own iterator without workers, with a state."""

    def __init__(self, loader: DataLoader, resume: dict | None) -> None:
        if resume is None:
            super().__init__(loader)
            self._begin_pass(loader, None)
        else:
            self._init_resumed(loader, resume)
        self._record.workers.take = self._take_record

    def _init_resumed(self, loader: DataLoader, resume: dict) -> None:
        """torch's ``__init__`` for a resumed pass, the dataset's state loaded before its
        stream is made and the stream's after; the dataset's randomness, if its state holds
        it, is what torch's generator is left with, else the training loop's."""
        record, mid_pass = records_in(resume)[0], _mid_pass(resume)
        if not mid_pass:  # the pass's draws come after it, as when one loader goes on
            load_dataset_state(loader.dataset, record)  # (the same object every pass reads)
        with kept_torch_rng(mid_pass):
            _BaseDataLoaderIter.__init__(self, loader)
            self._begin_pass(loader, resume)
        if mid_pass:
            load_dataset_state(self._dataset, record)
        self._dataset_fetcher = self._new_fetcher()
        iterable = self._dataset_kind == _DatasetKind.Iterable
        if iterable and mid_pass:
            load_stream_state(self._dataset_fetcher, record,
                              [None] * (loader.batch_size or 0) if self._auto_collation
                              else None)
        elif iterable:  # between passes: the ended stream's state (its randomness, say), then
            load_iterator_state(self._dataset_fetcher, record)  # the new pass's stream, as one
            self._dataset_fetcher = self._new_fetcher()  # loader goes on from pass to pass
        self._count_handed(resume)

    def _new_fetcher(self) -> Any:
        return _DatasetKind.create_fetcher(self._dataset_kind, self._dataset,
                                           self._auto_collation, self._collate_fn,
                                           self._drop_last)

    def _take_record(self) -> dict:
        """The dataset's record as it stands: read in this process, exactly at the batches
        handed over."""
        handed = self._num_yielded
        return {**snapshot(0, self._dataset_kind, self._dataset, self._dataset_fetcher),
                "fetched": handed, "handed": handed}


class _RingIterator(_Checkpointed):
    """One pass over the dataset per ``iter()``, its batches built by worker processes into
    the ring; the workers stay for the next pass with ``persistent_workers``. An
    ``IterableDataset``'s pass ends once every worker's stream has ended; a worker whose
    stream ended gets no more tasks in the pass, as under torch's loader.

    ``_BaseDataLoaderIter`` (torch's) draws the workers' base seed and makes the index
    sampler's iterator; each pass hands that iterator to the pipeline, which draws from it as
    the workers need batches (an endless sampler is fine)."""

    def __init__(self, loader: DataLoader, resume: dict | None) -> None:
        goes_on = resume is not None and (_mid_pass(resume) or resume["finished"] and
                                          loader.persistent_workers)
        with kept_torch_rng(goes_on):  # the saved iterator drew its base seed before the state
            super().__init__(loader)  # (its persistent workers draw none for the next pass)
        if goes_on:
            assert resume is not None
            self._base_seed = resume["base_seed"]
        with kept_torch_rng(_mid_pass(resume)):  # resumed mid-pass, the new iterator's draws
            self._start(loader, resume)  # leave torch's generator as the training loop has it

    def _start(self, loader: DataLoader, resume: dict | None) -> None:
        self._in_order = loader.in_order
        self._plan = SamplerPlan(self._index_sampler, as_task=as_task)
        context = loader.multiprocessing_context
        assert loader.prefetch_factor is not None  # torch's default with workers: 2
        tuned = loader.max_workers is not None
        every = loader.snapshot_every_n_steps
        self._worker = Fetcher(self._dataset, self._dataset_kind, self._auto_collation,
                               self._collate_fn, self._drop_last,
                               every and max(1, every // self._num_workers))
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
                                    open_in_turn=None if loader.in_order else
                                    self._num_workers * loader.prefetch_factor,
                                    on_worker_start=tell_torch,
                                    fresh_start="make a new DataLoader in the child")
        self._stats = loader.stats
        self._pipeline: Pipeline | None = None
        self._stopped: list = []  # the worker processes, once shut down
        self._dead: WorkerDied | None = None  # a worker that died, without its traceback
        self._epoch = -1
        self._resume_first = resume
        self._reset(loader, first_iter=True)
        self._count_handed(resume)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """A new pass: torch's ``_reset`` makes the index sampler's iterator, the pipeline
        drops what is left of the pass before and gives the workers the first batches. The
        workers start here the first time, and again if an earlier failure stopped them."""
        super()._reset(loader, first_iter)
        resume, self._resume_first = self._resume_first, None
        self._begin_pass(loader, resume)
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
        first_worker = 0
        if resume is not None:
            items, first_worker = self._resumed(loader, resume, items)
        if self._dataset_kind == _DatasetKind.Iterable:  # each task says which pass it is of
            items = ((epoch, item) for item in items)  # (not self: no cycle through the plan)
        self._cursor: Cursor | None = Cursor(self._pipeline, epoch, 0, items, first_worker)

    def _resumed(self, loader: DataLoader, resume: dict,
                 items: Iterator) -> tuple[Iterator, int]:
        """A resumed pass's items, the first to each worker with the saved records of the
        workers' datasets (``Resumed``), and the worker whose turn is first: the one that
        was next when the state was saved."""
        records = records_in(resume)
        mid_pass = _mid_pass(resume)
        if not mid_pass and not (loader._carries_datasets() and any(
                has_state(record) for record in records.values())):
            return items, 0
        first_worker = 0
        if mid_pass:
            first_worker = (resume.get("next_worker", 0) if
                            self._dataset_kind == _DatasetKind.Iterable else
                            self._skipped[0] % self._num_workers)
        count = self._num_workers
        return ((Resumed(records, item, not mid_pass) if position < count else item
                 for position, item in enumerate(items)), first_worker)

    def _next_data(self) -> Any:
        while True:
            cursor = self._cursor
            if cursor is None:
                raise StopIteration
            number, delivery = self._next_delivery(cursor)
            self._record.workers.noted(delivery.noted)
            if not delivery.ended:  # else a worker's stream had ended: nothing to hand over
                return cursor.hand_over(number, delivery)

    def _next_delivery(self, cursor: Cursor) -> tuple[int, Delivery]:
        """The cursor's next delivery, with failures of the pipeline worded as torch's (a
        worker's own exception is not one: it comes with its batch, from ``hand_over``)."""
        try:
            return cursor.next_delivery(self._in_order)
        except StopIteration:
            for ended in cursor.ended_past_the_end():  # the streams' states at their ends
                self._record.workers.noted(ended.noted)
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

    def _handed_ahead(self) -> list[int]:
        """The cursor's batches handed over ahead of their turn, and those a resumed pass
        skipped, as positions of the whole pass."""
        count, before = self._skipped
        cursor = self._cursor
        if cursor is None:
            return []
        first = _position_in_pass(cursor.position, count, before)
        return sorted({_position_in_pass(p, count, before) for p in cursor.ahead()} |
                      {p for p in before if p >= first})

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
        return self._pipeline.workers()

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
    if hasattr(loader, "dl_state_dict"):  # a stateful adapter: until its first batch, its
        loader.dl_state_dict = rebuilt.state_dict()  # state_dict() is the replaced loader's
    return loader


def _mid_pass(state: dict | None) -> bool:
    """Whether a loaded state was saved inside a pass, once its iterator was made (else
    between two, or before any)."""
    return state is not None and state["began"] and not state["finished"]


def _position_in_pass(position: int, count: int, before: frozenset[int]) -> int:
    """Where batch ``position`` of a resumed pass is in the whole pass, which skipped its first
    ``count`` batches and those at ``before``."""
    position += count
    for skipped_at in sorted(before):
        if skipped_at > position:
            break
        position += 1
    return position


def _torchs_words(death: WorkerDied) -> str:
    """A dead worker as torch's loader reports it: by its signal, or as gone."""
    if death.exitcode is not None and death.exitcode < 0:
        return (f"DataLoader worker (pid {death.pid}) is killed by signal: "
                f"{signal.strsignal(-death.exitcode)}")
    return f"DataLoader worker (pid(s) {death.pid}) exited unexpectedly"


StatefulDataLoader = DataLoader  # torchdata's name: its users change one import too

__all__ = ["DataLoader", "RaggedCollate", "StatefulDataLoader", "on_ring", "slot_collate"]
