"""The pool's workers: who they are, how each starts, is sent messages, leaves and is stopped.

The workers taking tasks are ``working``, by id (a replacement in its dead predecessor's
place); those told to leave (``let_leave``) are ``leaving`` until they have gone. Each
worker's own life is its ``WorkerHandle.state`` (worker_handle.py). The replies each sends,
and its exit, are watched on the pool's ``Events``: what they mean is the pool's business.
"""
from __future__ import annotations

import enum
import os
import time
from multiprocessing.context import BaseContext

from ..common.board import Board
from ..common.hooks import WorkerStart
from ..common.lifeline import ProcessId, hold_starting_thread, release_starting_thread
from ..common.protocol import Hooks, Stop, TakeWorker
from ..common.wire import framed
from ..worker.loop import WorkerInfo
from .stats import LoaderStats
from .waker import Events, Waker
from .worker_handle import (GONE, JOIN_SECONDS, LEAVING, WorkerHandle, consumer_ends, end_workers,
                            pickled_for, preload_in_fork_server, start_worker)


class Watched(enum.Enum):
    """What a descriptor on the pool's ``Events`` is, each with its worker (None: the waker's)."""
    REPLIES = "replies"    # the worker's reply pipe: readable
    WRITABLE = "writable"  # its task pipe has room for what waits to go
    EXITED = "exited"      # its process's sentinel: it ended
    WAKER = "waker"


class Roster:
    """Starts the workers and ends them; what they send, and their exits, are watched on the
    pool's ``Events`` (as ``Watched``)."""

    def __init__(self, worker: object, *, backend: str, context: BaseContext,
                 start: WorkerStart, max_workers: int,
                 base_seed: int, waker: Waker, events: Events, stats: LoaderStats) -> None:
        self._pickled_worker = None if backend != "proc" else pickled_for(
            "worker", Hooks(worker), context.get_start_method(),
            "or use start_method='fork' or thread_type='thread'")
        self._start_args = (None if self._pickled_worker else worker, backend, context, start)
        consumer = ProcessId.of(os.getpid())
        assert consumer is not None  # this process, alive
        self._consumer = consumer
        self.processes = backend == "proc"
        self.max_workers = max_workers
        self._base_seed = base_seed
        self.board = Board(max_workers) if self.processes else None
        self._waker = waker
        self._events = events
        self._stats = stats
        self.working: list[WorkerHandle] = []  # taking tasks, by id
        self.leaving: list[WorkerHandle] = []  # told to leave, not gone yet
        self.changes = 0  # workers started or told to leave so far: a tuning window with a
        # change in it describes no one count of workers
        if self.processes:
            preload_in_fork_server(context)
            hold_starting_thread()  # released by stop(), once the workers are gone

    def start_all(self, num_workers: int) -> None:
        for wid in range(num_workers):
            self.working.append(self._start(self._info(wid)))
        self._stats.workers = num_workers

    def _info(self, wid: int) -> WorkerInfo:
        return WorkerInfo(wid, self.max_workers, self._base_seed + wid)

    def _start(self, info: WorkerInfo) -> WorkerHandle:
        worker, backend, context, start = self._start_args
        others = [*self._waker.fds(), *consumer_ends(self.working)]
        handle = start_worker(worker, info, backend, context, start, self._consumer, others,
                              board=None if self.board is None else self.board.spec)
        self.changes += 1
        self._events.watch(handle.replies.fd, (Watched.REPLIES, handle))
        if self._pickled_worker is not None:  # see worker/loop.py: _received_worker
            self.send(handle, framed(TakeWorker(self._pickled_worker)))
        if handle.sentinel is not None:
            self._events.watch(handle.sentinel, (Watched.EXITED, handle))
        return handle

    # -- messages --------------------------------------------------------------------------------
    def send(self, handle: WorkerHandle, message: bytes) -> None:
        """Send a framed message; never blocks: what the pipe cannot take waits until the
        worker reads."""
        handle.send(message)
        if handle.tasks.waiting and not self._events.watching(handle.tasks.fd):
            self._events.watch(handle.tasks.fd, (Watched.WRITABLE, handle), write=True)

    def flush(self, handle: WorkerHandle) -> None:
        """Its task pipe has room: what waits for it goes."""
        handle.flush()
        if not handle.tasks.waiting or not handle.accepting:
            self._events.unwatch(handle.tasks.fd)

    def read(self, handle: WorkerHandle) -> list:
        """The replies the worker has sent so far; none once its pipe closed (a dying process:
        its sentinel tells how)."""
        try:
            return handle.replies.read()
        except (EOFError, OSError):
            self._events.unwatch(handle.replies.fd)
            handle.close_replies()
            return []

    def reading(self, handle: WorkerHandle) -> bool:
        """Whether the worker's reply pipe is still open and watched."""
        return handle.replies.fd >= 0 and self._events.watching(handle.replies.fd)

    # -- how many --------------------------------------------------------------------------------
    def grow(self) -> WorkerHandle | None:
        """A worker started with the lowest id not in use; None when every id is (workers still
        leaving hold theirs)."""
        used = {handle.wid for handle in (*self.working, *self.leaving)}
        wid = next((wid for wid in range(self.max_workers) if wid not in used), None)
        if wid is None:
            return None
        if self.board is not None:
            self.board.clear(wid)
        handle = self._start(self._info(wid))
        self.working.append(handle)
        return handle

    def let_leave(self, handle: WorkerHandle) -> None:
        """The worker takes no new task; it is sent ``Stop`` once its open tasks are done. One
        that died and was retired (in turn, it kept its place) is only joined."""
        self.working.remove(handle)
        self.changes += 1
        if handle.state is GONE:
            end_workers([handle])
            return
        self.leaving.append(handle)
        handle.move(LEAVING)
        self.stop_if_done(handle)

    def stop_if_done(self, handle: WorkerHandle) -> None:
        """A leaving worker with no task open is told to stop."""
        if handle.leaving and not handle.open:
            self.send(handle, framed(Stop()))

    def forget_gone(self) -> None:
        """The leaving workers that have left: joined and forgotten (a process's exit is seen
        at once, by its sentinel: ``left``; a thread's, here)."""
        for handle in [h for h in self.leaving if not h.open and not h.runner.is_alive()]:
            self.left(handle)

    def left(self, handle: WorkerHandle) -> None:
        self.ended(handle)
        end_workers([handle])
        self.leaving.remove(handle)

    def ended(self, handle: WorkerHandle) -> None:
        """The worker is gone from the pool: its pipes closed and no longer watched."""
        for fd in (handle.replies.fd, handle.sentinel, handle.tasks.fd):
            self._events.unwatch(fd)
        handle.close_pipes()
        handle.move(GONE)

    def replace(self, dead: WorkerHandle) -> WorkerHandle:
        """The dead worker's replacement, started in its place."""
        self.ended(dead)
        end_workers([dead])
        assert self.board is not None  # processes only
        self.board.clear(dead.wid)
        handle = self._start(dead.info)
        handle.replacement = True
        if dead in self.leaving:  # no worker was left to build its batches: one takes them
            self.leaving.remove(dead)
            self.working.append(handle)
            self._stats.workers = len(self.working)
        else:
            self.working[self.working.index(dead)] = handle
        return handle

    def holder_of(self, number: int) -> str:
        """Which worker is building ``number``, for timeout messages."""
        for handle in (*self.working, *self.leaving):
            if number in handle.open:
                return handle.describe()
        return "no worker (it was never dispatched: the ring has no free slot)"

    # -- stop ------------------------------------------------------------------------------------
    def stop(self, grace: float = JOIN_SECONDS) -> None:
        """Ask the workers to leave after the batch in hand, give them ``grace`` seconds, then
        kill those still there."""
        everyone = self.working + self.leaving
        try:
            for handle in everyone:
                self.send(handle, framed(Stop()))
            self._drain_until_exited(everyone, time.monotonic() + grace)
        finally:
            self._events.close()
            for handle in everyone:
                handle.close_pipes()
            end_workers(everyone)
            if self.processes:
                release_starting_thread()
            if self.board is not None:
                self.board.close()

    def _drain_until_exited(self, everyone: list[WorkerHandle], deadline: float) -> None:
        """Read and drop late replies, so that no worker blocks on a full pipe while leaving."""
        while self._still_running(everyone) and time.monotonic() < deadline:
            for fd, (watched, handle) in self._events.wait(0.01):
                if watched is Watched.REPLIES:
                    self.read(handle)  # and dropped
                elif watched is Watched.WRITABLE:
                    self.flush(handle)
                else:
                    self._events.unwatch(fd)  # the waker, or an exit

    def _still_running(self, everyone: list[WorkerHandle]) -> bool:
        """Processes until their sentinel fired (it stays watched until then); live threads."""
        return any(h.runner.is_alive() if h.sentinel is None else self._events.watching(h.sentinel)
                   for h in everyone)
