"""What crosses between the engine's parts, declared in one place; nothing here runs.

The consumer's thread and each worker talk through two pipes (wire.py frames them):

* to a worker (trainer/pool.py sends, worker/loop.py reads, in the worker's own process or
  thread): ``Build`` a batch, or ``Rebuild`` a dead worker's; ``MapRing``; ``Place`` a held batch;
  ``TakeWorker`` (a spawned worker's first message); ``Stop``.
* from a worker (worker/loop.py sends, trainer/pool.py reads in the consumer's thread while it
  waits): ``Ready`` and ``Attached`` once; for each task ``Done``, ``Overflow``, ``Failed`` or
  ``Ended``, perhaps after ``Built`` (a batch built without a slot, held until ``Place``),
  and preceded in the same write by ``Counted``, ``Skipped`` and ``Noted`` when the worker
  has them to tell; ``InitFailed`` when the worker object could not be made.

``Build`` and ``Done``, the two messages every batch costs, travel as fixed binary records;
the others are pickled as plain tuples. Each message is matched by its type where it is
handled.

In the consumer's thread, the pool turns a worker's reply into a ``Reply`` for the converter
(trainer/convert.py), which turns it into a ``Delivery`` for the consumer; a device's ``Fence`` is
what the ring waits for once a batch's last view died (trainer/devices.py, trainer/ring.py).

The user's objects: a ``Worker`` (called in each worker; ``Hooks`` fills in the optional
hooks it lacks, the one place anything asks what a worker has) and a ``Plan`` (which indices
form each batch: trainer/plan.py's, called by the consumer's thread and the front ends).

This module imports nothing of shmseq: every other part may import it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:  # for the checker only: nothing of shmseq is imported when this runs
    from .layout import SlotAllocator
    from .segments import RingSpec


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
    """Map the ring ``spec`` and say so (``Attached``)."""
    spec: RingSpec


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
    """Batch ``number`` is in ``slot``: ``size`` bytes, built in ``seconds``, ``cpu_seconds``
    of them on a CPU (the worker process's, or a thread worker's own thread's); the worker
    had waited ``idle_seconds`` for a task since its last reply (none was queued for it)."""
    number: int
    slot: int
    size: int
    seconds: float
    cpu_seconds: float
    idle_seconds: float


class Overflow(NamedTuple):
    """Batch ``number`` comes encoded (``payload``, slot format): larger than ``slot``, or
    built without a slot and given none (``slot`` None)."""
    number: int
    slot: int | None
    payload: np.ndarray
    seconds: float
    cpu_seconds: float


class Failed(NamedTuple):
    """Building batch ``number`` raised ``error``; ``slot`` is unused."""
    number: int
    slot: int | None
    error: ErrorReport


class Ended(NamedTuple):
    """The worker's stream has no batch ``number`` in this pass (``engine.worker.batch.StreamEnded``):
    ``slot`` is unused, and the worker gets no more tasks in the pass."""
    number: int
    slot: int | None


class Skipped(NamedTuple):
    """The worker's skip policy left ``samples`` out of batch ``number`` (why, one each): sent
    just before the batch's own reply."""
    number: int
    samples: list


class Noted(NamedTuple):
    """What the worker noted of its own state after batch ``number`` (its ``pop_state``: a
    front end's, say a dataset's state for a checkpoint), for the front end: sent just before
    the batch's own reply (or its ``Ended``)."""
    number: int
    state: object


class Counted(NamedTuple):
    """What the worker counted since its last batch (``LoaderStats`` field -> increment):
    sent just before a batch's reply."""
    counts: dict


class InitFailed(NamedTuple):
    """Worker ``wid`` could not make its worker object (or its ``worker_init_fn`` raised)."""
    wid: int
    error: ErrorReport


ToWorker = Build | Rebuild | MapRing | Place | TakeWorker | Stop
FromWorker = (Ready | Attached | Built | Done | Overflow | Failed | Ended | Skipped | Noted
              | Counted | InitFailed)


# -- inside the consumer's thread -----------------------------------------------------------------
Completion = Callable[[], None]  # blocks until a copy reading a slot is done (may raise)
Fence = Callable[[], Completion]  # a device's, taken by the ring in the consumer's thread when a
# lease dies: the completion of the copies the consumer may have enqueued from the slot


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
    noted: object = None  # what the worker noted of its state with it (``Noted``), for the front end


class Delivery(NamedTuple):
    """What the converter makes of a reply: a batch ready for the consumer (or the error to
    raise in its place), waiting in ``convert.OrderedOutput`` until the consumer takes it."""
    batch: object          # what the consumer gets
    copy: object = None    # the device's copy still in flight, if any
    slot: int | None = None  # the leased slot the batch is views of; None: no slot's (a copy)
    payload_bytes: int = 0  # size of a payload too large for its slot (overflow), else 0
    nbytes: int = 0         # the batch's array bytes
    error: Callable[[], BaseException] | None = None  # makes the error (see ``Reply``)
    ended: bool = False     # no batch: a worker's stream had ended (a stream's pass skips it)
    skipped: tuple = ()     # what the worker's skip policy left out of it (see ``Reply``)
    noted: object = None    # what its worker noted of its state with it (see ``Reply``)


# -- the user's objects ---------------------------------------------------------------------------
class Worker(Protocol):
    """The user's worker: ``worker[indices]`` returns the batch, or ``fill_batch(indices, out)``
    builds it in its slot. Made once in each worker from what the user gave (a class is
    instantiated there, an instance is used as is: ``worker.batch.make_worker``) and called in that
    worker's thread, one batch at a time. Every hook but one of the first two is optional
    (``Hooks`` fills in the others)."""

    def __getitem__(self, indices: np.ndarray) -> object:
        """The batch of ``indices`` (int64 sample indices, or a sampler's item)."""

    def fill_batch(self, indices: np.ndarray, out: SlotAllocator) -> object:
        """The batch of ``indices``, its arrays taken from ``out`` (a ``layout.SlotAllocator``:
        ``out.empty(shape, dtype)``), straight in the slot. Called instead of ``__getitem__``."""

    def pop_skipped(self) -> list[str]:
        """After each batch: the samples the worker's skip policy left out of it, why, one
        each (counted and warned when the batch is delivered)."""

    def pop_counts(self) -> dict[str, float]:
        """After each batch: what the worker counted since it was last asked (``LoaderStats``
        field -> increment; remote reads, say)."""

    def pop_state(self) -> object:
        """After each batch, and at the end of its stream: what the front end keeps of the
        worker's state with that batch (a dataset's, for a checkpoint); None: nothing."""

    def worker_exit(self) -> None:
        """In a worker process, as it leaves (stopped, or its consumer gone): end what the
        worker runs in the background (threads that would hold the process's exit)."""

    # Read on the worker as the user gave it (a class or an instance), not on the object made:
    dataset: object  # a worker process's torch.utils.data.get_worker_info().dataset

    def pickled_parts(self) -> dict[str, object]:
        """In the consumer, when the worker cannot be pickled for spawn or forkserver: its
        parts, by the name of the argument the user gave each, to name the culprit."""

    def unpicklable(self, what: str, part: object, exc: Exception,
                    start_method: str) -> Exception:
        """The error to raise for ``part`` (the argument ``what``) that cannot be pickled,
        worded for the front end the user called."""


class Hooks:
    """A user's object (a ``Worker``, or a device with ``pop_skipped``) with its optional hooks
    looked up once, here, when it is made, and defaults for those it lacks: nothing else asks
    what the object has. ``obj`` is the object itself."""

    def __init__(self, obj: object) -> None:
        self.obj: Any = obj  # used as the user made it: ``obj[indices]`` for a worker
        self.fill_batch: Callable | None = getattr(obj, "fill_batch", None)
        self.pop_skipped: Callable[[], list[str]] = getattr(obj, "pop_skipped", list)
        self.pop_counts: Callable[[], dict[str, float]] = getattr(obj, "pop_counts", dict)
        self.pop_state: Callable[[], object] = getattr(obj, "pop_state", _nothing)
        self.worker_exit: Callable[[], object] = getattr(obj, "worker_exit", _nothing)
        self.dataset: object = getattr(obj, "dataset", None)
        self.pickled_parts: Callable[[], dict[str, object]] = getattr(obj, "pickled_parts", dict)
        self.unpicklable: Callable[..., Exception] | None = getattr(obj, "unpicklable", None)


def _nothing() -> None:
    """A worker without ``pop_state`` notes nothing; one without ``worker_exit`` has nothing to
    end."""


class Plan(Protocol):
    """Which sample indices form each batch, epoch after epoch (plan.py: ``EpochPlan``,
    ``SamplerPlan``). The consumer's thread calls it as it dispatches (``plan.BatchStream``)
    and takes batches (pipeline.py); the front end (sequence.py), in the user's thread, reads
    and sets what a state or ``len()`` needs, between iterations or as one starts."""

    version: int             # changes whenever batches planned before may have changed
    rank: int                # this process's share of every epoch, out of
    world_size: int

    # Read only through a Plan (a plan of shmseq's own has them, a user's sampler has None):
    @property
    def batch_size(self) -> int | None:
        """Samples per batch; None: a user's sampler decides."""

    @property
    def seed(self) -> int | None:
        """The shuffle's seed; None: a user's sampler has its own."""

    @property
    def last_batch(self) -> str | None:
        """'keep', 'discard' or 'rollover'; None: a user's sampler decides."""

    def batch(self, epoch: int, position: int) -> object | None:
        """Batch ``position`` of ``epoch`` (its sample indices); None past the epoch's last."""

    def length(self, epoch: int) -> int:
        """The batches of ``epoch``."""

    def open(self, epoch: int, batches: Iterable | None = None) -> None:
        """The consumer starts ``epoch`` (drawn from ``batches``, a sampler's iterator, when
        given): before any of its batches is asked for."""

    def is_open(self, epoch: int) -> bool:
        """Whether the dispatcher may take batches of ``epoch`` now (ahead of the consumer)."""

    def release(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position``."""

    def end(self, epoch: int, position: int) -> None:
        """The pass of ``epoch`` ends before ``position``: every worker's stream ended there."""

    def has_batches(self) -> bool:
        """Whether an epoch has any batch at all (the dispatcher stops otherwise)."""

    def set_epoch(self, epoch: int) -> None:
        """The front end's ``set_epoch``, passed on to a user's sampler."""

    def refresh(self) -> None:
        """Read again what may change between epochs (torch.distributed's ranks)."""

    def settle_seed(self, seed: int) -> None:
        """Shuffle with ``seed`` from now on (a restored state's)."""

    def carried(self, epoch: int) -> list[int]:
        """The samples ``epoch`` inherits from the ones before it (``last_batch='rollover'``),
        for a resumable state."""
