"""The running pipeline: plan -> workers -> ring -> device -> the consumer, and its closing.

A front end (``ShmSequence``, the torch-style ``DataLoader``) describes what to run in a
``PipelineSpec`` and starts a ``Pipeline`` (workers) or an ``Inline`` runtime (everything in
the calling thread). Then, for each epoch (or pass of a sampler), it ``open``s the epoch
and ``take``s its batches by number. A runtime never refers back to its front end, and nothing
in it sits in a reference cycle, so that a front end nobody references any more closes it by
its finalizer at once, without the garbage collector. ``close()`` works from any thread.

The ring is sized without a lone first batch: with no ``slot_bytes`` given, the first batch of
each worker is built at once by all of them, each held by its worker, and the first size told
sizes the ring; each worker then writes its batch into a slot, as every batch after it. With
no ``buffer`` given, its slots are counted by the tuning rules (tuning.py): made for the most
workers it may have, used for those it has (control.py keeps the count up to date).
"""
from __future__ import annotations

import contextlib
import enum
import functools
import multiprocessing
import os
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, NoReturn, TypeVar

from ..common.errors import BatchTimeout, PipelineClosed, ShmSeqError
from ..common.layout import slot_bytes_for
from ..common.protocol import Delivery, Hooks, Plan
from .control import Control
from .convert import Converter, HandOver, OrderedOutput
from .cursor import PAST_THE_END, Cursor
from .deaths import brief
from .inline import Inline
from .plan import BatchStream
from .pool import WorkerPool
from .ring import Ring
from .spec import PipelineSpec
from .stats import LoaderStats
from .tuning import ring_capacity, ring_slots
from .waker import Waker
from .worker_handle import JOIN_SECONDS

ERROR_GRACE = 0.2  # seconds workers get to leave once a failure was raised, before they are killed
T = TypeVar("T")


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value); None: no deadline."""
    return None if deadline is None else deadline - time.monotonic()


class Phase(enum.Enum):
    SIZING = "sizing"    # the workers build their first batches, held: no ring yet
    RUNNING = "running"  # every batch goes through the ring's slots
    CLOSED = "closed"


SIZING, RUNNING, CLOSED = Phase
_MOVES = {SIZING: {RUNNING, CLOSED}, RUNNING: {CLOSED}, CLOSED: set()}


class _ConsumersTurn:
    """The consumer's lock, in the process that made the pipeline only, taken once per call; a
    failure raised while it is held (but for the pipeline's closing) leaves the workers no time
    to finish politely when it closes (``broken``).

    A forked child has copies of the slots' states and of the parent's ends of the workers'
    pipes: taking a batch there would read the parent's replies and hand its slots to the
    workers behind its back (the parent then fails with ``IllegalTransition``). So the child
    is refused before anything is touched, the lock included: held by a thread of the parent
    at the fork, it would never be released in the child."""

    def __init__(self, owner: int, fresh_start: str) -> None:
        self.lock = threading.RLock()
        self._owner = owner
        self._fresh_start = fresh_start
        self.broken = False

    def refuse_inherited(self) -> None:
        if os.getpid() != self._owner:
            self._refuse()

    def _refuse(self) -> NoReturn:
        raise ShmSeqError(
            f"this sequence's pipeline belongs to process {self._owner}, which started its "
            f"workers and ring; a forked child (pid {os.getpid()}) cannot iterate it: "
            f"{self._fresh_start}")

    def __enter__(self) -> None:
        if os.getpid() != self._owner:  # refuse_inherited, inline: taken once per batch
            self._refuse()
        self.lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.lock.release()
        if kind is not None and not issubclass(kind, PipelineClosed):
            self.broken = True


class Pipeline:
    """Workers, ring, route, and their closing, in three phases: ``SIZING`` (until the first
    batches sized the ring, or at once with ``slot_bytes``), ``RUNNING``, ``CLOSED``."""

    def __init__(self, spec: PipelineSpec, plan: Plan, epoch: int = 0, position: int = 0,
                 stats: LoaderStats | None = None) -> None:
        self._owner = os.getpid()  # a forked child inherits the pipeline, not its ownership
        self.plan = plan
        self.spec = spec
        self.stats = LoaderStats() if stats is None else stats
        self.phase = SIZING
        self.ring: Ring | None = None  # for those who look: there from RUNNING on
        self.pool: WorkerPool | None = None
        self._turn = _ConsumersTurn(self._owner, spec.hooks.fresh_start)  # held by the consumer while it takes a batch
        self._ends = contextlib.ExitStack()  # closes the device and the ring, once made
        self.waker = Waker()
        self.output = OrderedOutput()
        self.stream = BatchStream(plan, epoch, position)
        try:
            device = spec.make_device()
            self._ends.callback(device.close)
            self.device = device
            self.converter: HandOver = HandOver(device, self.output, self.stats, self.stream.name)
            self.control = self._control()
            self._collect: Callable[[], None] = _nothing  # the ring's, once there is one
            self._look: Callable[[float], None] = self.control.tick  # and, once there is a
            # ring, the tuning's
            self.pool = WorkerPool(spec.worker, num_workers=spec.num_workers,
                                   n_slots=spec.buffer or spec.num_workers + 2,
                                   backend=spec.thread_type,
                                   context=multiprocessing.get_context(spec.start_method),
                                   stream=self.stream, waker=self.waker, stats=self.stats,
                                   base_seed=spec.base_seed, start=spec.worker_start,
                                   restarts=spec.restarts, in_turn=spec.hooks.deal_in_turn,
                                   open_in_turn=spec.hooks.open_in_turn,
                                   max_workers=spec.max_workers)
            if spec.slot_bytes is not None:
                self._run_up_front(spec.slot_bytes)
            elif not spec.hooks.start_lazily:
                self._start(spec.timeout, mapped=False)
        except BaseException:
            self._turn.broken = True
            self.close()
            raise

    def _move(self, phase: Phase) -> None:
        if phase not in _MOVES[self.phase]:
            raise ShmSeqError(f"the pipeline is {self.phase.value}: it never becomes "
                              f"{phase.value} from there")
        self.phase = phase

    # -- the ring ---------------------------------------------------------------------------------
    def _run_up_front(self, slot_bytes: int) -> None:
        """The ring of ``slot_bytes`` slots, made now and reserved while the workers start,
        which map it as they do."""
        ring = self._new_ring(slot_bytes)
        self._run(ring)
        if not self.spec.hooks.start_lazily:
            self._start(self.spec.timeout, mapped=True)
            ring.wait_reserved()

    def _start(self, timeout: float | None, mapped: bool) -> None:
        """Return once every worker built its worker object and (``mapped``: the ring was made
        up front) mapped the ring, and there is a ring (or the first batch failed: it is
        raised at its turn). A ring sized by the first batches is made once the first of them
        was built; each worker maps it once its own first batch is built, and it is reserved
        while they are written and delivered: the first batch waits for neither, and a failure
        is raised at the next step."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pool = self.pool
        assert pool is not None  # made before the workers are waited for
        while not pool.started(mapped) or (
                self.phase is SIZING and not self.output.waiting and self.stream.peek() is not None):
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise ShmSeqError(self._not_started(pool, timeout, mapped))
            self._step(timeout=remaining)

    def _not_started(self, pool: WorkerPool, timeout: float | None, mapped: bool) -> str:
        """Why ``start()`` gave up: the workers that did not start, or, once every one has, that
        no first batch was built yet (the ring is sized by the first one), and who builds the
        first: a slow first batch (a shard fetched over a slow link, a slow decode) otherwise
        read as a list of nobody."""
        late = pool.which_not_started(mapped)
        if late:
            return f"the workers did not start within timeout={timeout} s: {late}"
        return (f"the workers did not start within timeout={timeout} s: each started, but none "
                "has built its first batch yet, which the ring is sized by; the first, "
                f"{self.stream.name(0)}, is with {pool.holder_of(0)}: a first batch that "
                "takes longer needs a longer timeout=")

    def _control(self) -> Control:
        spec = self.spec
        threads = spec.thread_type == "thread"
        device_counts = Hooks(self.device).pop_counts
        if spec.max_workers is None:
            return Control(self.stats, None, sizes_ring=spec.buffer is None,
                           thread_workers=threads, device_counts=device_counts)
        return Control.auto(self.stats, start_workers=spec.num_workers,
                            max_workers=spec.max_workers, cpu_budget=spec.cpu_budget,
                            memory_budget=spec.memory_budget,
                            sizes_ring=spec.buffer is None, thread_workers=threads,
                            device_counts=device_counts)

    def _new_ring(self, slot_bytes: int, expected: int = 0) -> Ring:
        """``buffer`` slots, or as many as the tuning rules make a ring with, those for the
        workers running now in use (the consumer assumed to hold one batch until seen). It is
        closed after the device, and its copies finished before."""
        spec, wake = self.spec, self.waker.wake_if_waiting
        if spec.buffer is not None:
            ring = Ring.create(spec.buffer, slot_bytes, wake=wake, expected=expected)
        else:
            capacity = ring_capacity(slot_bytes, spec.max_workers or spec.num_workers,
                                     spec.memory_budget)
            ring = Ring.create(capacity, slot_bytes, wake=wake, expected=expected,
                               active=ring_slots(slot_bytes, spec.num_workers, 1, capacity))
        ends = contextlib.ExitStack()  # run last to first
        ends.callback(ring.close)
        ends.push(self._ends.pop_all())  # the device's
        ends.callback(ring.finish_copies)
        self._ends = ends
        return ring

    def _run(self, ring: Ring) -> None:
        """RUNNING, with ``ring``: the device attaches it, the workers map it, and the batches
        they hold are given slots."""
        pool = self.pool
        assert pool is not None  # made with the pipeline
        ring.fence = self.device.attach(ring)
        self.converter = Converter(self.device, ring, self.output, self.stats, self.stream.name)
        pool.use_ring(ring)
        self._collect = ring.collect
        self._look = functools.partial(self.control.look, pool=pool, ring=ring)
        self.ring = ring
        self._move(RUNNING)

    def _sized_by(self, sizes: list[int]) -> None:
        """The first batches were built (no ring yet): the ring is made to hold them, and room
        for larger ones that is allocated only if one comes."""
        if sizes:
            self._run(self._new_ring(slot_bytes_for(max(sizes)), expected=max(sizes)))

    # -- the consumer's step ----------------------------------------------------------------------
    def _step(self, take: Callable[[], T | None] | None = None,
              timeout: float | None = 0) -> T | None:
        """One pass of the consumer: collect the slots freed since the last one; deliver what
        ``take()`` finds ready, the workers then given the free slots with the next batches;
        otherwise exchange with the workers (free slots for their replies there, or for the
        first within ``timeout`` s; None: until one comes), convert what arrived, and deliver
        what ``take()`` finds now (None: nothing yet), the pass counted as the consumer's wait.
        Without ``take``, the consumer asks for nothing: the workers are given work."""
        pool = self.pool
        assert pool is not None  # made with the pipeline
        try:
            now = time.perf_counter()
            if now >= self.control.due:
                self._look(now)
            self._collect()  # slots freed, and copies failed, in other threads
            if take is not None and (found := take()) is not None:
                pool.exchange(0, self.output.waiting, read=False)
                return found
            replies = pool.exchange(timeout, self.output.waiting)
            if self.phase is SIZING:
                self._sized_by(pool.built_sizes())
            arrive = self.converter.arrive
            for reply in replies:
                arrive(reply)
            if take is None:
                return None
            self.stats.consumer_wait_s += time.perf_counter() - now
            return take() if replies else None
        except Exception:
            self.output.check()  # closed meanwhile (a signal handler, another thread): say so
            raise

    # -- the consumer's side ---------------------------------------------------------------------
    @property
    def inherited(self) -> bool:
        """Whether this process is a forked child of the one that made the pipeline."""
        return os.getpid() != self._owner

    def _consumers_turn(self) -> threading.RLock:
        """The consumer's lock, without ``broken`` kept (see ``_ConsumersTurn``)."""
        self._turn.refuse_inherited()
        return self._turn.lock

    def open(self, epoch: int, position: int = 0, batches: Iterable | None = None,
             first_worker: int = 0) -> int:
        """The consumer starts ``epoch`` at ``position`` (with the plan's ``batches`` for it,
        when given; dealt in turn from ``first_worker``): the number of that batch. Deliveries
        of earlier epochs are dropped, and the workers are given the epoch's first batches at
        once."""
        with self._consumers_turn():
            self.output.check()
            number = self.stream.open(epoch, position, batches)
            self.output.drop_below(number)
            assert self.pool is not None  # made with the pipeline
            self.pool.begin_pass(number, first_worker)
            self._step()  # the workers start on the epoch's first batches at once
            return number

    def batches(self, epoch: int, position: int = 0) -> Iterator[object]:
        """The batches of ``epoch`` from ``position`` on, in order."""
        yield from Cursor(self, epoch, position)

    def take(self, number: int, epoch: int, position: int) -> object:
        """Batch ``number`` (``position`` of ``epoch``), as the consumer gets it; ``PAST_THE_END``
        when ``epoch`` has no batch at ``position`` (asked of the plan only when the stream has
        not dispatched it: it has no such batch, or its epoch's end is not known yet)."""
        def take() -> Delivery | None:
            if self.stream.number_of(epoch, position) is None and \
                    self.plan.batch(epoch, position) is None:
                return PAST_THE_END
            return self.output.pop(number)
        with self._turn:
            delivery = self._first_ready(take, epoch, position)
            if delivery is PAST_THE_END:
                return PAST_THE_END
            self.plan.release(epoch, position + 1)
            return self.converter.hand_over(number, delivery)

    def receive(self, number: int, epoch: int, position: int) -> Delivery:
        """The delivery of batch ``number`` (``position`` of ``epoch``): from the output if it is
        there, else once the pool brings it. Raises what keeps it from coming (a timeout, a
        worker's death, the pipeline closed)."""
        with self._turn:
            delivery = self._first_ready(
                lambda: self.output.pop(number) or self._past_the_end(epoch, position), epoch,
                position)
            self.plan.release(epoch, position + 1)
        return delivery

    def receive_any(self, first_number: int, epoch: int, position: int) -> tuple[int, Delivery]:
        """The delivery of number ``first_number`` or after that arrived first, and its number (an
        epoch's batches in the order they are ready); ``position`` is ``first_number``'s."""
        def take() -> tuple[int, Delivery] | None:
            found = self.output.pop_first(first_number, self.stream.end_of(epoch))
            if found is not None:
                return found
            ended = self._past_the_end(epoch, position)
            return None if ended is None else (first_number, ended)
        with self._turn:
            return self._first_ready(take, epoch, position)

    def ended_past(self, number: int) -> list[Delivery]:
        """The ended streams' deliveries from batch ``number`` on, past a pass's end: the
        consumer reads no batch there, but their workers' notes are its to keep."""
        with self._turn:
            return self.output.pop_ended(number)

    def _past_the_end(self, epoch: int, position: int) -> Delivery | None:
        """An ended delivery for a batch its pass will never have (a stream's pass ended
        before it, once every worker's stream did), else None."""
        return Delivery(None, ended=True) if self.plan.batch(epoch, position) is None else None

    def _first_ready(self, take: Callable[[], T | None], epoch: int, position: int) -> T:
        """What ``take()`` finds in the output, at the consumer's first step or once its steps
        brought it (in the consumer's turn)."""
        deadline = None if self.spec.timeout is None else time.monotonic() + self.spec.timeout
        while (found := self._step(take, _remaining(deadline))) is None:
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                self._timed_out(epoch, position)
        return found

    def hand_over(self, number: int, delivery: Delivery) -> object:
        """The batch as the consumer gets it; raises the batch's error (its worker's exception)
        in its place."""
        with self._turn:
            return self.converter.hand_over(number, delivery)

    def release(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position`` (``receive_any``'s)."""
        self.plan.release(epoch, position)

    def _timed_out(self, epoch: int, position: int) -> NoReturn:
        number = self.stream.number_of(epoch, position)
        assert self.pool is not None  # made with the pipeline
        raise BatchTimeout(
            f"batch {position} of epoch {epoch} (sample indices "
            f"{brief(self.plan.batch(epoch, position))}) did not arrive within timeout="
            f"{self.spec.timeout} s; it is with "
            f"{self.pool.holder_of(number) if number is not None else 'no worker yet'}")

    def replan(self) -> None:
        """The plan changed (a new seed): batches planned so far are stale."""
        with self._consumers_turn():
            self.stream.reset(self.stream.state())

    def workers(self) -> list:
        """The workers running now, as ``multiprocessing`` or ``threading`` made them (a front
        end's tools join and watch them)."""
        assert self.pool is not None  # made with the pipeline
        return [handle.runner for handle in self.pool.handles]

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wake a waiting consumer, then stop the workers, wait for copies in flight, close the
        device and unmap the ring: every step runs even if one before it fails.

        In a forked child, nothing: the workers, the ring and the pipes are the parent's (a
        stop frame would stop its workers); the child's copies of the descriptors and mappings
        go with its objects, or with its exit."""
        if self.inherited:
            return
        self.output.close("the sequence was finished or restarted while iterating")
        self.waker.wake()
        with self._turn.lock:
            if self.phase is CLOSED:
                return
            self._move(CLOSED)
            with contextlib.ExitStack() as steps:  # run last to first
                steps.callback(self.waker.close)
                steps.push(self._ends)  # the ring's copies, the device, the ring
                if self.pool is not None:
                    grace = ERROR_GRACE if self._turn.broken else JOIN_SECONDS
                    steps.callback(self.pool.stop, grace)
                steps.callback(self.output.clear)


def _nothing() -> None:
    """Nothing to collect before there is a ring."""


Runtime = Pipeline | Inline


def closing_finalizer(front_end: object, runtime: Runtime) -> weakref.finalize:
    """What closes ``runtime`` when ``front_end`` dies, or when called (``finish()``), in the
    process that made it only: a forked child that inherited the front end leaves it alone."""
    return weakref.finalize(front_end, _close_in_owner, runtime, os.getpid())


def _close_in_owner(runtime: Runtime, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        runtime.close()
