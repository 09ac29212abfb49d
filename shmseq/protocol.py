"""What crosses between the engine's parts, declared in one place; nothing here runs.

The consumer's thread and each worker talk through two pipes (wire.py frames them):

* to a worker (pool.py sends, workers.py reads, in the worker's own process or thread):
  ``Build`` a batch, or ``Rebuild`` a dead worker's; ``MapRing``; ``Place`` a held batch;
  ``TakeWorker`` (a spawned worker's first message); ``Stop``.
* from a worker (workers.py sends, pool.py reads in the consumer's thread while it waits):
  ``Ready`` and ``Attached`` once; for each task ``Done``, ``Overflow``, ``Failed`` or
  ``Ended``, perhaps after ``Built`` (a batch built without a slot, held until ``Place``),
  and preceded in the same write by ``Counted`` and ``Skipped`` when the worker has them to
  tell; ``InitFailed`` when the worker object could not be made.

``Build`` and ``Done``, the two messages every batch costs, travel as fixed binary records;
the others are pickled. Each message is matched by its type where it is handled.

In the consumer's thread, the pool turns a worker's reply into a ``Reply`` for the converter
(convert.py), which turns it into a ``Delivery`` for the consumer.

This module imports nothing of shmseq: every other part may import it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


# -- to a worker --------------------------------------------------------------------------------
class Build(NamedTuple):
    """Build batch ``number`` of ``indices`` and write it into ``slot``. Without a slot (None:
    the ring is not sized yet), build it, tell its size (``Built``) and hold it until
    ``Place``. ``indices``: int64 sample indices, or what a user's sampler gave (a list of
    arrays for a multi-shard batch, any picklable item for torch's)."""
    number: int
    slot: int | None
    indices: object


class Rebuild(NamedTuple):
    """A dead worker's ``Build``, given again: it overtakes the tasks queued before it, and the
    ``Rebuild``s of an earlier death, but not the other messages before it (the ring)."""
    number: int
    slot: int | None
    indices: object


class MapRing(NamedTuple):
    """Map the ring ``spec`` (a ``segments.RingSpec``) and say so (``Attached``)."""
    spec: object


class Place(NamedTuple):
    """The answer to ``Built``: write held batch ``number`` into ``slot``; None: send it back
    encoded (it is larger than a slot, or none is free)."""
    number: int
    slot: int | None


class TakeWorker(NamedTuple):
    """The worker, pickled: the first message to a worker started by spawn or forkserver."""
    pickled: bytes


class Stop(NamedTuple):
    """Leave after the batch in hand: it overtakes every task queued before it."""


# -- from a worker ------------------------------------------------------------------------------
class ErrorReport(NamedTuple):
    """A worker's exception as it crosses back: made into the consumer's exception by
    ``errors.raised_in_worker``."""
    type_name: str
    message: str
    traceback: str
    pickled: bytes | None  # the exception itself; None when it does not pickle


class Ready(NamedTuple):
    """Worker ``wid`` made its worker object: it takes tasks."""
    wid: int


class Attached(NamedTuple):
    """Worker ``wid`` maps the ring."""
    wid: int


class Built(NamedTuple):
    """Batch ``number``, sent without a slot, is built and held: it takes ``size`` bytes."""
    number: int
    size: int


class Done(NamedTuple):
    """Batch ``number`` is in ``slot``: ``size`` bytes, built in ``seconds``."""
    number: int
    slot: int
    size: int
    seconds: float


class Overflow(NamedTuple):
    """Batch ``number`` comes encoded (``payload``, slot format): larger than ``slot``, or
    built without a slot and given none (``slot`` None)."""
    number: int
    slot: int | None
    payload: np.ndarray
    seconds: float


class Failed(NamedTuple):
    """Building batch ``number`` raised ``error``; ``slot`` is unused."""
    number: int
    slot: int | None
    error: ErrorReport


class Ended(NamedTuple):
    """The worker's stream has no batch ``number`` in this pass (``workers.StreamEnded``):
    ``slot`` is unused, and the worker gets no more tasks in the pass."""
    number: int
    slot: int | None


class Skipped(NamedTuple):
    """The worker's skip policy left ``samples`` out of batch ``number`` (why, one each): sent
    just before the batch's own reply."""
    number: int
    samples: list


class Counted(NamedTuple):
    """What the worker counted since its last batch (``LoaderStats`` field -> increment):
    sent just before a batch's reply."""
    counts: dict


class InitFailed(NamedTuple):
    """Worker ``wid`` could not make its worker object (or its ``worker_init_fn`` raised)."""
    wid: int
    error: ErrorReport


ToWorker = Build | Rebuild | MapRing | Place | TakeWorker | Stop
FromWorker = Ready | Attached | Built | Done | Overflow | Failed | Ended | Skipped | Counted \
    | InitFailed


# -- inside the consumer's thread -----------------------------------------------------------------
class Reply(NamedTuple):
    """What the pool makes of a worker's reply, for the converter: batch ``number`` in
    ``slot``, or as ``payload`` bytes (it ``overflowed`` its slot, or was built without one and
    given none), or ``error``, which makes the error to raise in its place (made when raised:
    an exception kept in a frame of its own traceback is a reference cycle, which would keep
    the consumer's batches, and their ring, until a garbage collection)."""
    number: int
    slot: int | None
    payload: np.ndarray | None = None
    error: Callable[[], BaseException] | None = None
    overflowed: bool = False
    ended: bool = False  # no batch: the worker's stream ended (``Ended``), or it died
    skipped: tuple = ()  # samples the worker's skip policy left out, why (counted when delivered)


class Delivery(NamedTuple):
    """What the converter makes of a reply: a batch ready for the consumer (or the error to
    raise in its place), waiting in ``convert.OrderedOutput`` until the consumer takes it."""
    batch: object          # what the consumer gets
    copy: object = None    # the device's copy still in flight, if any
    in_slot: bool = False  # the batch is views of a leased slot
    payload_bytes: int = 0  # size of a payload too large for its slot (overflow), else 0
    nbytes: int = 0         # the batch's array bytes
    error: Callable[[], BaseException] | None = None  # makes the error (see ``Reply``)
    ended: bool = False     # no batch: a worker's stream had ended (a stream's pass skips it)
    skipped: tuple = ()     # what the worker's skip policy left out of it (see ``Reply``)
