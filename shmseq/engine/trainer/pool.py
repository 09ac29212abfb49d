"""The consumer's side of the workers: each step's exchange, and what each reply means. No
thread of its own.

The consumer's thread drives the pool (``exchange``) at each of its steps (pipeline.py):

1. the stream's next batches go to the workers (dispatch.py: before there is a ring, one
   batch without a slot each, which sizes it; then one with each free slot of the ring);
2. it waits on every worker's reply pipe and process sentinel at once (and on the waker,
   which other threads use to cut the wait short), so that a worker that dies is reported
   at once, as ``concurrent.futures`` and ``loky`` do (deaths.py);
3. each reply (protocol.py's messages, matched by type in ``_handle``) becomes a ``Reply``:
   a batch written in its slot, an encoded batch (too large for its slot), or the worker's
   error.

Doing this in the consumer's thread spares two thread hand-offs per batch; the ring
bounds how far workers run ahead anyway, so nothing is lost while the consumer computes.

The pool can be resized once there is a ring (``resize``, asked by the pipeline's tuning): a
new worker takes the lowest free id; a worker told to leave takes no new task, and is sent
``Stop`` once its open tasks are done, its exit then no death (roster.py). Which batches there
are and their order do not depend on the workers: the stream and the ring decide them.
"""
from __future__ import annotations

import functools
from multiprocessing.context import BaseContext

from ..common.errors import raised_in_worker
from ..common.hooks import WorkerStart
from ..common.protocol import (Attached, Built, Counted, Done, Ended, Failed, FromWorker,
                               InitFailed, Noted, Overflow, Ready, Reply, Skipped)
from .deaths import Deaths, brief
from .dispatch import PACK_BELOW_S, Dispatch, FirstBatches, Pace, SlotDispatch
from .plan import BatchStream
from .ring import Ring
from .roster import Roster, Watched
from .stats import LoaderStats
from .waker import Events, Waker
from .worker_handle import JOIN_SECONDS, MAPPED, READY, STARTING, WorkerHandle

__all__ = ["PACK_BELOW_S", "Pace", "Reply", "WorkerPool"]  # the last three: tests/test_convert.py


class WorkerPool:
    """Starts the workers, feeds them free slots, collects their replies, watches them, and
    (``restarts`` > 0) replaces a worker process that dies, sending its batches again.

    Worker ``k`` is seeded with ``base_seed + k``. ``in_turn``: batch ``k`` of an epoch goes to
    worker ``k % num_workers``, as torch's DataLoader deals them."""

    def __init__(self, worker: object, *, num_workers: int, n_slots: int, backend: str,
                 context: BaseContext, stream: BatchStream, waker: Waker, stats: LoaderStats,
                 base_seed: int = 0, start: WorkerStart = WorkerStart(),
                 restarts: int = 0, in_turn: bool = False, open_in_turn: int | None = None,
                 max_workers: int | None = None) -> None:
        """``max_workers``: the most workers ``resize`` may run (None: ``num_workers``); each
        worker's ``WorkerInfo.num_workers`` says it."""
        self.stream = stream
        self.stats = stats
        self._waker = waker
        self._stopped = False
        self._skipped: dict[int, tuple] = {}  # batch number -> what its worker left out
        self._noted: dict[int, object] = {}  # batch number -> what its worker noted with it
        self._events = Events()
        self._events.watch(waker.fileno(), (Watched.WAKER, None))
        self._roster = Roster(worker, backend=backend, context=context,
                              start=start,
                              max_workers=num_workers if max_workers is None else max_workers,
                              base_seed=base_seed, waker=waker, events=self._events, stats=stats)
        self._dispatch = Dispatch(self._roster, stream, stats, in_turn, n_slots, open_in_turn)
        self._stage: FirstBatches | SlotDispatch = FirstBatches(self._dispatch, n_slots)
        self._deaths = Deaths(self._roster, self._dispatch, stats, restarts)
        try:
            self._roster.start_all(num_workers)
        except BaseException:
            self.stop()  # a start failed: stop those that did start
            raise

    # -- the ring ------------------------------------------------------------------------------
    def use_ring(self, ring: Ring) -> None:
        """Send the ring to every worker, which maps it, and give the batches they hold slots."""
        first = self._stage
        assert isinstance(first, FirstBatches), "the ring is given once"
        self._stage = first.slots(ring)

    def built_sizes(self) -> list[int]:
        """The sizes of the batches built without a slot, waiting for a ring to hold them
        (none once there is one)."""
        stage = self._stage
        return stage.sizes() if isinstance(stage, FirstBatches) else []

    def started(self, mapped: bool = True) -> bool:
        """Every worker built its worker object and (``mapped``), once there is a ring, mapped
        it."""
        return all(self._stage.started(h, mapped) for h in self._roster.working)

    def which_not_started(self, mapped: bool = True) -> str:
        return ", ".join(h.describe() for h in self._roster.working
                         if not self._stage.started(h, mapped))

    # -- the consumer's thread -----------------------------------------------------------------
    def exchange(self, timeout: float | None, waiting: int, read: bool = True) -> list[Reply]:
        """Read the replies there, give the workers what they can build, and return the
        replies: if none was there, the first within ``timeout`` s (None: until something
        happens). ``waiting``: the deliveries the consumer has not taken yet (see
        ``dispatch.Pace``). ``read=False``: the consumer has its batch, the workers are only
        given free slots (replies left in the pipes are read at its next look).

        Raises what went wrong with a worker (it died, or failed to start)."""
        stage = self._stage
        if not read:
            stage.send_tasks(waiting)
            return []
        ready = self._events.wait(0)
        received = self._handle_ready(ready) if ready else []
        if self._deaths.held:  # after reading: a death raised there holds what came with it
            received = self._deaths.pop_held() + received
        waiting += len(received)
        waits = not ready and not received and timeout != 0
        if timeout != 0:  # the consumer looks for a batch not delivered yet
            pace = self._dispatch.pace
            pace.n_slots = stage.n_slots
            pace.follow(waiting, waited=waits)
        stage.send_tasks(waiting)
        if not waits:
            return received
        self._waker.waiting = True  # first: what another thread reports after the look wakes us
        try:
            return self._handle_ready(self._events.wait(stage.wait_bound(timeout)))
        finally:
            self._waker.waiting = False

    def _handle_ready(self, ready: list[tuple[int, tuple]]) -> list[Reply]:
        received: list[Reply] = []
        for fd, handler in ready:
            if not self._events.current(fd, handler):  # a replaced worker's
                continue
            watched, handle = handler
            if watched is Watched.REPLIES:
                self._receive(handle, received)
            elif watched is Watched.WRITABLE:
                self._roster.flush(handle)
            elif watched is Watched.EXITED:
                self._deaths.died(handle, received, self._stage, self._receive)
            else:
                self._waker.drain()
        return received

    def _receive(self, handle: WorkerHandle, received: list[Reply]) -> None:
        """Every reply the worker has sent so far."""
        for message in self._roster.read(handle):
            self._handle(handle, message, received)

    def _handle(self, handle: WorkerHandle, message: FromWorker, received: list[Reply]) -> None:
        match message:
            case Done(number, slot, _, busy, cpu, idle):
                self._closed(handle, number)
                stats = self.stats
                stats.worker_busy_s += busy
                stats.worker_cpu_s += cpu
                stats.worker_idle_s += idle
                self._stage.written(slot)
                received.append(Reply(number, slot, skipped=self._skipped.pop(number, ()),
                                      noted=self._noted.pop(number, None)))
            case Overflow(number, slot, payload, busy, cpu):
                self._closed(handle, number)
                self.stats.worker_busy_s += busy
                self.stats.worker_cpu_s += cpu
                overflowed = self._stage.overflowed(slot, payload)
                received.append(Reply(number, None, payload, overflowed=overflowed,
                                      skipped=self._skipped.pop(number, ()),
                                      noted=self._noted.pop(number, None)))
            case Failed(number, slot, error):
                indices = self._closed(handle, number)
                self._stage.give_back(slot)
                what = (f"{handle.describe()} failed on {self.stream.name(number)} "
                        f"(sample indices {brief(indices)})")
                received.append(Reply(number, None, error=functools.partial(
                    raised_in_worker, error, what=what, batch_indices=indices,
                    batch_number=number)))
            case Built(number, size):  # held by its worker until it is given a slot (or none)
                self._stage.built(handle, number, size)
            case Ended(number, slot):
                self._closed(handle, number)
                self._stage.give_back(slot)
                received.append(Reply(number, None, ended=True,
                                      noted=self._noted.pop(number, None)))
                if number >= self._dispatch.pass_first:
                    self._dispatch.stream_ended(handle.wid)
            case Counted(counts):  # a worker's counts (remote reads); its batch's reply follows
                self.stats.add_counts(counts)
            case Skipped(number, samples):  # the batch's own reply follows in the same write
                self._skipped[number] = tuple(samples)
            case Noted(number, state):  # the batch's own reply follows in the same write
                self._noted[number] = state
            case Ready():
                if handle.state is STARTING:  # else it was told to leave meanwhile
                    handle.move(READY)
            case Attached():
                if handle.state is READY:  # else it was told to leave meanwhile
                    handle.move(MAPPED)
            case InitFailed(_, error):
                raise raised_in_worker(error, what=f"{handle.describe()} failed to start")

    def _closed(self, handle: WorkerHandle, number: int) -> object:
        """Task ``number`` is done (or failed): its indices. A leaving worker with none left
        open is told to stop."""
        indices = handle.closed(number)
        self._roster.stop_if_done(handle)
        return indices

    def begin_pass(self, first_number: int, first_worker: int = 0) -> None:
        """A new pass starts with batch ``first_number`` (given in turn to ``first_worker``):
        every worker's stream starts again."""
        self._dispatch.begin_pass(first_number, first_worker)

    # -- resizing --------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The workers taking tasks (not those told to leave)."""
        return len(self._roster.working)

    @property
    def changes(self) -> int:
        """Workers started or told to leave so far: a tuning window with a change in it
        describes no one count of workers."""
        return self._roster.changes

    @property
    def leaving(self) -> list[WorkerHandle]:
        """The workers told to leave that have not gone yet."""
        return list(self._roster.leaving)

    def resize(self, workers: int) -> None:
        """Run ``workers`` workers (1 to ``max_workers``), once there is a ring: start new ones,
        or tell some to leave (those with the fewest open tasks, the highest ids first). Also
        forgets the workers that left since the last call."""
        roster = self._roster
        roster.forget_gone()
        stage = self._stage
        if not isinstance(stage, SlotDispatch) or self._stopped:
            return
        workers = max(1, min(workers, roster.max_workers))
        while len(roster.working) < workers and (handle := roster.grow()) is not None:
            stage.joined(handle)
        while len(roster.working) > workers:
            roster.let_leave(min(roster.working, key=lambda h: (len(h.open), -h.wid)))
        self.stats.workers = len(roster.working)

    @property
    def handles(self) -> list[WorkerHandle]:
        """The workers, by worker id (a replacement in its dead predecessor's place)."""
        return list(self._roster.working)

    def holder_of(self, number: int) -> str:
        """Which worker is building ``number``, for timeout messages."""
        return self._roster.holder_of(number)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, grace: float = JOIN_SECONDS) -> None:
        """Ask the workers to leave after the batch in hand, give them ``grace`` seconds, then
        kill those still there. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._roster.stop(grace)
