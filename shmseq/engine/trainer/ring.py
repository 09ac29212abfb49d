"""The shared-memory slot ring, and the one state machine that owns every slot's life.

::

    FREE -acquire-> DISPATCHED -written-> WRITTEN -lease-> LEASED -last view dies-> FREE
                      |  unused              |  discard       |  ... with copies still
                      +-------> FREE         +------> FREE    |      reading it
                                                              +-> COPYING -copies done-> FREE

A slot is FREE for the dispatcher, DISPATCHED to a worker, WRITTEN once the worker says so,
LEASED while anything delivered from it can be read (numpy views, torch tensors sharing
it), and COPYING while a device copy, or a copy the consumer enqueued from a page-locked
slot, may still read it. Every transition happens here, in the consumer's thread; a
transition the machine does not allow raises ``IllegalTransition``.

The ring answers every question about its slots, so that nothing else counts them: the slots
new tasks may take (``acquire_free``: the free ones, less those ``owe``d to batches built
before the ring, which take theirs with ``acquire_owed``, and never more than ``active`` in
use at once), whether the consumer may keep one more batch in place (``keep_in_place``: not
when it would hold every active slot), the most it held at once (``peak_held``), how long
the consumer may wait (``wait_bound``), and what to wait for once a lease dies (the device's
``fence``, and the copies ``track_copy`` was told of).

A ring is made with a ``capacity`` of slots (``spec.n_slots``) and uses ``active`` of them
(``set_active``, by the pipeline's tuning). The free list is a stack: the slots beyond the
active count are never popped while it holds, so their pages stay untouched and unreserved
(segments.py reserves the ring's first ``active`` slots; a writer allocates any other slot
as it first writes it).

Events from other threads (the last view of a lease dies wherever it is dropped; copies
complete on the releaser thread) are recorded and applied by the consumer's thread at its
next ``collect()``. A lease's death runs no Python code at all: its weakref callback is a C
call that records the slot (``dict.__setitem__``). Python code in a weakref callback is where a
Ctrl-C would be lost: the ``KeyboardInterrupt`` raised there is printed and dropped.

The ring's memory (the segment, its reservation, each process's mapping) is segments.py's.
"""
from __future__ import annotations

import enum
import functools
import queue
import threading
import weakref
from typing import Callable

import numpy as np

from ..common.errors import ShmSeqError
from ..common.protocol import Completion, Fence
from ..common.segments import RingSegment, RingSpec


class SlotState(enum.Enum):
    FREE = "free"
    DISPATCHED = "dispatched"
    WRITTEN = "written"
    LEASED = "leased"
    COPYING = "copying"


FREE, DISPATCHED, WRITTEN, LEASED, COPYING = SlotState


LEASE_POLL_SECONDS = 0.002


class IllegalTransition(ShmSeqError):
    """A slot was asked to move in a way that could rewrite it while in use, or lose it."""


_COPIED, _FAILED = "copied", "failed"


class Ring:
    """The state of every slot of the consumer's ring; its memory is ``segment``'s."""

    def __init__(self, segment: RingSegment, *, wake: Callable[[], None],
                 active: int | None = None) -> None:
        self.segment = segment
        self.spec: RingSpec = segment.spec
        self._states = [FREE] * self.spec.n_slots
        self._free = list(range(self.spec.n_slots - 1, -1, -1))  # a stack: slot 0 on top
        self._owed = 0  # free slots kept for batches built before the ring (``owe``)
        self.active = self.spec.n_slots  # slots in use at most: set_active
        self._inactive = 0  # capacity less active: free slots no task may take
        self.set_active(self.spec.n_slots if active is None else active)
        self.peak_held = 0  # the most slots handed over to the consumer at once
        self._leased = 0  # slots LEASED, kept with the states,
        self._held = 0  # and of those, the ones handed over to the consumer (``keep_in_place``)
        self._handed = bytearray(self.spec.n_slots)  # 1: that slot's lease is one of them
        self._leases: list[weakref.ref | None] = [None] * self.spec.n_slots
        self._copies: list[list[Completion]] = [[] for _ in range(self.spec.n_slots)]
        self._died: dict[int, weakref.ref] = {}  # slot -> its lease, dead, not collected yet
        self._on_death = [functools.partial(self._died.__setitem__, slot)
                          for slot in range(self.spec.n_slots)]  # a C call: see the docstring
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from the releaser's thread
        self._wake = wake
        self.fence: Fence | None = None  # the device's (``Device.attach``), set by the pipeline
        self._releaser: Releaser | None = None

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, *, wake: Callable[[], None],
               expected: int = 0, active: int | None = None) -> "Ring":
        """A new ring of ``n_slots`` (its capacity), ``active`` of them used (None: all), its
        name already unlinked, the active slots' memory being reserved (``wait_reserved``: the
        ``expected`` bytes of each slot, if given, see ``RingSpec``); ``SharedMemoryFull``
        when /dev/shm has not the room for them now. ``wake`` is called (from any thread) when
        a slot's lease dies or its copies complete."""
        active = n_slots if active is None else min(active, n_slots)
        return cls(RingSegment(n_slots, slot_bytes, expected, reserve=active), wake=wake,
                   active=active)

    def set_active(self, slots: int) -> None:
        """Use at most ``slots`` slots at once (1 to the capacity) from now on: a lower count
        takes effect as slots in use above it come free."""
        self.active = max(1, min(slots, self.spec.n_slots))
        self._inactive = self.spec.n_slots - self.active

    @property
    def address(self) -> int:
        """Where the ring is mapped in this process (for page-locking it)."""
        return self.segment.address

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s data lies inside this ring (the zero-copy check)."""
        return self.segment.contains(array)

    def region(self, slot: int) -> np.ndarray:
        """The slot's bytes, its pages allocated and mapped (for a writer in this process)."""
        return self.segment.region(slot)

    def state(self, slot: int) -> SlotState:
        return self._states[slot]

    # -- transitions: each method below is one arrow of the diagram ----------------------------
    def _move(self, slot: int, before: SlotState, after: SlotState) -> None:
        state = self._states[slot]
        if state is not before:
            raise IllegalTransition(f"slot {slot} is {state.value}: it cannot go from "
                                    f"{before.value} to {after.value}")
        self._states[slot] = after
        if after is FREE:
            self._free.append(slot)

    def owe(self, batches: int) -> None:
        """``batches`` were sent to the workers before the ring existed, without a slot: each
        may take one (``acquire_owed``) until it comes back without (``unused(None)``), and
        ``free_count`` leaves them one each meanwhile."""
        self._owed += batches

    def acquire(self) -> int | None:
        """A free slot, now dispatched to a writer; None when every slot is busy."""
        if not self._free:
            self.collect()
            if not self._free:
                return None
        slot = self._free.pop()
        self._move(slot, FREE, DISPATCHED)
        return slot

    def acquire_free(self) -> list[int]:
        """Every slot a new task may take now (``free_count``), each dispatched to a writer, in
        the order ``acquire`` would give them: the dispatcher asks once a step."""
        slots = []
        for _ in range(self.free_count()):
            slot = self._free.pop()
            self._move(slot, FREE, DISPATCHED)
            slots.append(slot)
        return slots

    def unsent(self, slots: list[int]) -> None:
        """Slots ``acquire_free`` gave that no task was sent with (the stream had none for them,
        or no worker takes tasks): free again, in the order they were."""
        for slot in reversed(slots):
            self._move(slot, DISPATCHED, FREE)

    def acquire_owed(self) -> int | None:
        """A free slot for a batch built before the ring, one of those kept for them; None
        when every slot is busy (the batch still owes one until it comes back)."""
        slot = self.acquire()
        if slot is not None:
            self._owed -= 1
        return slot

    def free_count(self) -> int:
        """Slots a new task may take now: the free ones, less those kept for batches built
        before the ring and those beyond the active count (after applying what other threads
        reported, if none was left)."""
        kept = self._owed + self._inactive
        if len(self._free) <= kept:
            self.collect()
        free = len(self._free) - kept
        return free if free > 0 else 0

    def has_news(self) -> bool:
        """Whether other threads reported something ``collect()`` has not applied yet."""
        return bool(self._died) or not self._events.empty()

    def wait_bound(self, timeout: float | None) -> float | None:
        """How long the consumer may wait for its workers now: not at all when something is
        to collect; at most ``LEASE_POLL_SECONDS`` when only a lease's death can free a slot
        (no slot is with a writer, whose reply would end the wait, and a death in another
        thread announces itself to nobody); else ``timeout``."""
        if self.has_news():
            return 0
        if self._leased and len(self._free) <= self._inactive and DISPATCHED not in self._states:
            return LEASE_POLL_SECONDS if timeout is None else min(timeout, LEASE_POLL_SECONDS)
        return timeout

    def written(self, slot: int) -> None:
        """The writer filled the slot."""
        self._move(slot, DISPATCHED, WRITTEN)

    def unused(self, slot: int | None) -> None:
        """The writer gave the slot back without a batch in it (an error, an overflow). None:
        a batch built before the ring came back without a slot; the one kept for it is free
        for new tasks."""
        if slot is None:
            self._owed -= 1
        else:
            self._move(slot, DISPATCHED, FREE)

    def discard(self, slot: int) -> None:
        """A written batch nobody will read (its epoch was left)."""
        self._move(slot, WRITTEN, FREE)

    def lease(self, slot: int) -> np.ndarray:
        """The slot's bytes for the consumer: leased until this array and every view of it die."""
        self._move(slot, WRITTEN, LEASED)
        self._leased += 1
        lease = self.segment.slot_bytes_of(slot)
        self._leases[slot] = weakref.ref(lease, self._on_death[slot])
        return lease

    def keep_in_place(self, slot: int) -> bool:
        """The consumer is handed the batch in leased ``slot``: whether it may keep it in place,
        which it may unless it would then hold every active slot of the ring (the workers
        would have none left: the batch is copied out instead). Either way the slot counts as
        the consumer's until its lease dies."""
        self._handed[slot] = 1
        self._held += 1
        if self._held > self.peak_held:
            self.peak_held = self._held
        return self._held < self.active

    def track_copy(self, slot: int, completion: Completion) -> None:
        """A copy out of a leased slot is in flight: the slot waits for it once the lease dies."""
        if self._states[slot] is not LEASED:
            raise IllegalTransition(f"slot {slot} is {self._states[slot].value}: only a leased "
                                    "slot can be copied from")
        self._copies[slot].append(completion)

    def collect(self) -> None:
        """Apply what happened since: leases that died, copies that completed.

        Raises ``ShmSeqError`` (with the cause) when a copy or a fence failed, and
        ``SharedMemoryFull`` when the ring's memory could not be reserved."""
        self._apply_reports()
        self.segment.reservation.check()

    def _apply_reports(self) -> None:
        """Each report is applied before it is forgotten, so that one interrupted between the
        two (a Ctrl-C) is seen again, and then found stale, at the next call."""
        while self._died:
            slot = next(iter(self._died))
            if self._leases[slot] is self._died[slot]:
                self._lease_ended(slot)
            del self._died[slot]
        while not self._events.empty():
            kind, slot, detail = self._events.get()
            if kind == _COPIED:
                self._move(slot, COPYING, FREE)
            else:
                raise ShmSeqError(f"waiting for a copy out of slot {slot} failed: "
                                  f"{type(detail).__name__}: {detail}") from detail

    def _lease_ended(self, slot: int) -> None:
        """The fence (a page-locking device's) is taken here, in the consumer's thread, on its
        current stream: it covers the ``non_blocking`` copies enqueued there from the slot."""
        try:
            fence = self.fence() if self.fence is not None else None
        except BaseException as exc:  # noqa: BLE001 - the slot stays leased: it may be read
            self._leases[slot] = None
            raise ShmSeqError(f"fencing the copies out of slot {slot} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        self._leases[slot] = None
        self._leased -= 1
        self._held -= self._handed[slot]
        self._handed[slot] = 0
        pending, self._copies[slot] = self._copies[slot], []
        if fence is not None:
            pending.append(fence)
        if not pending:
            self._move(slot, LEASED, FREE)
            return
        self._move(slot, LEASED, COPYING)
        if self._releaser is None:
            self._releaser = Releaser(self._events, self._wake)
        self._releaser.hold(slot, pending)

    def count(self, state: SlotState) -> int:
        """Slots in ``state`` (as of the last ``collect()``)."""
        return self._states.count(state)

    # -- the end -----------------------------------------------------------------------------
    def finish_copies(self) -> None:
        """Return once every copy still reading a slot has completed (or failed: the ring is
        closing, the failure no longer matters)."""
        while self.has_news():
            try:
                self._apply_reports()
            except ShmSeqError:
                pass
        if self._releaser is not None:
            self._releaser.stop()

    def wait_reserved(self) -> None:
        """Return once the whole ring is this process's; ``SharedMemoryFull`` if it cannot be."""
        self.segment.reservation.wait()

    def close(self) -> None:
        """Unmap: at once, or when the last view the consumer still holds dies.

        Leases still alive stop reporting back: nothing is left to free their slots to."""
        self.finish_copies()
        self._leases = [None] * self.spec.n_slots  # their callbacks go with them
        self._died.clear()
        self.segment.close()


class Releaser:
    """Waits, on a thread of its own, for the copies still reading slots, then frees them."""

    def __init__(self, events: queue.SimpleQueue, wake: Callable[[], None]) -> None:
        self._events = events
        self._wake = wake
        self._held: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="shmseq-releaser", daemon=True)
        self._thread.start()

    def hold(self, slot: int, completions: list[Completion]) -> None:
        self._held.put((slot, completions))

    def _run(self) -> None:
        while (item := self._held.get()) is not None:
            slot, completions = item
            try:
                for completion in completions:
                    completion()
                self._events.put((_COPIED, slot, None))
            except BaseException as exc:  # noqa: BLE001 - a sticky CUDA error, say
                self._events.put((_FAILED, slot, exc))
            del item, completions
            self._wake()

    def stop(self) -> None:
        """Return once every copy held has completed."""
        if self._thread.is_alive():
            self._held.put(None)
            self._thread.join()
