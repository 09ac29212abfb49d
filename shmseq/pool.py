"""The consumer's side of the workers: dispatch, replies, deaths. No thread of its own.

The consumer's thread drives the pool (``pump``) whenever it waits for a batch:

1. each free slot of the ring goes, with the next ``(seq, indices)`` of the stream, down
   the least-busy worker's task pipe;
2. it waits on every worker's reply pipe and process sentinel at once (and on the waker,
   which other threads use to cut the wait short), so that a worker that dies is reported
   at once, as ``concurrent.futures`` and ``loky`` do;
3. each reply becomes an ``Arrival``: a batch written in its slot, an encoded batch too
   large for it (or the probe that sizes the ring), or the worker's error.

Doing this in the consumer's thread spares two thread hand-offs per batch; the ring
bounds how far workers run ahead anyway, so nothing is lost while the consumer computes.
"""
from __future__ import annotations

import functools
import os
import select
import selectors
import signal
import threading
import time
from multiprocessing import connection
from typing import Callable, NamedTuple

import numpy as np

from .errors import WorkerDied, warn_user
from .plan import BatchStream
from .ring import Ring
from .stats import LoaderStats
from .workers import WorkerInfo, check_picklable, decode, encode, worker_error, worker_loop, worker_seed

JOIN_SECONDS = 3.0
TASK_PIPE_ROOM = 32 << 10  # under the smallest pipe capacity Linux gives by default (64 KiB)


class Arrival(NamedTuple):
    """What a reply brings: batch ``seq`` in ``slot``, or as ``payload`` bytes (too large for
    a slot, or the probe), or ``error``, which makes the error to raise in its place (made
    when raised: an exception kept in a frame of its own traceback is a reference cycle,
    which would keep the consumer's batches, and their ring, until a garbage collection)."""
    seq: int
    slot: int | None
    payload: np.ndarray | None = None
    error: Callable[[], BaseException] | None = None


class Waker:
    """Cuts the consumer's wait short from any thread: a slot came free, ``finish()`` was called."""

    def __init__(self):
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._reader, False)
        os.set_blocking(self._writer, False)
        self._lock = threading.Lock()  # never held where a weakref callback could run
        self.waiting = False

    def fileno(self) -> int:
        return self._reader

    def fds(self) -> tuple[int, int]:
        return self._reader, self._writer

    def wake(self) -> None:
        with self._lock:
            if self._writer >= 0:
                try:
                    os.write(self._writer, b"\0")
                except BlockingIOError:
                    pass  # already woken

    def wake_if_waiting(self) -> None:
        if self.waiting:
            self.wake()

    def drain(self) -> None:
        try:
            while os.read(self._reader, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            for fd in (self._reader, self._writer):
                os.close(fd)
            self._reader = self._writer = -1


class _WorkerHandle:
    """One worker as the consumer sees it: its pipes, its process or thread, its open tasks."""

    def __init__(self, wid: int, tasks, results, runner):
        self.wid = wid
        self.tasks = tasks
        self.results = results
        self.runner = runner
        self.open: dict[int, np.ndarray] = {}  # seq -> indices, in the order sent
        self.unread = 0                        # bytes of those task messages
        self._sizes: dict[int, int] = {}
        self.ready = False
        self.attached = False
        self.accepting = True
        self._replies = select.poll()  # Connection.poll() builds a selector per call
        self._replies.register(results.fileno(), select.POLLIN)

    def has_reply(self) -> bool:
        """Whether a reply (or the pipe's end) can be read without waiting."""
        return self.results is not None and bool(self._replies.poll(0))

    def has_room(self, nbytes: int) -> bool:
        """Whether a task of ``nbytes`` fits in its pipe beside the tasks it has not done yet:
        a worker that stopped reading must never make the consumer block on a full pipe."""
        return not self.open or self.unread + nbytes <= TASK_PIPE_ROOM

    def opened(self, seq: int, indices, nbytes: int) -> None:
        self.open[seq] = indices
        self._sizes[seq] = nbytes
        self.unread += nbytes

    def closed(self, seq: int):
        """The task ``seq`` is done (or failed): its indices."""
        self.unread -= self._sizes.pop(seq, 0)
        return self.open.pop(seq, None)

    @property
    def pid(self):
        return getattr(self.runner, "pid", None)

    @property
    def sentinel(self):
        return getattr(self.runner, "sentinel", None)


class WorkerPool:
    """Starts the workers, feeds them free slots, collects their replies, watches them."""

    def __init__(self, worker, *, num_workers: int, backend: str, context, stream: BatchStream,
                 waker: Waker, stats: LoaderStats, seed: int = 0, worker_init_fn=None):
        self.stream = stream
        self.stats = stats
        self.ring: Ring | None = None
        self._waker = waker
        self._probe_sent = False  # the first batch, sent without a slot to size the ring
        self._stopped = False
        if backend == "proc":
            check_picklable("worker", worker, context.get_start_method(),
                            "or use start_method='fork' or thread_type='thread'")
        self._workers: list[_WorkerHandle] = []
        try:
            for wid in range(num_workers):
                info = WorkerInfo(wid, num_workers, worker_seed(seed, wid))
                self._workers.append(self._spawn(worker, info, backend, context, worker_init_fn))
        finally:
            self._selector = self._watch()
            if len(self._workers) < num_workers:  # a start failed: stop those that did start
                self.stop()

    # -- start -------------------------------------------------------------------------------
    def _spawn(self, worker, info: WorkerInfo, backend: str, context, worker_init_fn) -> _WorkerHandle:
        task_reader, task_writer = connection.Pipe(duplex=False)
        result_reader, result_writer = connection.Pipe(duplex=False)
        common = (worker, task_reader, result_writer, info, worker_init_fn)
        if backend == "thread":
            runner = threading.Thread(target=worker_loop, name=f"shmseq-worker-{info.id}",
                                      daemon=True, args=(*common, None, None))
        else:
            inherited = self._our_ends(task_writer, result_reader, context.get_start_method())
            runner = context.Process(target=worker_loop, name=f"shmseq-worker-{info.id}",
                                     daemon=True, args=(*common, os.getpid(), inherited))
        handle = _WorkerHandle(info.id, task_writer, result_reader, runner)
        runner.start()
        if backend != "thread":
            task_reader.close()
            result_writer.close()
        return handle

    def _our_ends(self, task_writer, result_reader, start_method: str) -> tuple[int, ...] | None:
        """The consumer's pipe ends a forked worker inherits, for it to close: once the
        consumer is gone, nothing may keep its reply pipe open, or a worker blocked on a
        full pipe would never learn it. None: not forked, nothing inherited."""
        if start_method != "fork":
            return None
        ends = [task_writer.fileno(), result_reader.fileno(), *self._waker.fds()]
        ends += [end.fileno() for h in self._workers for end in (h.tasks, h.results)]
        return tuple(ends)

    def _watch(self) -> selectors.BaseSelector:
        """One selector for the whole run: reply pipes, process sentinels, the waker."""
        selector = selectors.DefaultSelector()
        selector.register(self._waker, selectors.EVENT_READ, None)
        for handle in self._workers:
            selector.register(handle.results, selectors.EVENT_READ, (self._receive, handle))
            if handle.sentinel is not None:
                selector.register(handle.sentinel, selectors.EVENT_READ, (self._report_death, handle))
        return selector

    def use_ring(self, ring: Ring) -> None:
        """Send the ring to every worker; its name is unlinked once they all mapped it."""
        self.ring = ring
        for handle in self._workers:
            self._send(handle, encode(("ring", ring.spec)))

    def started(self) -> bool:
        """Every worker built its worker object and, once there is a ring, mapped it."""
        return all(h.ready and (self.ring is None or h.attached) for h in self._workers)

    def which_not_started(self) -> str:
        late = [h for h in self._workers if not (h.ready and (self.ring is None or h.attached))]
        return ", ".join(f"worker {h.wid}" + (f" (pid {h.pid})" if h.pid else "") for h in late)

    # -- the consumer's thread -----------------------------------------------------------------
    def pump(self, timeout: float) -> list[Arrival]:
        """Hand free slots to workers, then wait up to ``timeout`` s for replies: what arrived.

        Raises what went wrong with a worker (it died, or failed to start)."""
        self.dispatch()
        self._waker.waiting = True
        try:
            if self.ring is not None and self.ring.has_news():  # freed before we said we wait
                timeout = 0
            ready = self._selector.select(timeout)
        finally:
            self._waker.waiting = False
        arrivals: list[Arrival] = []
        for key, _ in ready:
            if key.data is None:
                self._waker.drain()
            else:
                handler, handle = key.data
                handler(handle, arrivals)
        self.dispatch()
        return arrivals

    def dispatch(self) -> None:
        """Send the next batches of the stream with free slots (the probe, before the ring)."""
        if self.ring is None:
            if not self._probe_sent and (item := self.stream.peek()) is not None:
                self._probe_sent = self._send_task(item, None)
                if self._probe_sent:
                    self.stream.advance()
            return
        while (slot := self.ring.acquire()) is not None:
            item = self.stream.peek()
            if item is None or not self._send_task(item, slot):
                self.ring.unused(slot)
                return
            self.stream.advance()

    def _send_task(self, item: tuple, slot: int | None) -> bool:
        """Send a task to the least-busy worker with room; False if none has."""
        seq, indices = item
        data = encode(("task", seq, slot, indices))
        ready = [h for h in self._workers if h.accepting and h.has_room(len(data))]
        if not ready:
            return False  # busy (their replies come), or gone (their sentinels say why)
        handle = min(ready, key=lambda h: len(h.open))
        handle.opened(seq, indices, len(data))
        self._send(handle, data)
        return True

    @staticmethod
    def _send(handle: _WorkerHandle, data: bytes) -> None:
        try:
            handle.tasks.send_bytes(data)
        except OSError:
            handle.accepting = False  # it died: its sentinel (or last message) tells why

    def _receive(self, handle: _WorkerHandle, arrivals: list[Arrival]) -> None:
        """Every reply the worker has sent so far."""
        while True:
            try:
                data = handle.results.recv_bytes()
            except (EOFError, OSError):
                self._selector.unregister(handle.results)
                handle.results = None  # a dying process: its sentinel tells how
                return
            self._handle(handle, decode(data), arrivals)
            if not handle.has_reply():
                return

    def _handle(self, handle: _WorkerHandle, message: tuple, arrivals: list[Arrival]) -> None:
        kind = message[0]
        if kind == "done":
            _, seq, slot, size, busy = message
            handle.closed(seq)
            self.stats.worker_busy_s += busy
            self.ring.written(slot)
            arrivals.append(Arrival(seq, slot))
        elif kind == "overflow":
            _, seq, slot, payload, busy = message
            handle.closed(seq)
            self.stats.worker_busy_s += busy
            self._give_back(slot)
            arrivals.append(Arrival(seq, None, payload))
        elif kind == "error":
            _, seq, slot, info = message
            indices = handle.closed(seq)
            self._give_back(slot)
            what = f"worker {handle.wid} failed on batch {seq} (sample indices {_brief(indices)})"
            arrivals.append(Arrival(seq, None, error=functools.partial(
                worker_error, info, indices=indices, seq=seq, what=what)))
        elif kind == "ready":
            handle.ready = True
        elif kind == "attached":
            handle.attached = True
            if all(h.attached for h in self._workers):
                self.ring.unlink()  # every worker maps it: nothing can be left in /dev/shm
        elif kind == "init_error":
            raise worker_error(message[2], what=f"worker {handle.wid} failed to start")

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:  # None: the probe, which sizes the ring
            self.ring.unused(slot)

    def _report_death(self, handle: _WorkerHandle, arrivals: list[Arrival]) -> None:
        if handle.has_reply():
            self._receive(handle, arrivals)  # its last words (an init error) explain more
        handle.runner.join(JOIN_SECONDS)  # its sentinel closed: the exit status follows at once
        code = handle.runner.exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        message = f"worker {handle.wid} (pid {handle.pid}) {how}"
        if handle.open:  # a worker takes its tasks in order: the first one was in progress
            current, *queued = sorted(handle.open)
            message += (f" while building batch {current} (sample indices "
                        f"{_brief(handle.open[current])})")
            if queued:
                message += f"; batches {', '.join(map(str, queued))} were queued for it"
        raise WorkerDied(message, pid=handle.pid, exitcode=code)

    def holder_of(self, seq: int) -> str:
        """Which worker is building ``seq``, for timeout messages."""
        for handle in self._workers:
            if seq in handle.open:
                return f"worker {handle.wid}" + (f" (pid {handle.pid})" if handle.pid else "")
        return "no worker (it was never dispatched: the ring has no free slot)"

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the workers. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for handle in self._workers:
            self._send(handle, encode(None))
        try:
            self._drain_until_exited(time.monotonic() + JOIN_SECONDS)
        finally:
            self._selector.close()
            for handle in self._workers:
                handle.tasks.close()
                if handle.results is not None:
                    handle.results.close()
                self._end(handle)

    def _drain_until_exited(self, deadline: float) -> None:
        """Read and drop late replies, so that no worker blocks on a full pipe while leaving."""
        selector = self._selector
        while self._still_running() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.01):
                handle = key.data[1] if key.data else None
                if handle is None or key.fileobj is not handle.results:
                    selector.unregister(key.fileobj)  # the waker, or an exit
                    continue
                try:
                    handle.results.recv_bytes()
                except (EOFError, OSError):
                    selector.unregister(handle.results)
                    handle.results.close()
                    handle.results = None

    def _still_running(self) -> bool:
        """Processes until their sentinel fired (it stays registered until then); live threads."""
        registered = self._selector.get_map()
        return any(h.runner.is_alive() if h.sentinel is None else h.sentinel in registered
                   for h in self._workers)

    @staticmethod
    def _end(handle: _WorkerHandle) -> None:
        """Kill a process that did not leave in time; a thread cannot be killed, so say so."""
        if isinstance(handle.runner, threading.Thread):
            if handle.runner.is_alive():
                warn_user(f"worker thread {handle.wid} is still inside the worker's code after "
                          f"{JOIN_SECONDS} s and cannot be stopped: it is left to finish alone")
            return
        if handle.runner.is_alive():
            handle.runner.kill()
        handle.runner.join(JOIN_SECONDS)
        handle.runner.close()


def _brief(indices) -> str:
    if indices is None:
        return "unknown"
    return np.array2string(np.asarray(indices), threshold=12, separator=", ")
