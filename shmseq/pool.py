"""The consumer's side of the workers: dispatch, replies, deaths. No thread of its own.

The consumer's thread drives the pool (``pump``) whenever it waits for a batch:

1. slots freed since the last pump (``release``, called by lease finalizers) go back
   to the free list, and each free slot is sent with the next ``(seq, indices)`` of
   the stream down the least-busy worker's task pipe;
2. it waits on every worker's reply pipe and process sentinel at once, so a worker
   that dies is reported at once, as ``concurrent.futures`` and ``loky`` do;
3. each ``("done", seq, slot, ...)`` reply is delivered: ``deliver((seq, slot, None))``.

Doing this in the consumer's thread spares two thread hand-offs per batch; the ring
bounds how far workers run ahead anyway, so nothing is lost while the consumer
computes. The first batch sizes the ring when ``slot_bytes`` is not given (the probe).
"""
from __future__ import annotations

import os
import queue
import selectors
import signal
import threading
import time
from multiprocessing import connection

import numpy as np

from .errors import ShmSeqError, WorkerDied, warn_user
from .plan import BatchStream
from .ring import Ring, RingSpec
from .stats import LoaderStats
from .workers import (WorkerInfo, check_picklable, decode, encode, slot_bytes_for, worker_error,
                      worker_loop, worker_seed)

JOIN_SECONDS = 3.0
TASK_PIPE_ROOM = 32 << 10  # under the smallest pipe capacity Linux gives by default (64 KiB)


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
        self.attached = False
        self.accepting = True

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
                 n_slots: int, slot_bytes: int | None, deliver, stats: LoaderStats,
                 seed: int = 0, worker_init_fn=None):
        self.stream = stream
        self.stats = stats
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.deliver = deliver
        self.ring: Ring | None = None
        self._free: list[int] = []
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._probe_open = False
        self._waiting = False
        self._stopped = False
        self._wake_reader, self._wake_writer = connection.Pipe(duplex=False)
        os.set_blocking(self._wake_writer.fileno(), False)
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
                                      daemon=True, args=(*common, self._local_ring, None))
        else:
            ours = self._our_ends(task_writer, result_reader, context.get_start_method())
            runner = context.Process(target=worker_loop, name=f"shmseq-worker-{info.id}",
                                     daemon=True, args=(*common, Ring.attach, os.getpid(), ours))
        handle = _WorkerHandle(info.id, task_writer, result_reader, runner)
        runner.start()
        if backend != "thread":
            task_reader.close()
            result_writer.close()
        return handle

    def _our_ends(self, task_writer, result_reader, start_method: str) -> tuple[int, ...]:
        """The consumer's pipe ends a forked worker inherits, for it to close: once the
        consumer is gone, nothing may keep its reply pipe open, or a worker blocked on a
        full pipe would never learn it (spawned workers inherit nothing)."""
        if start_method != "fork":
            return ()
        ends = [task_writer, result_reader, self._wake_reader, self._wake_writer]
        ends += [end for h in self._workers for end in (h.tasks, h.results)]
        return tuple(end.fileno() for end in ends)

    def _local_ring(self, spec: RingSpec) -> Ring:
        return self.ring

    def _watch(self) -> selectors.BaseSelector:
        """One selector for the whole run: reply pipes, process sentinels, the wake-up pipe."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_reader, selectors.EVENT_READ, None)
        for handle in self._workers:
            selector.register(handle.results, selectors.EVENT_READ, (self._receive, handle))
            if handle.sentinel is not None:
                selector.register(handle.sentinel, selectors.EVENT_READ, (self._report_death, handle))
        return selector

    def start(self, timeout: float) -> None:
        """Create the ring (now, or once the probe batch sizes it); return when every worker
        maps it, after which its name is unlinked: nothing can be left in /dev/shm."""
        if self.slot_bytes is not None and self.stream:
            self._open_ring(self.slot_bytes)
        deadline = time.monotonic() + timeout
        while self.stream and not all(h.attached for h in self._workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ShmSeqError(f"the workers did not start within timeout={timeout} s")
            self.pump(remaining)
        if self.ring is not None:
            self.ring.unlink()

    def _open_ring(self, slot_bytes: int) -> None:
        self.ring = Ring.create(self.n_slots, slot_bytes)
        self.ring.on_release = self.release
        self._free = list(range(self.n_slots))
        for handle in self._workers:
            self._send(handle, encode(("ring", self.ring.spec)))

    # -- called from any thread ----------------------------------------------------------------
    def release(self, slot: int) -> None:
        """A slot is free again (from a lease finalizer, in any thread: no locks here).

        Freed in another thread (the releaser of CUDA copies, a thread the user hands
        batches to) while the consumer waits, it must wake the consumer: that wait may be
        for a batch only this slot can carry."""
        self._released.put(slot)
        if self._waiting:
            self.wake()

    def wake(self) -> None:
        """Cut a ``pump`` short: a converter put a batch out, or a slot came free."""
        try:
            self._wake_writer.send_bytes(b"")
        except (BlockingIOError, OSError):
            pass  # already woken, or stopped

    # -- the consumer's thread -----------------------------------------------------------------
    def seek(self, seq: int) -> None:
        """Skip the stream forward to ``seq`` (the consumer left an epoch early)."""
        self.stream.seek(seq)

    def pump(self, timeout: float) -> None:
        """Hand free slots to workers, then wait up to ``timeout`` s for replies and handle them.

        Raises what went wrong with a worker (it died, or failed to start)."""
        self._dispatch()
        self._waiting = True
        try:
            if not self._released.empty():  # freed before we said we wait: no wake came
                timeout = 0
            ready = self._selector.select(timeout)
        finally:
            self._waiting = False
        for key, _ in ready:
            if key.data is None:
                while self._wake_reader.poll():
                    self._wake_reader.recv_bytes()
            else:
                handler, handle = key.data
                handler(handle)
        self._dispatch()

    def _dispatch(self) -> None:
        while not self._released.empty():
            self._free.append(self._released.get())
        if not self.stream:
            return
        if self.ring is None:
            if not self._probe_open:
                self._probe_open = self._send_task(None)
            return
        while self._free and self._send_task(self._free[-1]):
            self._free.pop()

    def _send_task(self, slot: int | None) -> bool:
        """Send the next batch to the least-busy worker with room; False if none has."""
        seq, indices = self.stream.peek()
        data = encode(("task", seq, slot, indices))
        ready = [h for h in self._workers if h.accepting and h.has_room(len(data))]
        if not ready:
            return False  # busy (their replies come), or gone (their sentinels say why)
        handle = min(ready, key=lambda h: len(h.open))
        self.stream.take()
        handle.opened(seq, indices, len(data))
        self._send(handle, data)
        return True

    @staticmethod
    def _send(handle: _WorkerHandle, data: bytes) -> None:
        try:
            handle.tasks.send_bytes(data)
        except OSError:
            handle.accepting = False  # it died: its sentinel (or last message) tells why

    def _receive(self, handle: _WorkerHandle) -> None:
        """Every reply the worker has sent so far."""
        try:
            while True:
                self._handle(handle, decode(handle.results.recv_bytes()))
                if not handle.results.poll():
                    return
        except (EOFError, OSError):
            self._selector.unregister(handle.results)
            handle.results = None  # a dying process: its sentinel tells how

    def _handle(self, handle: _WorkerHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "done":
            _, seq, slot, size, busy = message
            handle.closed(seq)
            self.stats.worker_busy_s += busy
            self.deliver((seq, slot, None))
        elif kind == "overflow":
            self._overflowed(handle, *message[1:])
        elif kind == "error":
            _, seq, slot, info = message
            indices = handle.closed(seq)
            error = worker_error(info, indices=indices, seq=seq, what=(
                f"worker {handle.wid} failed on batch {seq} (sample indices {_brief(indices)})"))
            if slot is None:
                raise error  # the probe failed: the ring cannot be sized, start() reports it
            self._free.append(slot)
            self.deliver((seq, None, error))
        elif kind == "attached":
            handle.attached = True
        elif kind == "init_error":
            raise worker_error(message[2], what=f"worker {handle.wid} failed to start")

    def _overflowed(self, handle: _WorkerHandle, seq: int, slot: int | None, payload,
                    busy: float) -> None:
        handle.closed(seq)
        self.stats.worker_busy_s += busy
        if slot is None:  # the probe that sizes the ring: its batch goes into the first slot
            self._probe_open = False
            self._open_ring(slot_bytes_for(len(payload)))
            slot = self._free.pop()
            self.ring.region(slot)[:len(payload)] = payload
            self.deliver((seq, slot, None))
        else:
            self._free.append(slot)
            self.deliver((seq, None, payload))

    def _report_death(self, handle: _WorkerHandle) -> None:
        if handle.results is not None and handle.results.poll():
            self._receive(handle)  # its last words (an init error) explain more
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
        """Stop the workers, then free the ring. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for handle in self._workers:
            self._send(handle, encode(None))
        self._drain_until_exited(time.monotonic() + JOIN_SECONDS)
        self._selector.close()
        for handle in self._workers:
            handle.tasks.close()
            if handle.results is not None:
                handle.results.close()
            self._end(handle)
        self._wake_reader.close()
        self._wake_writer.close()
        if self.ring is not None:
            self.ring.unlink()
            self.ring.close()

    def _drain_until_exited(self, deadline: float) -> None:
        """Read and drop late replies, so that no worker blocks on a full pipe while leaving."""
        selector = self._selector
        while self._still_running() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.01):
                handle = key.data[1] if key.data else None
                if handle is None or key.fileobj is not handle.results:
                    selector.unregister(key.fileobj)  # the wake-up pipe, or an exit
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
