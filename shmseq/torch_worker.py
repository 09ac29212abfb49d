"""``shmseq.torch``'s side in each worker: the batch fetched with torch's own fetcher and
collated into the slot, and what torch's ``get_worker_info()`` reads there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from torch.utils.data import Dataset
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import _DatasetKind

from .engine import SlotAllocator, StreamEnded, WorkerInfo, get_worker_info
from .torch_collate import slot_collate
from .sampler_state import is_stateful
from .torch_dataset_state import (load_dataset_state, load_iterator_state, load_stream_state,
                                  snapshot)

if TYPE_CHECKING:
    from torch.utils.data._utils.fetch import _BaseDatasetFetcher


class Index:
    """A sampler's item sent to a worker as it is (pickled): a key, a list for bulk loading."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def as_task(index: object) -> np.ndarray | Index:
    """What a worker is sent for one item of the index sampler: a list of ints (what torch's
    samplers give) as int64 indices, the wire's fixed binary frame; anything else as is."""
    if type(index) is list and set(map(type, index)) == {int}:
        return np.array(index, dtype=np.int64)
    return Index(index)


class Resumed:
    """A resumed pass's first task to each worker: the records of the workers' datasets (by
    worker id), each loaded by its own worker before it fetches ``item``. ``between_passes``:
    the state was taken after its pass ended, so the next pass keeps the datasets' states only
    (a persistent worker's dataset carries them over), not the streams'."""

    def __init__(self, records: dict[int, dict], item: object, between_passes: bool) -> None:
        self.records = records
        self.item = item
        self.between_passes = between_passes


class Fetcher:
    """Runs in each worker: fetches an item of the index sampler with torch's own fetcher (so
    ``__getitems__``, bulk loading, ``collate_fn`` and the end of an ``IterableDataset``'s
    stream behave as under torch's loader) and collates it straight into the slot when
    ``collate_fn`` is torch's ``default_collate``.

    For an ``IterableDataset`` a task is ``(pass, item)``: the worker iterates its copy of the
    dataset anew at each pass, as torch's workers do, and says when its stream has ended.

    For checkpoints (``torch_dataset_state``), each batch's reply carries a note
    (``pop_state``): a stream's batches fetched in the pass, and the dataset's state every
    ``snapshot_every`` of them and at the stream's end; a map-style dataset's state with each
    batch, if it has one."""

    def __init__(self, dataset: Dataset, kind: int, auto_collation: bool,
                 collate_fn: Callable[[list], Any], drop_last: bool,
                 snapshot_every: int | None = 1) -> None:
        self.dataset = dataset  # what get_worker_info().dataset is
        self.kind = kind
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.snapshot_every = snapshot_every
        self._fetcher: _BaseDatasetFetcher | None = None
        self._pass: object = None  # the pass the fetcher iterates (an IterableDataset's)
        self._fetched = 0  # the stream's batches fetched in the pass
        self._note: dict | None = None  # for the reply to the batch in hand
        self._slot: SlotAllocator | None = None  # where the batch in hand is collated

    def fill_batch(self, task: np.ndarray | Index, out: SlotAllocator) -> Any:
        item: Any = task.tolist() if isinstance(task, np.ndarray) else task.value
        if self.kind == _DatasetKind.Iterable:
            this_pass, item = item
            if this_pass != self._pass:
                self._fetcher, self._pass, self._fetched = None, this_pass, 0
        resumed = item if isinstance(item, Resumed) else None
        if resumed is not None:
            item = resumed.item
            self._resume(resumed, item)
        elif self._fetcher is None:  # in the worker, after its seeding and worker_init_fn
            self._fetcher = self._new_fetcher()
        assert self._fetcher is not None
        self._slot = out
        try:
            batch: Any = self._fetcher.fetch(item)
        except StopIteration:
            if self.kind != _DatasetKind.Iterable:
                raise  # from a map-style dataset: an error, as under torch's loader
            self._note = self._noted(ended=True)
            raise StreamEnded from None
        finally:
            self._slot = None
        self._fetched += 1
        self._note = self._noted(ended=False)
        return batch

    def _new_fetcher(self) -> _BaseDatasetFetcher:
        collate_fn = self._into_slot if self.collate_fn is default_collate else self.collate_fn
        return _DatasetKind.create_fetcher(self.kind, self.dataset, self.auto_collation,
                                           collate_fn, self.drop_last)

    def _resume(self, resumed: Resumed, item: object) -> None:
        """This worker's record loaded: the dataset's state before its stream is made, the
        stream's after (and fast-forwarded), as torchdata's workers load them."""
        record = resumed.records.get(self._worker_id())
        if record is not None:
            load_dataset_state(self.dataset, record)
        if self._fetcher is None or self.kind == _DatasetKind.Iterable:
            self._fetcher = self._new_fetcher()
        if record is None or self.kind != _DatasetKind.Iterable:
            return
        if resumed.between_passes:  # the ended stream's state (its randomness, say), then the
            load_iterator_state(self._fetcher, record)  # new pass's stream, as a persistent
            self._fetcher = self._new_fetcher()  # worker goes on from one to the next
        else:
            load_stream_state(self._fetcher, record, item)
            self._fetched = record["handed"]

    def _noted(self, ended: bool) -> dict | None:
        """The note for the batch in hand (or the stream's end); None: nothing to keep."""
        worker_id = self._worker_id()
        if self.kind != _DatasetKind.Iterable:
            if not is_stateful(self.dataset):
                return None
            return {"worker_id": worker_id, "fetched": self._fetched, "ended": False,
                    "snapshot": snapshot(worker_id, self.kind, self.dataset, None)}
        due = ended or bool(self.snapshot_every and self._fetched % self.snapshot_every == 0)
        return {"worker_id": worker_id, "fetched": self._fetched, "ended": ended,
                "snapshot": snapshot(worker_id, self.kind, self.dataset, self._fetcher)
                if due else None}

    def pop_state(self) -> dict | None:
        """The note for the reply to the batch just built (``Noted``)."""
        note, self._note = self._note, None
        return note

    @staticmethod
    def _worker_id() -> int:
        info = get_worker_info()
        return 0 if info is None else info.id

    def _into_slot(self, samples: list) -> Any:
        return slot_collate(samples, self._slot)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fetcher": None, "_slot": None, "_note": None}

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


def tell_torch(info: WorkerInfo, dataset: object) -> None:
    """What ``torch.utils.data.get_worker_info()`` reads in its own workers, so that a dataset
    written for torch's loader splits its stream, and seeds itself, as there."""
    # the type ignored: ``dataset`` is whatever the worker names (None if nothing), not always
    # the Dataset torch's stubs want
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed,
        dataset=dataset)  # type: ignore[arg-type]
