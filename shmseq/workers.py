"""Inside a worker (process or thread): where a batch is written.

``worker_loop`` takes a ``Build(number, slot, indices)`` from its task pipe, calls
``worker_obj[indices]`` (or ``worker_obj.fill_batch(indices, out)`` for in-place
workers), writes the batch into the slot (``layout.write_batch``) and replies
``Done(number, slot, size, seconds)``: only ids travel, never the payload. A batch
too large for its slot goes back encoded instead (``Overflow``); a failure goes back as its
type, message and traceback (``Failed``). The messages are protocol.py's; the consumer's side
of the pipes is ``pool.py``.

A task without a slot (the first batches, which size the ring) is built, its size told
(``Built``), and held until the consumer answers ``Place(number, slot)``: the worker then
writes it into that slot as any batch, so that the first batch crosses no pipe and the
consumer copies nothing; with no slot for it (larger than a slot, or none free), it goes
back encoded.
"""
from __future__ import annotations

import collections
import ctypes
import os
import pickle
import random
import select
import sys
import threading
import time
import traceback
from typing import NamedTuple

import numpy as np

from .board import BoardSpec, WorkerCell
from .errors import UnsupportedBatch
from .layout import SlotAllocator, SlotOverflow, encode_batch, packed_size, write_batch
from .lifeline import Lifeline, ProcessId
from .protocol import (Attached, Build, Built, Counted, Ended, ErrorReport, Failed, Hooks,
                       InitFailed, MapRing, Overflow, Place, Ready, Rebuild, Skipped, Stop,
                       ToWorker)
from .ragged import Ragged, is_tensor
from .segments import WorkerRing, drop_inherited_rings
from .wire import FrameReader, decode, done_frame, encode, framed, write_all

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_BYTES = 256 << 20
STOP_CHECK_SECONDS = 0.005  # how stale a worker's last look for a stop request may be


def make_worker(worker) -> Hooks:
    """The worker object, with its hooks (``protocol.Hooks``). MDNC's convention: a class is
    instantiated in each worker, an instance is used as is."""
    return Hooks(worker() if isinstance(worker, type) else worker)


def build_batch(worker: Hooks, indices: np.ndarray, region: np.ndarray | None,
                first: bool = False):
    """Call the user's worker; in-place workers get an allocator over the slot. A worker's
    ``__getitem__`` that returns None most likely forgot its ``return``: that is refused, and
    so is a ``first`` batch without a row per index (``check_rows``)."""
    if worker.fill_batch is not None:
        allocator = SlotAllocator(region)
        return worker.fill_batch(indices, allocator), allocator
    batch = worker.obj[indices]
    if batch is None:
        raise UnsupportedBatch("the worker returned None for a batch: return an array, "
                               "or a tuple/list/dict of arrays")
    if first:
        check_rows(batch, indices)
    return batch, None


def check_rows(batch, indices: np.ndarray) -> None:
    """Refuse a batch in which nothing has a row per index: the worker was written for one
    sample (a torch ``Dataset``'s ``dataset[i]``), and given the index array it returned one
    sample, which would travel as a batch of the wrong size, silently.

    A row per index: an array's (or tensor's) first dimension, a list's or a ragged leaf's
    items. Other arrays may have other lengths (a worker id, a lookup table); a batch without
    an array is not judged. Workers that build in place (``fill_batch``: the sample-level
    loaders, with collate functions of their own) are not asked."""
    found = list(_rows(batch))
    shapes = [shape for _, shape in found if shape is not None]
    if not shapes or any(rows == len(indices) for rows, _ in found):
        return
    raise UnsupportedBatch(
        f"the worker returned arrays of shapes {', '.join(map(str, shapes))} for the "
        f"{len(indices)} sample indices of a batch, none with a row per index: ShmSequence "
        "calls worker[indices] with a 1-D array of sample indices and takes what it returns "
        "as the batch. A dataset whose __getitem__ returns one sample for one index (a torch "
        "Dataset) goes to a sample-level loader, which fetches the samples one by one and "
        "stacks them in the slot: shmseq.DataLoader(dataset, batch_size=...) for numpy "
        "arrays, shmseq.torch.DataLoader (torch's DataLoader) for torch tensors")


def _rows(batch):
    """(rows, shape) of each array and tensor of a batch (not of a 0-d one); (items, None) of
    each list and ragged leaf (a ``Ragged``, a nested tensor)."""
    if isinstance(batch, Ragged):
        yield len(batch), None
    elif is_tensor(batch) and batch.is_nested:
        yield batch.size(0), None  # its shape is not defined
    elif isinstance(batch, np.ndarray) or is_tensor(batch):
        if batch.ndim:
            yield batch.shape[0], tuple(batch.shape)
    elif isinstance(batch, (tuple, list, dict)):
        if isinstance(batch, list):
            yield len(batch), None
        for item in batch.values() if isinstance(batch, dict) else batch:
            yield from _rows(item)


def _counted_frame(worker: Hooks) -> bytes:
    counts = worker.pop_counts()
    return framed(Counted(counts)) if counts else b""


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
    told: bytes      # the ``Skipped`` frame that goes with its reply, if any
    seconds: float   # how long building it took


def _run_task(worker: Hooks, ring: WorkerRing | None, number: int, slot: int | None,
              indices: np.ndarray, first: bool) -> bytes | Held:
    """Build and write one batch (``first``: the worker's first); the framed reply, with its
    size and the time it took. Without a slot, the batch built, to be held (``place``)."""
    began = time.perf_counter()
    try:
        region = ring.region(slot) if slot is not None else None  # may find /dev/shm full
        batch, allocator = build_batch(worker, indices, region, first)
        skipped = worker.pop_skipped()
        told = framed(Skipped(number, skipped)) if skipped else b""
        if slot is None:
            return Held(number, batch, packed_size(batch), told, time.perf_counter() - began)
        return _written(number, ring, slot, region, batch, allocator, told, began)
    except StreamEnded:
        return framed(Ended(number, slot))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        return _failed(number, slot, exc)


def place(held: Held, ring: WorkerRing | None, slot: int | None) -> bytes:
    """The reply for a held batch, given ``slot`` (None: it goes back encoded)."""
    began = time.perf_counter() - held.seconds
    try:
        region = ring.region(slot) if slot is not None else None
        return _written(held.number, ring, slot, region, held.batch, None, held.told, began)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        return _failed(held.number, slot, exc)


def _written(number: int, ring: WorkerRing | None, slot: int | None, region: np.ndarray | None,
             batch, allocator: SlotAllocator | None, told: bytes, began: float) -> bytes:
    """The batch written into its slot (``Done``), or encoded where it has none or does not
    fit (``Overflow``)."""
    if region is not None:
        try:
            size = _write(batch, ring, slot, region, allocator)
            return told + done_frame(number, slot, size, time.perf_counter() - began)
        except SlotOverflow:
            pass
    payload = encode_batch(batch)
    return told + framed(Overflow(number, slot, payload, time.perf_counter() - began))


def _write(batch, ring: WorkerRing, slot: int, region: np.ndarray,
           allocator: SlotAllocator | None) -> int:
    """Write the batch into ``region``, the part of its slot batches are expected to take, or
    into the whole slot if it is larger (see ``segments.RingSpec.expected``)."""
    try:
        return write_batch(batch, region, allocator)
    except SlotOverflow as overflow:
        if len(region) == ring.spec.slot_bytes or overflow.needed > ring.spec.slot_bytes:
            raise
    return write_batch(batch, ring.whole(slot), allocator)


def _failed(number: int, slot: int | None, exc: BaseException) -> bytes:
    return framed(Failed(number, slot, describe_exception(exc)))


class WorkerInfo(NamedTuple):
    """What ``get_worker_info()`` tells the code running inside a worker. ``seed`` is the
    pipeline's base seed plus ``id``, as torch's DataLoader seeds its workers."""
    id: int
    num_workers: int
    seed: int


_current = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """The calling worker's id, the number of workers and its seed; None outside workers."""
    return getattr(_current, "info", None)


def _keep_large_buffers() -> None:
    """Let glibc reuse freed batch-sized buffers instead of mapping fresh pages for each.

    Above its mmap threshold (32 MiB at most by default) glibc maps every allocation
    anew, and a worker returning a fresh 38 MB array per batch page-faults all of it
    each time (about half its work, measured). Without glibc, nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)


def _set_up(info: WorkerInfo, in_process: bool, worker_init_fn, dataset) -> None:
    """Seed the worker's random generators as torch's DataLoader seeds its workers, run torch's
    operators on one thread, then run the user's hook.

    Only processes seed the global generators (``random``, numpy's, torch's), set torch's
    threads and answer ``torch.utils.data.get_worker_info()`` (for datasets written for
    torch): threads share them, and read their own seed from ``get_worker_info()`` instead.
    One intra-op thread per worker, as torch's: a forked worker that kept the trainer's pool
    would deadlock in it once the trainer had run a multi-threaded operator, and every worker
    would compete with the others for every core.
    """
    _current.info = info
    if in_process:
        _keep_large_buffers()
        random.seed(info.seed)
        np.random.seed(_numpy_seed(info))
        torch = sys.modules.get("torch")
        if torch is None:
            os.environ["OMP_NUM_THREADS"] = "1"  # read by torch when the worker's code imports it
        else:
            torch.set_num_threads(1)
            torch.manual_seed(info.seed)
            _tell_torch(torch, info, dataset)
    if worker_init_fn is not None:
        worker_init_fn(info.id)


def _numpy_seed(info: WorkerInfo) -> np.ndarray:
    """The global numpy generator's seed in a worker: the state numpy's ``SeedSequence`` makes
    of the worker id and the base seed, which is what torch's DataLoader seeds it with."""
    return np.random.SeedSequence([info.id, info.seed - info.id]).generate_state(4)


class ProcessTies(NamedTuple):
    """What a worker process needs to follow its consumer (see lifeline.py), and to say which
    batch it is building (board.py; when it may be replaced)."""
    consumer: ProcessId
    inherited_fds: tuple[int, ...] | None  # forked: the consumer's pipe ends, to close
    board: BoardSpec | None = None


class _Inbox:
    """The task pipe, read ahead: a ``Stop`` overtakes the tasks queued before it, so that a
    worker asked to stop leaves after the batch in hand; a dead worker's batches given again
    (``Rebuild``) overtake the tasks, and those of an earlier death, but not the messages
    before them (the ring): the consumer waits for them, and the one suspected of the death,
    sent first, is built at once, not when a random kill may land on it again (see
    ``pool.WorkerPool._restart``).

    With nothing queued the worker sleeps in the read itself (one system call a wake-up, as
    many tasks as came). With tasks queued it looks at the pipe again only once its last look
    is ``STOP_CHECK_SECONDS`` old: quick tasks drain within milliseconds anyway, and a look
    before each would cost two system calls a batch."""

    def __init__(self, tasks):
        self._reader = FrameReader(tasks.fileno(), blocking=True)
        self._queued: collections.deque = collections.deque()
        self._again: collections.deque = collections.deque()  # Builds, ahead of _queued's
        self._stopped = False
        self._readable = select.poll()
        self._readable.register(tasks.fileno(), select.POLLIN)
        self._looked = time.monotonic()

    def next(self) -> ToWorker | None:
        """The next message; None when asked to stop. Raises EOFError once the pipe closed."""
        if not (self._queued or self._again or self._stopped):
            while not (self._queued or self._again or self._stopped):
                self._queue(self._reader.read())
            self._looked = time.monotonic()
        elif time.monotonic() - self._looked >= STOP_CHECK_SECONDS:
            if self._readable.poll(0):
                self._queue(self._reader.read())
            self._looked = time.monotonic()
        if self._stopped:
            return None
        if self._again and not (self._queued and type(self._queued[0]) is not Build):
            return self._again.popleft()
        return self._queued.popleft()

    def next_answer(self) -> ToWorker | None:
        """The next message that is not a ``Build`` (the ring, a held batch's ``Place``), the
        tasks left queued: a worker holding a batch builds no other, which could reuse its
        buffers. None when asked to stop. Raises EOFError once the pipe closed."""
        while not self._stopped:
            answer = next((message for message in self._queued if type(message) is not Build),
                          None)
            if answer is not None:
                self._queued.remove(answer)
                return answer
            self._queue(self._reader.read())
        return None

    def _queue(self, messages: list[ToWorker]) -> None:
        """The latest batches given again go first: they begin with the latest suspect."""
        again = []
        for message in messages:
            match message:
                case Rebuild():
                    again.append(Build(*message))
                case Stop():
                    self._stopped = True
                case _:
                    self._queued.append(message)
        self._again.extendleft(reversed(again))


def _tell_torch(torch, info: WorkerInfo, dataset) -> None:
    """What ``torch.utils.data.get_worker_info()`` reads in its own workers."""
    from torch.utils.data._utils import worker as torch_worker
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=dataset)


def _received_worker(tasks):
    """The worker, sent pickled as the first message of the task pipe by a consumer that spawned
    this process. Not among the process's arguments: multiprocessing writes those into a pipe
    whose read end the consumer holds until the write ends, so a child that dies before it has
    read a large worker (a main module that fails to import, say) would hold the consumer in
    ``Process.start()`` forever."""
    return pickle.loads(decode(tasks.recv_bytes()).pickled)


def worker_loop(worker, tasks, results, info: WorkerInfo, worker_init_fn,
                ties: ProcessTies | None) -> None:
    """The body of a worker, process or thread (``ties`` is set in processes)."""
    if ties is not None:
        Lifeline(ties.consumer)
        if ties.inherited_fds is not None:
            for fd in ties.inherited_fds:
                os.close(fd)
            drop_inherited_rings()  # other sequences' rings: this worker maps its own only
    try:
        if worker is None:
            worker = _received_worker(tasks)
        _set_up(info, ties is not None, worker_init_fn, Hooks(worker).dataset)
        worker_obj = make_worker(worker)
    except BaseException as exc:  # noqa: BLE001
        results.send_bytes(encode(InitFailed(info.id, describe_exception(exc))))
        return
    ring = held = None
    cell = WorkerCell(ties.board, info.id) if ties is not None and ties.board is not None else None
    inbox, replies, first = _Inbox(tasks), results.fileno(), True
    try:
        write_all(replies, framed(Ready(info.id)))
        while (message := inbox.next() if held is None else inbox.next_answer()) is not None:
            match message:
                case Build(number, slot, indices):
                    if cell is not None:
                        cell.begin(number)
                    reply = _run_task(worker_obj, ring, number, slot, indices, first)
                    first = False
                    if isinstance(reply, Held):
                        held, reply = reply, framed(Built(number, reply.size))
                    write_all(replies, _counted_frame(worker_obj) + reply)  # counted, then delivered
                case MapRing(spec):
                    ring = WorkerRing(spec)
                    write_all(replies, framed(Attached(info.id)))
                case Place(_, slot):
                    write_all(replies, place(held, ring, slot))
                    held = None
    except (EOFError, OSError):
        return  # the consumer closed the pipes: it is shutting down, or gone
    finally:
        for mapping in (ring, cell):
            if mapping is not None:
                mapping.close()
