"""The body of a worker (process or thread): its set-up, its inbox, its loop.

``worker_loop`` takes a ``Build(number, slot, indices)`` from its task pipe and has it built
and written (batch.py), then replies on its result pipe; it maps the ring when told
(``MapRing``), places a held first batch when given its slot (``Place``), and leaves on
``Stop`` or when the consumer closes the pipes. The consumer's side of the pipes is
``trainer/pool.py``.
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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..common.board import BoardSpec, WorkerCell
from ..common.hooks import WorkerStart
from ..common.lifeline import Lifeline, ProcessId
from ..common.protocol import (Attached, Build, Built, Hooks, InitFailed, MapRing, Place, Ready,
                               Rebuild, Stop, TakeWorker)
from ..common.segments import WorkerRing, drop_inherited_rings
from ..common.wire import FrameReader, Message, decode, encode, framed, write_all
from .batch import (Clocks, Held, Mapped, MemoryMeter, Slots, Unmapped, counted_frame,
                    describe_exception, make_worker, place, run_task)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_BYTES = 256 << 20
STOP_CHECK_SECONDS = 0.005  # how stale a worker's last look for a stop request may be


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


def keep_large_buffers() -> None:
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


def _set_up(info: WorkerInfo, in_process: bool, start: WorkerStart, dataset: object) -> None:
    """Seed the worker's random generators as torch's DataLoader seeds its workers, run torch's
    operators on one thread, then run the front end's hook and the user's (``start``).

    Only processes seed the global generators (``random``, numpy's, torch's) and set torch's
    threads: threads share them, and read their own seed from ``get_worker_info()`` instead.
    One intra-op thread per worker, as torch's: a forked worker that kept the trainer's pool
    would deadlock in it once the trainer had run a multi-threaded operator, and every worker
    would compete with the others for every core.
    """
    _current.info = info
    if in_process:
        keep_large_buffers()
        random.seed(info.seed)
        np.random.seed(_numpy_seed(info))
        torch = sys.modules.get("torch")
        if torch is None:
            os.environ["OMP_NUM_THREADS"] = "1"  # read by torch when the worker's code imports it
        else:
            torch.set_num_threads(1)
            torch.manual_seed(info.seed)
    start.run(info, info.id, in_process, dataset)


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
    many tasks as came), and counts the time (``pop_idle``: the loader's sign of a ring
    full). With tasks queued it looks at the pipe again only once its last look
    is ``STOP_CHECK_SECONDS`` old: quick tasks drain within milliseconds anyway, and a look
    before each would cost two system calls a batch."""

    def __init__(self, tasks: Connection) -> None:
        self._reader = FrameReader(tasks.fileno(), blocking=True)
        self._queued: collections.deque[Message] = collections.deque()
        self._again: collections.deque[Build] = collections.deque()  # ahead of _queued's
        self._stopped = False
        self._readable = select.poll()
        self._readable.register(tasks.fileno(), select.POLLIN)
        self._looked = time.monotonic()
        self._idle = 0.0  # seconds waited with nothing queued, since ``pop_idle``

    def next(self) -> Message | None:
        """The next message; None when asked to stop. Raises EOFError once the pipe closed."""
        if not (self._queued or self._again or self._stopped):
            waited = time.monotonic()
            while not (self._queued or self._again or self._stopped):
                self._queue(self._reader.read())
            self._looked = time.monotonic()
            self._idle += self._looked - waited
        elif time.monotonic() - self._looked >= STOP_CHECK_SECONDS:
            if self._readable.poll(0):
                self._queue(self._reader.read())
            self._looked = time.monotonic()
        if self._stopped:
            return None
        if self._again and not (self._queued and type(self._queued[0]) is not Build):
            return self._again.popleft()
        return self._queued.popleft()

    def pop_idle(self) -> float:
        """Seconds waited with nothing queued since the last call."""
        idle, self._idle = self._idle, 0.0
        return idle

    def next_answer(self) -> Message | None:
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

    def _queue(self, messages: list[Message]) -> None:
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


def _received_worker(tasks: Connection) -> object:
    """The worker, sent pickled as the first message of the task pipe by a consumer that spawned
    this process. Not among the process's arguments: multiprocessing writes those into a pipe
    whose read end the consumer holds until the write ends, so a child that dies before it has
    read a large worker (a main module that fails to import, say) would hold the consumer in
    ``Process.start()`` forever."""
    message = decode(tasks.recv_bytes())
    assert isinstance(message, TakeWorker), message
    return pickle.loads(message.pickled)


def worker_loop(worker: object, tasks: Connection, results: Connection, info: WorkerInfo,
                start: WorkerStart, ties: ProcessTies | None) -> None:
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
        _set_up(info, ties is not None, start, Hooks(worker).dataset)
        worker_obj = make_worker(worker)
    except BaseException as exc:  # noqa: BLE001
        results.send_bytes(encode(InitFailed(info.id, describe_exception(exc))))
        return
    slots: Slots = Unmapped()
    held: Held | None = None
    cell = WorkerCell(ties.board, info.id) if ties is not None and ties.board is not None else None
    inbox, replies, first = _Inbox(tasks), results.fileno(), True
    cpu_clock = time.process_time if ties is not None else time.thread_time
    meter = MemoryMeter() if ties is not None else None  # a thread's memory is the trainer's
    try:
        write_all(replies, framed(Ready(info.id)))
        while (message := inbox.next() if held is None else inbox.next_answer()) is not None:
            match message:
                case Build(number, slot, indices):
                    if cell is not None:
                        cell.begin(number)
                    clocks = Clocks.start(cpu_clock, inbox.pop_idle())
                    reply = run_task(worker_obj, slots, number, slot, indices, first, clocks)
                    first = False
                    if isinstance(reply, Held):
                        held, reply = reply, framed(Built(number, reply.size))
                    write_all(replies, counted_frame(worker_obj, meter) + reply)  # counted, then delivered
                case MapRing(spec):
                    slots = Mapped(WorkerRing(spec))
                    write_all(replies, framed(Attached(info.id)))
                case Place(_, slot):
                    assert held is not None  # a Place answers a Built
                    write_all(replies, place(held, slots, slot, cpu_clock))
                    held = None
    except (EOFError, OSError):
        return  # the consumer closed the pipes: it is shutting down, or gone
    finally:
        slots.close()
        if cell is not None:
            cell.close()
        if ties is not None:  # a thread's worker is the consumer's to end
            worker_obj.worker_exit()
