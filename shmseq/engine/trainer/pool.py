"""The consumer's side of the workers: dispatch, replies, deaths. No thread of its own.

The consumer's thread drives the pool (``exchange``) at each of its steps (pipeline.py):

1. each free slot of the ring goes, with the next ``(number, indices)`` of the stream, down
   a worker's task pipe (``_dispatch``, the one place batches are handed out; ``_choose``
   says to which worker, following the consumer's pace);
2. it waits on every worker's reply pipe and process sentinel at once (and on the waker,
   which other threads use to cut the wait short), so that a worker that dies is reported
   at once, as ``concurrent.futures`` and ``loky`` do;
3. each reply (protocol.py's messages, matched by type in ``_handle``) becomes a ``Reply``:
   a batch written in its slot, an encoded batch (too large for its slot), or the worker's
   error.

Before there is a ring (its slot size is not known yet), each worker gets one batch at a
time without a slot, builds it and tells its size: the first size sizes the ring, and each
of these batches is then given a slot, which its worker writes it into (``use_ring``).

Doing this in the consumer's thread spares two thread hand-offs per batch; the ring
bounds how far workers run ahead anyway, so nothing is lost while the consumer computes.

The pool can be resized while it runs (``resize``, asked by the pipeline's tuning): a new
worker takes the lowest free id; a worker told to leave takes no new task, and is sent
``Stop`` once its open tasks are done, its exit then no death. Which batches there are and
their order do not depend on the workers: the stream and the ring decide them.
"""
from __future__ import annotations

import functools
import os
import select
import signal
import threading
import time
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Callable

import numpy as np

from ..common.board import Board
from ..common.errors import WorkerDied, raised_in_worker, warn_user
from ..common.lifeline import ProcessId, hold_starting_thread, release_starting_thread
from ..common.protocol import (Attached, Built, Counted, Done, Ended, Failed, FromWorker, Hooks,
                               InitFailed, MapRing, Overflow, Place, Ready, Rebuild, Reply, Skipped,
                               Stop, TakeWorker)
from ..common.wire import build_frame, framed
from ..worker.loop import WorkerInfo
from .plan import BatchStream, Task
from .ring import Ring
from .stats import LoaderStats
from .worker_handle import (JOIN_SECONDS, WorkerHandle, consumer_ends, end_workers, pickled_for,
                            preload_in_fork_server, start_worker)


PACK_BELOW_S = 0.002  # batches built faster than this are packed on one worker (Pace.packs): 16
# latency-bound workers (21 ms a batch) ran at one worker's rate for a second after each epoch
# began, its first batches queued on one worker, where cifar's (a copy well under 1 ms) ran
# 1.7x faster packed than spread (python -m shmseq.bench --autotune, ring-cifar, 6 slots)


class Waker:
    """Cuts the consumer's wait short from any thread: a slot came free, ``finish()`` was called."""

    def __init__(self) -> None:
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


class _Events:
    """One epoll for the whole run: what to do when each descriptor is ready. (Not
    ``selectors``: its Python layer cost more, a batch, than everything else here.)"""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, tuple] = {}

    def watch(self, fd: int, handler: tuple, write: bool = False) -> None:
        self._epoll.register(fd, select.EPOLLOUT if write else select.EPOLLIN)
        self._handlers[fd] = handler

    def unwatch(self, fd: int | None) -> None:
        if fd is not None and self._handlers.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def watching(self, fd: int) -> bool:
        return fd in self._handlers

    def wait(self, timeout: float | None) -> list[tuple[int, tuple]]:
        """The ready descriptors and their handlers, as registered when they were found."""
        handlers = self._handlers
        return [(fd, handlers[fd]) for fd, _ in self._epoll.poll(-1 if timeout is None else timeout)
                if fd in handlers]

    def current(self, fd: int, handler: tuple) -> bool:
        """Whether ``handler`` still handles ``fd`` (not replaced meanwhile by a new worker's)."""
        return self._handlers.get(fd) is handler

    def close(self) -> None:
        self._epoll.close()
        self._handlers.clear()


class Pace:
    """Which side is slower: the consumer, once it looked for a batch not delivered yet and
    found replies that left half the ring or more waiting for it, until it has to wait for a
    batch again. Its tasks are then packed on one worker (see ``WorkerPool._choose``), if
    batches are cheap (``packs``)."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.consumer_is_slower = False

    def follow(self, waiting: int, waited: bool) -> None:
        """``waiting``: deliveries the consumer has not taken, the replies it just found
        counted in; ``waited``: it found none and is about to wait."""
        if waited:
            self.consumer_is_slower = False
        elif 2 * waiting >= self.n_slots:
            self.consumer_is_slower = True

    def packs(self, busy_s: float, batches: int) -> bool:
        """Whether tasks go to one worker: the consumer is slower, and the batches delivered
        took less than ``PACK_BELOW_S`` each to build (``busy_s`` over ``batches``), so that a
        worker woken for each would cost as much as the batch. Slower batches are spread: a
        burst of free slots (a new epoch) queued on one worker would come at its pace alone."""
        return self.consumer_is_slower and busy_s < PACK_BELOW_S * batches


class WorkerPool:
    """Starts the workers, feeds them free slots, collects their replies, watches them, and
    (``restarts`` > 0) replaces a worker process that dies, sending its batches again.

    Worker ``k`` is seeded with ``base_seed + k``. ``in_turn``: batch ``k`` of an epoch goes to
    worker ``k % num_workers``, as torch's DataLoader deals them (a worker's random stream
    then meets the same batches as under torch's loader)."""

    def __init__(self, worker: object, *, num_workers: int, n_slots: int, backend: str,
                 context: BaseContext, stream: BatchStream, waker: Waker, stats: LoaderStats,
                 base_seed: int = 0, worker_init_fn: Callable[[int], object] | None = None,
                 restarts: int = 0, in_turn: bool = False,
                 max_workers: int | None = None) -> None:
        """``max_workers``: the most workers ``resize`` may run (None: ``num_workers``); each
        worker's ``WorkerInfo.num_workers`` says it."""
        self.stream = stream
        self.stats = stats
        self.ring: Ring | None = None
        self._n_slots = n_slots
        self._waker = waker
        self._in_turn = in_turn
        self._ended: set[int] = set()  # workers whose stream ended in this pass
        self._pass_first = 0  # the number of the pass's first batch
        self._skipped: dict[int, tuple] = {}  # batch number -> what its worker left out
        self._turn = 0  # the worker after the last one given a task in turn
        self._pace = Pace(n_slots)
        self._built: list[tuple[WorkerHandle, int, int]] = []  # (worker, number, bytes) of
        # batches built without a slot, held by their worker until there is a ring to place them
        self._stopped = False
        self._restarts = restarts
        self._killers: set[int] = set()  # batches a death was charged on once
        self._oom_kills = oom_kills()  # the kernel's count, as of the last death seen
        self._replacements: set[WorkerHandle] = set()  # workers started in a dead one's place
        self._held: list[Reply] = []  # read when a death was raised: for the next exchange
        self._pickled_worker = None if backend != "proc" else pickled_for(
            "worker", Hooks(worker), context.get_start_method(),
            "or use start_method='fork' or thread_type='thread'")
        self._start_args = (None if self._pickled_worker else worker, backend, context,
                            worker_init_fn)
        consumer = ProcessId.of(os.getpid())
        assert consumer is not None  # this process, alive
        self._consumer = consumer
        self._processes = backend == "proc"
        self._max_workers = num_workers if max_workers is None else max_workers
        self._base_seed = base_seed
        self._board = Board(self._max_workers) if self._processes else None
        self._leaving: list[WorkerHandle] = []  # told to leave, not gone yet (``resize``)
        self.changes = 0  # workers started or told to leave so far: a tuning window with
        # a change in it describes no one count of workers
        self._events = _Events()
        self._events.watch(self._waker.fileno(), (self._woken, None))
        self._workers: list[WorkerHandle] = []
        if self._processes:
            preload_in_fork_server(context)
            hold_starting_thread()  # released by stop(), once the workers are gone
        try:
            for wid in range(num_workers):
                self._workers.append(self._start(self._info(wid)))
        except BaseException:
            self.stop()  # a start failed: stop those that did start
            raise
        stats.workers = num_workers

    def _info(self, wid: int) -> WorkerInfo:
        return WorkerInfo(wid, self._max_workers, self._base_seed + wid)

    # -- start -------------------------------------------------------------------------------
    def _start(self, info: WorkerInfo) -> WorkerHandle:
        worker, backend, context, worker_init_fn = self._start_args
        others = [*self._waker.fds(), *consumer_ends(self._workers)]
        handle = start_worker(worker, info, backend, context, worker_init_fn, self._consumer, others,
                              board=None if self._board is None else self._board.spec)
        self.changes += 1
        self._events.watch(handle.replies.fd, (self._receive, handle))
        if self._pickled_worker is not None:  # see worker/loop.py: _received_worker
            self._send(handle, framed(TakeWorker(self._pickled_worker)))
        if handle.sentinel is not None:
            self._events.watch(handle.sentinel, (self._died, handle))
        return handle

    def use_ring(self, ring: Ring) -> None:
        """Send the ring to every worker, which maps it, and give the batches they hold slots.
        The ring keeps a slot for each batch sent before it existed, built or not yet."""
        self.ring = ring
        ring.owe(sum(slot is None for h in self._workers for _, slot in h.open.values()))
        for handle in self._workers:
            self._send(handle, framed(MapRing(ring.spec)))
        self._place_built()

    def built_sizes(self) -> list[int]:
        """The sizes of the batches built without a slot, waiting for a ring to hold them."""
        return [size for _, _, size in self._built]

    def _place_built(self) -> None:
        """Give each batch a worker holds a free slot if it fits one, else none (it then comes
        back encoded: as an overflow, or as it came where the ring has fewer slots than
        workers). A dead worker's are not placed: its heir builds them again."""
        ring = self.ring
        assert ring is not None, "no ring to place the batches in"
        for handle, number, size in self._built:
            if not handle.accepting or not (handle in self._workers or handle in self._leaving):
                continue
            slot = ring.acquire_owed() if size <= ring.spec.slot_bytes else None
            if slot is not None:
                handle.open[number] = (handle.open[number][0], slot)
            self._send(handle, framed(Place(number, slot)))
        self._built.clear()

    def started(self, mapped: bool = True) -> bool:
        """Every worker built its worker object and (``mapped``), once there is a ring, mapped
        it."""
        return all(self._started(h, mapped) for h in self._workers)

    def which_not_started(self, mapped: bool = True) -> str:
        return ", ".join(h.describe() for h in self._workers if not self._started(h, mapped))

    def _started(self, handle: WorkerHandle, mapped: bool) -> bool:
        return handle.ready and (not mapped or self.ring is None or handle.attached)

    # -- the consumer's thread -----------------------------------------------------------------
    def exchange(self, timeout: float | None, waiting: int, read: bool = True) -> list[Reply]:
        """Read the replies there, give the workers what they can build, and return the
        replies: if none was there, the first within ``timeout`` s (None: until something
        happens). ``waiting``: the deliveries the consumer has not taken yet (see ``Pace``).
        ``read=False``: the consumer has its batch, the workers are only given free slots
        (replies left in the pipes are read at its next look).

        Raises what went wrong with a worker (it died, or failed to start)."""
        if not read:
            self._dispatch(waiting)
            return []
        ready = self._events.wait(0)
        received = self._held + (self._handle_ready(ready) if ready else [])
        self._held = []
        waiting += len(received)
        waits = not ready and not received and timeout != 0
        if timeout != 0:  # the consumer looks for a batch not delivered yet
            if self.ring is not None:
                self._pace.n_slots = self.ring.active
            self._pace.follow(waiting, waited=waits)
        self._dispatch(waiting)
        if not waits:
            return received
        self._waker.waiting = True  # first: what another thread reports after the look wakes us
        try:
            if self.ring is not None:
                timeout = self.ring.wait_bound(timeout)
            return self._handle_ready(self._events.wait(timeout))
        finally:
            self._waker.waiting = False

    def _handle_ready(self, ready: list[tuple[int, tuple]]) -> list[Reply]:
        received: list[Reply] = []
        for fd, handler in ready:
            if self._events.current(fd, handler):  # not a replaced worker's
                handler[0](handler[1], received)
        return received

    def _woken(self, _: None, received: list[Reply]) -> None:
        self._waker.drain()

    def _dispatch(self, waiting: int) -> None:
        """Send the next batches of the stream with the free slots the ring gives new tasks,
        asked for once: those the stream has no batch for now, or no worker takes, go back
        (before there is a ring, ``_dispatch_unsized``)."""
        if self.ring is None:
            self._dispatch_unsized(waiting)
            return
        slots = self.ring.acquire_free()
        pack = self._pace.packs(self.stats.worker_busy_s, self.stats.batches)
        for at, slot in enumerate(slots):
            task = self.stream.peek()
            chosen = None if task is None else self._choose(task, pack)
            if chosen is None:
                self.ring.unsent(slots[at:])
                return
            assert task is not None  # the one chosen for
            self._send_task(chosen, task, slot)
            self.stream.advance()

    def _dispatch_unsized(self, waiting: int) -> None:
        """One batch without a slot to each worker that has none, while fewer than a ring's
        worth of failures wait for the consumer."""
        while waiting < self._n_slots and (task := self.stream.peek()) is not None:
            chosen = self._choose(task, pack=False)
            if chosen is None or chosen.open:
                return
            self._send_task(chosen, task, None)
            self.stream.advance()

    def _choose(self, task: Task, pack: bool) -> WorkerHandle | None:
        """The worker for a task; None if none takes tasks (gone: their sentinels say why).

        In turn (``in_turn``): worker ``position % num_workers``, or the next one that takes
        tasks; once a worker's stream ended, the next one round the cycle whose stream has not
        (torch's order for an ``IterableDataset``). Else the least-busy worker that has started
        (a replacement still starting, 0.2 s when spawned, would hold up the batches given to
        it): the work is spread. But while the consumer is the slower side (``pack``), tasks all
        go to the first worker that takes tasks, awake most often, where the least-busy one
        would be a sleeping one woken for each batch; on small batches the wake-ups cost more
        than the batches themselves."""
        workers = self._workers
        if self._in_turn:  # a worker's id is its place
            first = self._turn if self._ended else task.position % len(workers)
            for at in (*range(first, len(workers)), *range(first)):
                if workers[at].accepting and at not in self._ended:
                    return workers[at]
            return None
        taking = [handle for handle in workers if handle.accepting]
        if not taking:
            return None
        return taking[0] if pack else min(taking, key=lambda h: (not h.ready, len(h.open)))

    def _send_task(self, chosen: WorkerHandle, task: Task, slot: int | None) -> None:
        if self._in_turn:
            self._turn = (chosen.wid + 1) % len(self._workers)  # a worker's id is its place
        chosen.open[task.number] = (task.indices, slot)
        self._send(chosen, build_frame(task.number, slot, task.indices))  # a Build

    def _send(self, handle: WorkerHandle, message: bytes) -> None:
        """Send a framed message; never blocks: what the pipe cannot take waits until the
        worker reads."""
        handle.send(message)
        if handle.tasks.waiting and not self._events.watching(handle.tasks.fd):
            self._events.watch(handle.tasks.fd, (self._flush, handle), write=True)

    def _flush(self, handle: WorkerHandle, received: list[Reply]) -> None:
        try:
            handle.tasks.flush()
        except OSError:
            handle.accepting = False
        if not handle.tasks.waiting or not handle.accepting:
            self._events.unwatch(handle.tasks.fd)

    def _receive(self, handle: WorkerHandle, received: list[Reply]) -> None:
        """Every reply the worker has sent so far."""
        for message in self._replies(handle):
            self._handle(handle, message, received)

    def _replies(self, handle: WorkerHandle) -> list:
        """The replies the worker has sent so far; none once its pipe closed (a dying process:
        its sentinel tells how)."""
        try:
            return handle.replies.read()
        except (EOFError, OSError):
            self._events.unwatch(handle.replies.fd)
            handle.close_replies()
            return []

    def _handle(self, handle: WorkerHandle, message: FromWorker, received: list[Reply]) -> None:
        ring = self.ring  # there before any batch is written (or overflows) into a slot
        match message:
            case Done(number, slot, _, busy, cpu, idle):
                self._closed(handle, number)
                stats = self.stats
                stats.worker_busy_s += busy
                stats.worker_cpu_s += cpu
                stats.worker_idle_s += idle
                assert ring is not None
                ring.written(slot)
                received.append(Reply(number, slot, skipped=self._skipped.pop(number, ())))
            case Overflow(number, slot, payload, busy, cpu):
                self._closed(handle, number)
                self.stats.worker_busy_s += busy
                self.stats.worker_cpu_s += cpu
                self._give_back(slot)
                # one without a slot was built before the ring and given none: larger than a
                # slot (an overflow too), or none was free (a ring with fewer slots than workers)
                assert ring is not None  # a batch without a slot overflows once it is given none
                overflowed = slot is not None or len(payload) > ring.spec.slot_bytes
                received.append(Reply(number, None, payload, overflowed=overflowed,
                                      skipped=self._skipped.pop(number, ())))
            case Failed(number, slot, error):
                indices = self._closed(handle, number)
                self._give_back(slot)
                what = (f"{handle.describe()} failed on {self.stream.name(number)} "
                        f"(sample indices {brief(indices)})")
                received.append(Reply(number, None, error=functools.partial(
                    raised_in_worker, error, what=what, batch_indices=indices,
                    batch_number=number)))
            case Built(number, size):  # held by its worker until it is given a slot (or none)
                self._built.append((handle, number, size))
                if self.ring is not None:
                    self._place_built()
            case Ended(number, slot):
                self._closed(handle, number)
                self._give_back(slot)
                received.append(Reply(number, None, ended=True))
                if number >= self._pass_first:
                    self._stream_ended(handle.wid)
            case Counted(counts):  # a worker's counts (remote reads); its batch's reply follows
                self.stats.add_counts(counts)
            case Skipped(number, samples):  # the batch's own reply follows in the same write
                self._skipped[number] = tuple(samples)
            case Ready():
                handle.ready = True
            case Attached():
                handle.attached = True
            case InitFailed(_, error):
                raise raised_in_worker(error, what=f"{handle.describe()} failed to start")

    def _closed(self, handle: WorkerHandle, number: int) -> object:
        """Task ``number`` is done (or failed): its indices. A leaving worker with none left
        open is told to stop."""
        indices = handle.closed(number)
        if handle.leaving and not handle.open:
            self._send(handle, framed(Stop()))
        return indices

    # -- resizing --------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The workers taking tasks (not those told to leave)."""
        return len(self._workers)

    def resize(self, workers: int) -> None:
        """Run ``workers`` workers (1 to ``max_workers``), once there is a ring: start new ones,
        or tell some to leave (those with the fewest open tasks, the highest ids first). Also
        forgets the workers that left since the last call."""
        self._forget_gone()
        workers = max(1, min(workers, self._max_workers))
        if self.ring is None or self._stopped:
            return
        while len(self._workers) < workers and self._grow():
            pass
        while len(self._workers) > workers:
            self._let_leave(min(self._workers, key=lambda h: (len(h.open), -h.wid)))
        self.stats.workers = len(self._workers)

    def _grow(self) -> bool:
        """Start a worker with the lowest id not in use, given the ring; False when every id
        is (workers still leaving hold theirs)."""
        used = {handle.wid for handle in (*self._workers, *self._leaving)}
        wid = next((wid for wid in range(self._max_workers) if wid not in used), None)
        if wid is None:
            return False
        if self._board is not None:
            self._board.clear(wid)
        assert self.ring is not None  # resized only once there is one
        handle = self._start(self._info(wid))
        self._workers.append(handle)
        self._send(handle, framed(MapRing(self.ring.spec)))
        return True

    def _let_leave(self, handle: WorkerHandle) -> None:
        """The worker takes no new task; it is sent ``Stop`` once its open tasks are done."""
        self._workers.remove(handle)
        self._leaving.append(handle)
        handle.leaving = True
        self.changes += 1
        if not handle.open:
            self._send(handle, framed(Stop()))

    def _forget_gone(self) -> None:
        """The leaving workers that have left: joined and forgotten (a process's exit is seen
        at once, by its sentinel: ``_left``; a thread's, here)."""
        for handle in [h for h in self._leaving if not h.open and not h.runner.is_alive()]:
            self._left(handle)

    def _left(self, handle: WorkerHandle) -> None:
        self._unwatch(handle)
        handle.close_pipes()
        end_workers([handle])
        self._leaving.remove(handle)

    def begin_pass(self, first_number: int) -> None:
        """A new pass starts with batch ``first_number``: every worker's stream starts again."""
        self._ended.clear()
        self._pass_first = first_number

    def _stream_ended(self, wid: int) -> None:
        """Worker ``wid`` has no batch left in this pass: the tasks go round the others, as
        torch's loader deals them, and the pass ends where the last one ended."""
        self._ended.add(wid)
        if len(self._ended) == len(self._workers):
            self.stream.end_pass()

    def _give_back(self, slot: int | None) -> None:
        """A task's ``slot`` is unused (None: it was sent before the ring, and takes none)."""
        if self.ring is not None:
            self.ring.unused(slot)

    # -- deaths --------------------------------------------------------------------------------
    def _died(self, handle: WorkerHandle, received: list[Reply]) -> None:
        """A worker process ended unasked: replace it, or say how and on which batch. A
        leaving worker that ended with no task open left as asked (or lost nothing): no death."""
        while handle.replies.fd >= 0 and self._events.watching(handle.replies.fd):
            self._receive(handle, received)  # its last words (an init error) explain more
        if handle.leaving and not handle.open:
            self._left(handle)
            return
        runner = handle.runner
        assert isinstance(runner, BaseProcess)  # a thread has no sentinel
        runner.join(JOIN_SECONDS)  # its sentinel closed: the exit status follows at once
        code = runner.exitcode
        out_of_memory = self._out_of_memory_kill(code)
        died = f"{handle.describe()} {describe_exit(code, out_of_memory)}"
        if not handle.ready and handle not in self._replacements:
            raise self._retired(handle, received, WorkerDied(
                f"{died} while starting ({handle.starting_stage(code)})", pid=handle.pid,
                exitcode=code, starting=True))
        building = self._building(handle)
        charged = building if its_own_doing(code, out_of_memory) else None
        died += self._what_it_held(handle, building)
        refusal = self._why_not_restart(charged)
        if refusal is None:
            self._restart(handle, died, building, charged)
            return
        queued = [self.stream.name(number) for number in sorted(handle.open) if number != building]
        if queued:
            died += f"; {', '.join(queued)} were queued for it"
        raise self._retired(handle, received, WorkerDied(died + refusal, pid=handle.pid,
                                                         exitcode=code))

    def _retired(self, dead: WorkerHandle, received: list[Reply], error: WorkerDied) -> WorkerDied:
        """``error``, with the dead worker out of the pool, so that a consumer may go on
        without it, as torch's DataLoader does: it gets no task again (in turn, its turns go
        to the next worker, as if its stream had ended), each of its unfinished batches
        becomes a reply with no batch, and these replies and the others read with its death
        wait for the next exchange."""
        self._unwatch(dead)
        dead.close_pipes()
        dead.accepting = False
        for number, (_, slot) in sorted(dead.open.items()):
            self._give_back(slot)
            received.append(Reply(number, None, ended=True))
        dead.open.clear()
        self._held += received
        if self._in_turn:
            self._stream_ended(dead.wid)
        return error

    def _out_of_memory_kill(self, code: int | None) -> bool | None:
        """Whether a worker killed by SIGKILL was the kernel's out-of-memory killer's doing: its
        count of kills rose since the last death (None where it cannot be read)."""
        seen, self._oom_kills = self._oom_kills, oom_kills()
        if code != -signal.SIGKILL or seen is None or self._oom_kills is None:
            return None
        return self._oom_kills > seen

    def _building(self, handle: WorkerHandle) -> int | None:
        """The batch the dead worker had begun and not finished, by its cell on the board; None
        if it had begun none of its tasks."""
        number = None if self._board is None else self._board.building(handle.wid)
        return number if number in handle.open else None

    def _what_it_held(self, handle: WorkerHandle, building: int | None) -> str:
        if not handle.ready:
            return " while starting, in place of a dead worker"
        if building is not None:
            return (f" while building {self.stream.name(building)} "
                    f"(sample indices {brief(handle.open[building][0])})")
        return " between batches"

    def _why_not_restart(self, charged: int | None) -> str | None:
        """None when the dead worker may be replaced, else what to tell the user."""
        if self._restarts <= 0:
            used = self.stats.restarts
            return f" (and worker_restarts={used} were used)" if used else ""
        if charged in self._killers:
            return ("; that batch had already killed a worker: a batch that kills its worker "
                    "twice is not sent again")
        return None

    def _restart(self, dead: WorkerHandle, died: str, building: int | None,
                 charged: int | None) -> None:
        """A new worker with the same id and seed, given the ring. The dead one's tasks go, in
        order and ahead of its own, to a live worker that has started, before the new one is
        started (the consumer waits for the first of them, and a started worker builds it
        sooner than one still starting: a spawned one takes 0.2 s), or, in turn (``in_turn``)
        or with none started, to the new one: every batch still arrives once. The batch it was
        ``building`` goes first. A worker that was leaving (``resize``) is not replaced: its
        tasks go to a live worker, started or not, and only with none left to one in its place.

        A death is ``charged`` to the batch being built only when the worker died of its own
        doing (see ``its_own_doing``): a batch charged twice is not sent again. A kill from
        outside (a user's ``kill``, a killer of random processes) lands on whatever is being
        built, and charged, it would soon judge an innocent batch poison."""
        self._restarts -= 1
        self.stats.restarts += 1
        if charged is not None:
            self._killers.add(charged)
        heir = None if self._in_turn else min(
            (h for h in self._workers if h.accepting and h is not dead and (h.ready or dead.leaving)),
            key=lambda h: (not h.ready, len(h.open)), default=None)
        replaced = heir is None or not dead.leaving  # one leaving was not to be replaced
        again = ("a new worker takes its place and builds its batches again" if replaced
                 else "other workers build its batches again")
        warn_user(f"{died}: {again} ({self._restarts} more "
                  f"{'restart' if self._restarts == 1 else 'restarts'} allowed)")
        if heir is not None:
            self._hand_over_tasks(dead, heir, building)
        if not replaced:
            dead.open.clear()
            self._left(dead)
            return
        replacement = self._replace(dead)
        if heir is None:
            self._hand_over_tasks(dead, replacement, building)

    def _hand_over_tasks(self, dead: WorkerHandle, heir: WorkerHandle,
                         first: int | None) -> None:
        """The dead worker's tasks, ahead of the heir's own: ``first`` first, the others in
        order."""
        for number in sorted(dead.open, key=lambda number: (number != first, number)):
            indices, slot = heir.open[number] = dead.open[number]
            self._send(heir, framed(Rebuild(number, slot, indices)))

    def _replace(self, dead: WorkerHandle) -> WorkerHandle:
        """The dead worker's replacement, started in its place and given the ring."""
        self._unwatch(dead)
        dead.close_pipes()
        end_workers([dead])
        assert self._board is not None  # processes only
        self._board.clear(dead.wid)
        handle = self._start(dead.info)
        self._replacements.discard(dead)
        self._replacements.add(handle)
        if dead.leaving:  # no worker was left to build its batches: one takes them
            self._leaving.remove(dead)
            self._workers.append(handle)
            self.stats.workers = len(self._workers)
        else:
            self._workers[self._workers.index(dead)] = handle
        if self.ring is not None:
            self._send(handle, framed(MapRing(self.ring.spec)))
        return handle

    def _unwatch(self, handle: WorkerHandle) -> None:
        for fd in (handle.replies.fd, handle.sentinel, handle.tasks.fd):
            self._events.unwatch(fd)

    @property
    def handles(self) -> list[WorkerHandle]:
        """The workers, by worker id (a replacement in its dead predecessor's place)."""
        return list(self._workers)

    def holder_of(self, number: int) -> str:
        """Which worker is building ``number``, for timeout messages."""
        for handle in (*self._workers, *self._leaving):
            if number in handle.open:
                return handle.describe()
        return "no worker (it was never dispatched: the ring has no free slot)"

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, grace: float = JOIN_SECONDS) -> None:
        """Ask the workers to leave after the batch in hand, give them ``grace`` seconds, then
        kill those still there. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._workers += self._leaving
        self._leaving.clear()
        try:
            for handle in self._workers:
                self._send(handle, framed(Stop()))
            self._drain_until_exited(time.monotonic() + grace)
        finally:
            self._events.close()
            for handle in self._workers:
                handle.close_pipes()
            end_workers(self._workers)
            if self._processes:
                release_starting_thread()
            if self._board is not None:
                self._board.close()

    def _drain_until_exited(self, deadline: float) -> None:
        """Read and drop late replies, so that no worker blocks on a full pipe while leaving."""
        while self._still_running() and time.monotonic() < deadline:
            for fd, (handler, handle) in self._events.wait(0.01):
                if handler == self._receive:
                    self._replies(handle)  # read and dropped
                elif handler == self._flush:
                    self._flush(handle, [])
                else:
                    self._events.unwatch(fd)  # the waker, or an exit

    def _still_running(self) -> bool:
        """Processes until their sentinel fired (it stays watched until then); live threads."""
        return any(h.runner.is_alive() if h.sentinel is None else self._events.watching(h.sentinel)
                   for h in self._workers)


_FROM_OUTSIDE = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def its_own_doing(code: int | None, out_of_memory: bool | None) -> bool:
    """Whether a worker that ended with exit ``code`` died of what it was doing: it exited, or
    crashed (SIGSEGV, SIGBUS, SIGABRT...), or the kernel killed it for the memory it took
    (``out_of_memory``; None: not known, and then it is assumed). A signal that is only ever
    sent from outside (SIGKILL but for the out-of-memory killer, SIGTERM, SIGINT...) is not."""
    if code is None or code >= 0:
        return True
    if -code == signal.SIGKILL:
        return out_of_memory is not False
    return -code not in _FROM_OUTSIDE


def describe_exit(code: int | None, out_of_memory: bool | None) -> str:
    if code is None or code >= 0:
        return f"exited with code {code}"
    killer = " (the kernel's out-of-memory killer)" if out_of_memory else ""
    return f"was killed by signal {signal.Signals(-code).name}{killer}"


def oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills since boot (Linux 4.13 and later); None where
    it cannot be read."""
    try:
        with open("/proc/vmstat", "rb") as vmstat:
            for line in vmstat:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def brief(indices: object) -> str:
    """Sample indices as an error message shows them: a dozen at most."""
    if indices is None:
        return "unknown"
    if isinstance(indices, np.ndarray):
        if indices.size <= 12:
            return str(indices.tolist())
        return np.array2string(indices, threshold=12, separator=", ")
    text = repr(indices)
    return text if len(text) <= 120 else text[:117] + "..."
