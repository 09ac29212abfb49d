"""A dataset's own state, where the dataset is read: in each worker (or the training process,
without workers), taken after a batch and loaded as a resumed pass starts.

As torchdata's ``StatefulDataLoader``: a dataset with ``state_dict()``/``load_state_dict()``
(loaded before ``iter()``), an ``IterableDataset``'s iterator with them (loaded after), or, for
a stream with neither, the stream fast-forwarded past the batches handed over. Fast-forwarded
batches are fetched from the stream and dropped in the worker: never collated, written into
the ring or sent. A record is torchdata's worker snapshot (``worker_id``, ``dataset_state``,
``fetcher_state``), with the worker's batches of the pass ``fetched`` when it was taken and
those ``handed`` over since the pass began (the trainer's count, see ``torch_state``).
"""
from __future__ import annotations

from typing import Any

from torch.utils.data.dataloader import _DatasetKind

from .sampler_state import is_stateful


def _state_of(obj: object) -> object:
    """``obj.state_dict()``, or None for an object without a state of its own."""
    return obj.state_dict() if is_stateful(obj) else None  # type: ignore[attr-defined]


def empty_record(worker_id: int, iterable: bool) -> dict:
    """A worker's record before it handed a batch over: a fresh start."""
    return {"worker_id": worker_id, "dataset_state": None,
            "fetcher_state": ({"dataset_iter_state": None, "fetcher_ended": False} if iterable
                              else None),
            "fetched": 0, "handed": 0}


def snapshot(worker_id: int, kind: int, dataset: object, fetcher: Any) -> dict:
    """The dataset's state (and an ``IterableDataset``'s stream's) as it is now; a dataset
    that is its own iterator is saved once, as the iterator."""
    if kind != _DatasetKind.Iterable:
        return {"worker_id": worker_id, "dataset_state": _state_of(dataset),
                "fetcher_state": None}
    stream = None if fetcher is None else fetcher.dataset_iter
    return {"worker_id": worker_id,
            "dataset_state": None if stream is dataset else _state_of(dataset),
            "fetcher_state": {"dataset_iter_state": _state_of(stream),
                              "fetcher_ended": bool(fetcher is not None and fetcher.ended)}}


def has_state(record: dict) -> bool:
    """Whether a record holds the dataset's or its stream's own state (else the stream is
    fast-forwarded from its start)."""
    return record["dataset_state"] is not None or (record["fetcher_state"] or {}).get(
        "dataset_iter_state") is not None


def load_dataset_state(dataset: object, record: dict) -> None:
    """Before ``iter(dataset)``: the dataset's own state, if the record has one."""
    if record["dataset_state"] is not None:
        dataset.load_state_dict(record["dataset_state"])  # type: ignore[attr-defined]


def load_iterator_state(fetcher: Any, record: dict) -> None:
    """After ``iter(dataset)``: the stream's own state, if the record has one."""
    iterator_state = (record["fetcher_state"] or {}).get("dataset_iter_state")
    if iterator_state is not None:
        fetcher.dataset_iter.load_state_dict(iterator_state)


def load_stream_state(fetcher: Any, record: dict, item: object) -> None:
    """After ``iter(dataset)``: the stream's own state, then the batches handed over since
    that state was taken (or since the pass began, without one) fetched and dropped.
    ``item``: what one batch is fetched with."""
    load_iterator_state(fetcher, record)
    skip = record["handed"] - (record["fetched"] if has_state(record) else 0)
    collate_fn, fetcher.collate_fn = fetcher.collate_fn, _dropped
    try:
        for _ in range(skip):
            fetcher.fetch(item)
    except StopIteration:
        pass  # the stream is shorter than it was: its next fetch says it ended
    finally:
        fetcher.collate_fn = collate_fn


def _dropped(samples: object) -> None:
    """A fast-forwarded batch is not collated."""
