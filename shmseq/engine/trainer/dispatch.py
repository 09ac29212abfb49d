"""Who builds which batch: the stream's next batches handed to the workers, with the ring's
free slots once there is a ring, and what becomes of a task's slot.

Two stages, one after the other (the pool holds the one it is in):

* ``FirstBatches``: before there is a ring (its slot size is not known yet), each worker gets
  one batch at a time without a slot, builds it and tells its size, and holds it: the first
  sizes the ring (``sizes``).
* ``SlotDispatch``, made with the ring: each free slot goes with the next batch down a
  worker's task pipe; the batches the workers hold are given a slot (``Place``) at once.

Both choose the worker the same way (``Dispatch.choose``), following the consumer's pace.
"""
from __future__ import annotations

import numpy as np

from ..common.errors import ShmSeqError
from ..common.protocol import MapRing, Place
from ..common.wire import build_frame, framed
from .plan import BatchStream, Task
from .ring import Ring
from .roster import Roster
from .stats import LoaderStats
from .worker_handle import MAPPED, WorkerHandle


class NoRingYet(ShmSeqError):
    """A worker replied with a slot before there was a ring: the protocol was broken."""


PACK_BELOW_S = 0.002  # batches built faster than this are packed on one worker (Pace.packs): 16
# latency-bound workers (21 ms a batch) ran at one worker's rate for a second after each epoch
# began, its first batches queued on one worker, where cifar's (a copy well under 1 ms) ran
# 1.7x faster packed than spread (python -m shmseq.bench --autotune, ring-cifar, 6 slots)


class Pace:
    """Which side is slower: the consumer, once it looked for a batch not delivered yet and
    found replies that left half the ring or more waiting for it, until it has to wait for a
    batch again. Its tasks are then packed on one worker (see ``Dispatch.choose``), if
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


class Dispatch:
    """Sends tasks to the workers. ``in_turn``: batch ``k`` of an epoch goes to worker
    ``k % num_workers``, as torch's DataLoader deals them (a worker's random stream then meets
    the same batches as under torch's loader); with ``open_in_turn``, to the next worker round
    the cycle that holds fewer than its share of that many open batches, as torch's loader
    deals them with ``in_order=False``."""

    def __init__(self, roster: Roster, stream: BatchStream, stats: LoaderStats,
                 in_turn: bool, n_slots: int, open_in_turn: int | None = None) -> None:
        self.roster = roster
        self.stream = stream
        self.stats = stats
        self.in_turn = in_turn
        self.open_in_turn = open_in_turn
        self.pace = Pace(n_slots)
        self._turn = 0  # the worker after the last one given a task in turn
        self._first_worker = 0  # the worker given the pass's first batch, in turn
        self._ended: set[int] = set()  # workers whose stream ended in this pass
        self.pass_first = 0  # the number of the pass's first batch

    def choose(self, task: Task, pack: bool) -> WorkerHandle | None:
        """The worker for a task; None if none takes tasks (gone: their sentinels say why).

        In turn (``in_turn``): worker ``position % num_workers`` (counted from the pass's first
        worker: a resumed pass goes on with the worker that was next), or the next one that takes
        tasks; once a worker's stream ended, the next one round the cycle whose stream has not
        (torch's order for an ``IterableDataset``). Else the least-busy worker that has started
        (a replacement still starting, 0.2 s when spawned, would hold up the batches given to
        it): the work is spread. But while the consumer is the slower side (``pack``), tasks all
        go to the first worker that takes tasks, awake most often, where the least-busy one
        would be a sleeping one woken for each batch; on small batches the wake-ups cost more
        than the batches themselves."""
        workers = self.roster.working
        if self.in_turn:  # a worker's id is its place
            first = (self._turn if self._ended or self.open_in_turn is not None else
                     (task.position + self._first_worker) % len(workers))
            room = self._room(len(workers))
            for at in (*range(first, len(workers)), *range(first)):
                handle = workers[at]
                if handle.accepting and at not in self._ended and len(handle.open) < room:
                    return handle
            return None
        taking = [handle for handle in workers if handle.accepting]
        if not taking:
            return None
        return taking[0] if pack else min(taking, key=lambda h: (not h.started, len(h.open)))

    def _room(self, workers: int) -> float:
        """The open batches a worker may hold when dealt in turn: its share of
        ``open_in_turn`` among the workers whose stream goes on; else no bound."""
        if self.open_in_turn is None:
            return float("inf")
        return self.open_in_turn // max(1, workers - len(self._ended))

    def send(self, chosen: WorkerHandle, task: Task, slot: int | None) -> None:
        """Task ``task`` to ``chosen``, with ``slot`` (None: without one), taken from the
        stream."""
        if self.in_turn:
            self._turn = (chosen.wid + 1) % len(self.roster.working)  # a worker's id is its place
        chosen.open[task.number] = (task.indices, slot)
        self.roster.send(chosen, build_frame(task.number, slot, task.indices))  # a Build
        self.stream.advance()

    def begin_pass(self, first_number: int, first_worker: int = 0) -> None:
        """A new pass starts with batch ``first_number``, given in turn to ``first_worker``:
        every worker's stream starts again."""
        self._ended.clear()
        self.pass_first = first_number
        self._first_worker = self._turn = first_worker

    def stream_ended(self, wid: int) -> None:
        """Worker ``wid`` has no batch left in this pass: the tasks go round the others, as
        torch's loader deals them, and the pass ends where the last one ended."""
        self._ended.add(wid)
        if len(self._ended) == len(self.roster.working):
            self.stream.end_pass()


class FirstBatches:
    """Before the ring: one batch without a slot to each worker that has none, while fewer than
    ``n_slots`` deliveries (failures: nothing else comes before the ring) wait for the
    consumer. Each batch built is held by its worker, its size told (``Built``)."""

    def __init__(self, dispatch: Dispatch, n_slots: int) -> None:
        self.dispatch = dispatch
        self._n_slots = n_slots
        self.held: list[tuple[WorkerHandle, int, int]] = []  # (worker, number, bytes)

    def sizes(self) -> list[int]:
        """The sizes of the batches built, waiting for a ring to hold them."""
        return [size for _, _, size in self.held]

    def send_tasks(self, waiting: int) -> None:
        stream = self.dispatch.stream
        while waiting < self._n_slots and (task := stream.peek()) is not None:
            chosen = self.dispatch.choose(task, pack=False)
            if chosen is None or chosen.open:
                return
            self.dispatch.send(chosen, task, None)

    @property
    def n_slots(self) -> int:
        """The slots the ring is expected to have (for the consumer's pace)."""
        return self._n_slots

    def built(self, handle: WorkerHandle, number: int, size: int) -> None:
        self.held.append((handle, number, size))

    def give_back(self, slot: int | None) -> None:
        """A task sent without a slot came back without a batch: nothing to give back."""

    def written(self, slot: int) -> None:
        raise NoRingYet(f"slot {slot} was written before there was a ring")

    def overflowed(self, slot: int | None, payload: np.ndarray) -> bool:
        raise NoRingYet("a batch came back encoded before there was a ring")

    def wait_bound(self, timeout: float | None) -> float | None:
        return timeout

    def joined(self, handle: WorkerHandle) -> None:
        """A worker started before the ring: it maps it with the others, once there is one."""

    def started(self, handle: WorkerHandle, mapped: bool) -> bool:
        """Whether the worker built its worker object (there is no ring to map yet)."""
        return handle.started

    def slots(self, ring: Ring) -> "SlotDispatch":
        """The stage that follows, with ``ring``: every worker maps it, and the batches held
        are given slots. The ring keeps a slot for each batch sent before it existed, built
        or not yet."""
        roster = self.dispatch.roster
        ring.owe(sum(slot is None for h in roster.working for _, slot in h.open.values()))
        for handle in roster.working:
            roster.send(handle, framed(MapRing(ring.spec)))
        after = SlotDispatch(self.dispatch, ring)
        for held in self.held:
            after.built(*held)
        return after


class SlotDispatch:
    """With the ring: each free slot with the next batch of the stream; each batch built
    without a slot (before the ring) given one at once; a task's slot given back when it comes
    back without a batch in it."""

    def __init__(self, dispatch: Dispatch, ring: Ring) -> None:
        self.dispatch = dispatch
        self.ring = ring

    @property
    def n_slots(self) -> int:
        """The ring's slots in use (for the consumer's pace)."""
        return self.ring.active

    def send_tasks(self, waiting: int) -> None:
        """Send the next batches of the stream with the free slots the ring gives new tasks,
        asked for once: those the stream has no batch for now, or no worker takes, go back."""
        dispatch, ring = self.dispatch, self.ring
        slots = ring.acquire_free()
        if not slots:
            return
        stats = dispatch.stats
        pack = dispatch.pace.packs(stats.worker_busy_s, stats.batches)
        for at, slot in enumerate(slots):
            task = dispatch.stream.peek()
            chosen = None if task is None else dispatch.choose(task, pack)
            if chosen is None:
                ring.unsent(slots[at:])
                return
            assert task is not None  # the one chosen for
            dispatch.send(chosen, task, slot)

    def built(self, handle: WorkerHandle, number: int, size: int) -> None:
        """Give the batch its worker holds a free slot if it fits one, else none (it then comes
        back encoded: as an overflow, or as it came where the ring has fewer slots than
        workers). A dead worker's is not placed: its heir builds it again."""
        if not handle.accepting:  # gone
            return
        ring = self.ring
        slot = ring.acquire_owed() if size <= ring.spec.slot_bytes else None
        if slot is not None:
            handle.open[number] = (handle.open[number][0], slot)
        self.dispatch.roster.send(handle, framed(Place(number, slot)))

    def give_back(self, slot: int | None) -> None:
        """A task's ``slot`` is unused (None: the task was sent before the ring)."""
        self.ring.unused(slot)

    def written(self, slot: int) -> None:
        self.ring.written(slot)

    def overflowed(self, slot: int | None, payload: np.ndarray) -> bool:
        """A batch came back encoded: its slot is free again. Whether it overflowed (one without
        a slot was built before the ring and given none: larger than a slot, an overflow too, or
        none was free, a ring with fewer slots than workers)."""
        self.ring.unused(slot)
        return slot is not None or len(payload) > self.ring.spec.slot_bytes

    def wait_bound(self, timeout: float | None) -> float | None:
        return self.ring.wait_bound(timeout)

    def joined(self, handle: WorkerHandle) -> None:
        """A worker started while there is a ring: it maps it."""
        self.dispatch.roster.send(handle, framed(MapRing(self.ring.spec)))

    def started(self, handle: WorkerHandle, mapped: bool) -> bool:
        """Whether the worker built its worker object and (``mapped``) maps the ring."""
        return handle.state is MAPPED if mapped else handle.started

