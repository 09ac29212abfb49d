"""Inside a worker: one batch built by the user's worker and written into its slot.

``run_task`` calls ``worker_obj[indices]`` (or ``worker_obj.fill_batch(indices, out)`` for
in-place workers), writes the batch into the slot (``layout.write_batch``) and makes the reply
``Done(number, slot, size, seconds, cpu_seconds, idle_seconds)``: only ids travel, never the
payload. The CPU time is read from the clock the worker is given (``cpu_clock``:
``time.process_time`` in a process, ``time.thread_time`` in a thread), for the loader's
statistics and its tuner, as is the time the worker waited for the task (loop.py's). A batch too large
for its slot goes back encoded instead (``Overflow``); a failure goes back as its type,
message and traceback (``Failed``). The messages are protocol.py's.

A task without a slot (the first batches, which size the ring) is built and held (``Held``)
until the consumer answers with a slot: ``place`` then writes it there as any batch, so that
the first batch crosses no pipe and the consumer copies nothing; with no slot for it (larger
than a slot, or none free), it goes back encoded.
"""
from __future__ import annotations

import pickle
import time
import traceback
from typing import Any, Callable, Iterator, NamedTuple, Sized

import numpy as np

from ..common.errors import ShmSeqError, UnsupportedBatch, add_note
from ..common.layout import SlotAllocator, SlotOverflow, encode_batch, packed_size, write_batch
from ..common.protocol import (Counted, Ended, ErrorReport, Failed, Hooks, Noted, Overflow,
                               Skipped)
from ..common.ragged import Ragged, is_tensor
from ..common.segments import WorkerRing
from ..common.wire import done_frame, framed


def make_worker(worker: object) -> Hooks:
    """The worker object, with its hooks (``protocol.Hooks``). MDNC's convention: a class is
    instantiated in each worker, an instance is used as is."""
    return Hooks(worker() if isinstance(worker, type) else worker)


def build_batch(worker: Hooks, indices: Any, region: np.ndarray | None,
                first: bool = False) -> tuple[object, SlotAllocator | None]:
    """Call the user's worker; in-place workers get an allocator over the slot. A worker's
    ``__getitem__`` that returns None most likely forgot its ``return``: that is refused, and
    so is a ``first`` batch that looks like one sample (``check_rows``)."""
    if worker.fill_batch is not None:
        allocator = SlotAllocator(region)
        return worker.fill_batch(indices, allocator), allocator
    batch = _got(worker.obj, indices, first)
    if batch is None:
        raise UnsupportedBatch("the worker returned None for a batch: return an array, "
                               "or a tuple/list/dict of arrays")
    if first:
        check_rows(batch, indices)
    return batch, None


# what code written for one index raises when given an array of them: int(array), list[array],
# a dict keyed by the array, a format spec
_INDEX_ERRORS = (TypeError, ValueError, IndexError, KeyError)


def _got(obj: Any, indices: Any, first: bool) -> object:
    """``obj[indices]``. Where the worker's first batch fails the way a dataset of samples
    fails on an index array, the exception (its traceback kept) says what the worker was given
    and where such a dataset goes: numpy's and torch's words alone ("only length-1 arrays can
    be converted to Python scalars") do not say that ``indices`` was an array."""
    try:
        return obj[indices]
    except _INDEX_ERRORS as exc:
        if first and isinstance(indices, np.ndarray):
            add_note(exc, index_array_note(indices))
        raise


def index_array_note(indices: np.ndarray) -> str:
    """What a dataset of samples given a batch's index array is told."""
    return (f"shmseq: worker[indices] was given a {indices.ndim}-D {indices.dtype} array of "
            f"{len(indices)} sample indices, not one index: a dataset whose __getitem__ takes "
            "one index goes to shmseq.torch.DataLoader or shmseq.DataLoader, which fetch the "
            "samples one by one and stack them into a batch")


class _Rows(NamedTuple):
    """A part of a batch that has rows: an array's or tensor's first dimension (with its
    ``shape`` and ``nbytes``), or a list's or ragged leaf's items (``shape`` None)."""
    rows: int
    shape: tuple | None = None
    nbytes: int = 0


def check_rows(batch: object, indices: Sized) -> None:
    """Refuse a first batch that looks like one sample: the worker was written for one sample
    (a torch ``Dataset``'s ``dataset[i]``), and given the index array it returned one sample,
    which would travel as a batch of the wrong size, silently.

    A row per index: an array's (or tensor's) first dimension, a list's or a ragged leaf's
    items. Refused: a batch in which nothing has a row per index, and one that looks like a
    sample beside arrays computed from the indices (``_one_sample_beside``). Other arrays may
    have other lengths (a worker id, a lookup table); a batch without an array is not judged.
    Workers that build in place (``fill_batch``: the sample-level loaders, with collate
    functions of their own) are not asked."""
    found = list(_rows(batch))
    arrays = [part for part in found if part.shape is not None]
    if not arrays:
        return
    count = len(indices)
    if not any(part.rows == count for part in found):
        raise UnsupportedBatch(_one_sample(arrays, count, "none with a row per index"))
    largest = max(arrays, key=lambda part: part.nbytes)
    if _one_sample_beside(largest, found, count):
        raise UnsupportedBatch(_one_sample(
            arrays, count, f"of which the largest, {largest.shape}, has no row per index and "
            "only 1-D arrays have one (labels computed from the indices, say)"))


def _one_sample_beside(largest: _Rows, found: list[_Rows], count: int) -> bool:
    """Whether the ``largest`` array is shaped like one sample, an image, beside arrays of a row
    per index that are all 1-D (``indices % 10``, ``labels[indices]``): it has three or more
    dimensions, fewer rows than ``count`` and no dimension of ``count``. Not refused: a
    time-major batch or stacked views (``count`` is a later dimension), packed rows, a graph's
    nodes (more rows than samples), a graph's 2-D edges, and a batch with a list, a ragged
    leaf or an array of two or more dimensions of a row per index (a batch's, all of them)."""
    shape = largest.shape
    assert shape is not None, "an array's"
    return len(shape) >= 3 and shape[0] < count and count not in shape and all(
        part.shape is not None and len(part.shape) == 1 for part in found if part.rows == count)


def _one_sample(arrays: list[_Rows], count: int, what: str) -> str:
    """Why a batch was refused as one sample (``what``), and where a dataset of samples goes."""
    return (f"the worker returned arrays of shapes {', '.join(str(a.shape) for a in arrays)} "
            f"for the {count} sample indices of a batch, {what}: ShmSequence calls "
            "worker[indices] with a 1-D array of sample indices and takes what it returns as "
            "the batch. A dataset whose __getitem__ returns one sample for one index (a torch "
            "Dataset) goes to a sample-level loader, which fetches the samples one by one and "
            "stacks them in the slot: shmseq.DataLoader(dataset, batch_size=...) for numpy "
            "arrays, shmseq.torch.DataLoader (torch's DataLoader) for torch tensors")


def _rows(batch: object) -> Iterator[_Rows]:
    """The rows of each array and tensor of a batch (not of a 0-d one), of each list and
    ragged leaf (a ``Ragged``, a nested tensor)."""
    if isinstance(batch, Ragged):
        yield _Rows(len(batch))
    elif is_tensor(batch) and batch.is_nested:
        yield _Rows(batch.size(0))  # its shape is not defined
    elif isinstance(batch, np.ndarray):
        if batch.ndim:
            yield _Rows(batch.shape[0], batch.shape, batch.nbytes)
    elif is_tensor(batch):
        if batch.ndim:
            yield _Rows(batch.shape[0], tuple(batch.shape), batch.numel() * batch.element_size())
    elif isinstance(batch, (tuple, list, dict)):
        if isinstance(batch, list):
            yield _Rows(len(batch))
        for item in batch.values() if isinstance(batch, dict) else batch:
            yield from _rows(item)


MEMORY_EVERY_S = 10.0  # a worker process measures the memory it holds alone this often at most,
MEMORY_COST = 0.01     # and less often where measuring takes more than this share of the time


def private_bytes() -> int | None:
    """The memory this process alone holds (Linux's ``Private_*`` of its mappings: what its own
    allocations took, not the pages it still shares with the trainer, nor the ring); None where
    the system does not say. The kernel walks the page tables: about 5 ms per 200 MB resident."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            return sum(int(line.split()[1]) << 10 for line in rollup
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except (OSError, ValueError, IndexError):
        return None


class MemoryMeter:
    """A worker process's ``worker_private_bytes``, measured after its first batch, then every
    ``MEMORY_EVERY_S``, or less often where a measure costs more than ``MEMORY_COST`` of that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due = -float("inf")

    def counts(self) -> dict[str, float]:
        now = self._clock()
        if now < self._due:
            return {}
        measured = private_bytes()
        self._due = now + max(MEMORY_EVERY_S, (self._clock() - now) / MEMORY_COST)
        return {} if measured is None else {"worker_private_bytes": measured}


def counted_frame(worker: Hooks, meter: MemoryMeter | None) -> bytes:
    """The worker's counts since its last batch (its ``pop_counts``, the ``meter``'s)."""
    counts = worker.pop_counts() if meter is None else {**worker.pop_counts(), **meter.counts()}
    return framed(Counted(counts)) if counts else b""


def noted_frame(worker: Hooks, number: int) -> bytes:
    """What the worker notes of its state with batch ``number`` (its ``pop_state``), if any."""
    state = worker.pop_state()
    return b"" if state is None else framed(Noted(number, state))


def describe_exception(exc: BaseException) -> ErrorReport:
    """What crosses back to the consumer about a failure: type, message, traceback, the object."""
    try:
        pickled = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text below still tells the story
        pickled = None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorReport(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text, pickled)


class StreamEnded(Exception):
    """Raised by a worker object whose stream (a torch ``IterableDataset``'s copy in this
    worker) has no batch left in this pass: the consumer skips the task and gives this worker
    no more in the pass."""


class Held(NamedTuple):
    """A batch built for a task without a slot, held until the consumer gives it one."""
    number: int
    batch: object
    size: int        # bytes it takes in a slot
    told: bytes      # the ``Skipped`` and ``Noted`` frames that go with its reply, if any
    seconds: float   # how long building it took,
    cpu_seconds: float  # and on a CPU


CpuClock = Callable[[], float]  # seconds of CPU the worker used so far


class Clocks(NamedTuple):
    """When a task began, by the wall clock and the worker's CPU clock, and how long the
    worker had waited for it."""
    began: float
    cpu_began: float
    cpu_clock: CpuClock
    idle_s: float = 0.0

    @classmethod
    def start(cls, cpu_clock: CpuClock, idle_s: float = 0.0) -> "Clocks":
        return cls(time.perf_counter(), cpu_clock(), cpu_clock, idle_s)

    def spent(self) -> tuple[float, float]:
        """Seconds since the task began, and CPU seconds."""
        return time.perf_counter() - self.began, self.cpu_clock() - self.cpu_began


def run_task(worker: Hooks, slots: Slots, number: int, slot: int | None,
              indices: object, first: bool, clocks: Clocks) -> bytes | Held:
    """Build and write one batch (``first``: the worker's first), timed from ``clocks``; the
    framed reply, with its size and the time it took. Without a slot, the batch built, to be
    held (``place``)."""
    try:
        target = slots.target(slot)  # may find /dev/shm full
        batch, allocator = build_batch(worker, indices, None if target is None else target.region,
                                       first)
        skipped = worker.pop_skipped()
        told = (framed(Skipped(number, skipped)) if skipped else b"") + noted_frame(worker, number)
        if target is None:
            return Held(number, batch, packed_size(batch), told, *clocks.spent())
        return _written(number, target, batch, allocator, told, clocks)
    except StreamEnded:
        return noted_frame(worker, number) + framed(Ended(number, slot))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        return _failed(number, slot, exc)


def place(held: Held, slots: Slots, slot: int | None, cpu_clock: CpuClock) -> bytes:
    """The reply for a held batch, given ``slot`` (None: it goes back encoded)."""
    clocks = Clocks(time.perf_counter() - held.seconds, cpu_clock() - held.cpu_seconds,
                    cpu_clock)
    try:
        return _written(held.number, slots.target(slot), held.batch, None, held.told, clocks)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        return _failed(held.number, slot, exc)


class Target(NamedTuple):
    """Where a batch is written: ``slot`` of the worker's ``ring``, and ``region``, the part of
    it batches are expected to take (see ``segments.RingSpec.expected``)."""
    ring: WorkerRing
    slot: int
    region: np.ndarray

    def write(self, batch: object, allocator: SlotAllocator | None) -> int:
        """Write the batch into ``region``, or into the whole slot if it is larger."""
        try:
            return write_batch(batch, self.region, allocator)
        except SlotOverflow as overflow:
            slot_bytes = self.ring.spec.slot_bytes
            if len(self.region) == slot_bytes or overflow.needed > slot_bytes:
                raise
        return write_batch(batch, self.ring.whole(self.slot), allocator)


class Unmapped:
    """A worker's slots before the consumer's ``MapRing``: none (a task without a slot is held,
    or goes back encoded; a slot given now breaks the protocol)."""

    def target(self, slot: int | None) -> Target | None:
        if slot is not None:
            raise ShmSeqError(f"slot {slot} was given before the ring")
        return None

    def close(self) -> None:
        """Nothing mapped."""


class Mapped:
    """A worker's slots once it mapped the ring (``MapRing``)."""

    def __init__(self, ring: WorkerRing) -> None:
        self.ring = ring

    def target(self, slot: int | None) -> Target | None:
        """Where a task's batch is written; None without a slot."""
        return None if slot is None else Target(self.ring, slot, self.ring.region(slot))

    def close(self) -> None:
        self.ring.close()


Slots = Unmapped | Mapped  # loop.py holds one: Unmapped until the consumer's MapRing


def _written(number: int, target: Target | None, batch: object,
             allocator: SlotAllocator | None, told: bytes, clocks: Clocks) -> bytes:
    """The batch written into its slot (``Done``), or encoded where it has none or does not
    fit (``Overflow``)."""
    if target is not None:
        try:
            size = target.write(batch, allocator)
            return told + done_frame(number, target.slot, size, *clocks.spent(), clocks.idle_s)
        except SlotOverflow:
            pass
    payload = encode_batch(batch)
    return told + framed(Overflow(number, None if target is None else target.slot, payload,
                                  *clocks.spent()))


def _failed(number: int, slot: int | None, exc: BaseException) -> bytes:
    return framed(Failed(number, slot, describe_exception(exc)))
