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

Events from other threads (the last view of a lease dies wherever it is dropped; copies
complete on the releaser thread) are queued and applied by the consumer's thread at its
next ``collect()``, so no lock is ever taken inside a weakref callback.

The consumer creates the ring once and unlinks its name at once: workers map it through the
consumer's descriptor (``/proc/PID/fd/N``), so a trainer killed at any moment leaves nothing in
/dev/shm. The ring's memory is reserved as soon as it exists, slot by slot in the order they
are first used, on a thread of the consumer (``_Reservation``): the first batch need not wait
for the whole ring, ``start()`` returns once all of it is the sequence's, and no write can
later find /dev/shm full. Each writer maps a slot's pages in one call the first time it writes
the slot (``MADV_POPULATE_WRITE``), rather than a page fault at a time while the batch is
written; the consumer's reads fault in 16 pages at a time. Segments are made with posix_ipc so
that Python's resource tracker never warns about, or unlinks, a segment in use. A closed ring
unmaps at once, or, when the consumer still holds views, the moment the last of them dies
(until then it is listed, with its size, in the ``SharedMemoryFull`` a new ring would raise).
Forked workers give back every ring they inherited (``drop_inherited_rings``): a worker maps
its own ring and nothing else.
"""
from __future__ import annotations

import ctypes
import enum
import errno
import functools
import mmap
import os
import queue
import secrets
import threading
import weakref
from typing import Callable, NamedTuple

import numpy as np
import posix_ipc

from .errors import SharedMemoryFull, ShmSeqError

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
NAME_PREFIX = "shmseq-"
_MAP_FLAGS = mmap.MAP_SHARED  # no MAP_POPULATE: a writer maps a slot's pages as it first writes it
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels fault the pages in as they are written


class RingSpec(NamedTuple):
    """What a worker needs to attach the ring (picklable): the consumer's descriptor of it."""
    name: str
    n_slots: int
    slot_bytes: int
    owner_pid: int = -1
    owner_fd: int = -1

    @property
    def stride(self) -> int:
        return -(-self.slot_bytes // PAGE) * PAGE

    @property
    def total_bytes(self) -> int:
        return self.stride * self.n_slots


def shm_free_bytes() -> int:
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


# -- what holds /dev/shm, for the user who finds it full ----------------------------------------
_held_here: dict[str, tuple] = {}  # ring name -> (bytes, what it is, [its mapping's weakref])


def _hold(name: str, size: int, what: str, *watch: weakref.ref) -> None:
    _held_here[name] = (size, what, *watch)


def _let_go(name: str, *_) -> None:
    _held_here.pop(name, None)


def _refuse_space(asked: int, what: str) -> SharedMemoryFull:
    """The error for ``asked`` bytes /dev/shm could not give: how many were missing, and what
    holds the space (this process's rings, a finished one's views among them; other programs)."""
    stats = os.statvfs(SHM_DIR)
    free, total = shm_free_bytes(), stats.f_blocks * stats.f_frsize
    ours = sum(size for size, *_ in _held_here.values())
    holders = "; ".join(f"{size:,} by {what}" for size, what, *_ in _held_here.values())
    held = (f"this process's shmseq rings hold {ours:,} bytes ({holders}) and other programs "
            f"{max(total - free - ours, 0):,}" if _held_here else
            f"other programs hold {total - free:,}")
    finished = any(len(entry) > 2 for entry in _held_here.values())  # watched till unmapped
    return SharedMemoryFull(
        f"{what} needs {asked:,} bytes of shared memory but {SHM_DIR} has {free:,} free of "
        f"{total:,} ({max(asked - free, 0):,} missing): {held}. Give the container more "
        "(docker run --shm-size=...), " + ("drop the batches of finished sequences, "
                                           if finished else "") + "or lower buffer or slot_bytes")


# -- what a forked worker must not keep -----------------------------------------------------------
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE = 0, 0x10, 0x4000  # Linux's values on x86 and ARM
_MAP_FAILED = ctypes.c_void_p(-1).value
_RING_PATH = f"{SHM_DIR}/{NAME_PREFIX}"


def drop_inherited_rings() -> None:
    """In a forked worker, before anything else: give back every ring inherited from the
    consumer, its mappings and the descriptors ``mmap`` keeps, so that a sequence's memory is
    freed when it finishes even while other sequences' workers run.

    Each is replaced rather than removed: a mapping by an inaccessible reservation of the same
    addresses, a descriptor by /dev/null. An inherited object that later unmaps or closes what
    it thinks it owns then touches the placeholder, never something this worker made since.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    with open("/proc/self/maps") as maps:
        ranges = [line.split(maxsplit=1)[0] for line in maps if _RING_PATH in line]
    for bounds in ranges:
        start, end = (int(bound, 16) for bound in bounds.split("-"))
        if libc.mmap(start, end - start, _PROT_NONE, flags, -1, 0) in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "cannot give back an inherited ring mapping")
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(_RING_PATH):
                    os.dup2(null, int(fd))
            except OSError:
                pass  # closed meanwhile (the listing's own descriptor)
    finally:
        os.close(null)


def unlinked_segment(name: str, size: int = 0) -> posix_ipc.SharedMemory:
    """A new segment whose name is gone already: nothing of it can be left in /dev/shm, and it
    lives as long as a descriptor or a mapping of it (workers reach it by ``owners_segment``)."""
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    segment.unlink()
    return segment


def owners_segment(owner_pid: int, owner_fd: int) -> int:
    """A descriptor of the unlinked segment the consumer ``owner_pid`` holds as ``owner_fd``."""
    return os.open(f"/proc/{owner_pid}/fd/{owner_fd}", os.O_RDWR)


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def _populate(address: int, size: int) -> None:
    """Map ``size`` bytes at ``address`` into this process's page tables in one call, not a
    fault a page; nothing where the kernel cannot (they are then faulted in as they are
    touched). Through ctypes, which lets go of the GIL (``mmap.madvise`` holds it)."""
    _madvise()(address, size, _MADV_POPULATE_WRITE)


class _SlotPages:
    """A process's mapping of the ring, each slot's pages mapped the first time it is used."""

    def __init__(self, spec: RingSpec, memory: mmap.mmap, fd: int):
        self.spec = spec
        self._memory = memory
        self._array = np.frombuffer(memory, np.uint8)
        self._fd = fd
        self._mapped = bytearray(spec.n_slots)  # 1: populated in this process

    def region(self, slot: int) -> np.ndarray:
        """The slot's bytes, its pages allocated and mapped."""
        start = slot * self.spec.stride
        if not self._mapped[slot]:
            self._allocate(slot)
            _populate(self._array.ctypes.data + start, self.spec.stride)
            self._mapped[slot] = 1
        return self._array[start:start + self.spec.slot_bytes]

    def _allocate(self, slot: int) -> None:
        """Allocate the slot's pages unless the whole ring is (a page /dev/shm could not supply
        would kill its writer with SIGBUS): it may be used before the reservation reaches it."""
        if os.fstat(self._fd).st_blocks * 512 >= self.spec.total_bytes:
            return
        stride = self.spec.stride
        try:
            os.posix_fallocate(self._fd, slot * stride, stride)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise _refuse_space(stride, f"slot {slot} of the ring") from exc
            raise


class WorkerRing(_SlotPages):
    """A worker's mapping of the ring: the slots it writes."""

    def __init__(self, spec: RingSpec):
        fd = owners_segment(spec.owner_pid, spec.owner_fd)
        try:
            memory = mmap.mmap(fd, spec.total_bytes, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(spec, memory, fd)

    def close(self) -> None:
        self._array = None
        os.close(self._fd)
        try:
            self._memory.close()
        except BufferError:
            pass  # a batch of the worker's still views it: unmapped when that dies
        self._memory = None


class _Reservation:
    """Allocates the ring's pages on a thread of its own, slot by slot in the order they are
    first used (0.09 s for a 385 MB ring here: the first batch waits for its slot, not all of
    them). The consumer's own mapping is left to fault in as it reads: a read fault maps 16
    pages at once, which costs no more than mapping them ahead."""

    def __init__(self, spec: RingSpec, fd: int):
        self.error: SharedMemoryFull | None = None
        self._allocated = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(spec, fd),
                                        name="shmseq-reservation", daemon=True)
        self._thread.start()

    def _run(self, spec: RingSpec, fd: int) -> None:
        try:
            self.error = self._allocate(spec, fd)
        finally:
            self._allocated.set()

    @staticmethod
    def _allocate(spec: RingSpec, fd: int) -> SharedMemoryFull | None:
        for slot in range(spec.n_slots):
            try:
                os.posix_fallocate(fd, slot * spec.stride, spec.stride)
            except OSError as exc:
                error = _refuse_space((spec.n_slots - slot) * spec.stride,
                                      f"the slot ring ({spec.n_slots} slots of {spec.stride:,} "
                                      f"bytes; {slot} reserved)")
                error.__cause__ = exc
                return error
        return None

    def wait(self) -> None:
        """Return once the whole ring is allocated; raise ``SharedMemoryFull`` if it could not be."""
        self._allocated.wait()
        self.check()

    def join(self) -> None:
        self._thread.join()

    def check(self) -> None:
        """Raise the reservation's failure, if it failed already."""
        if self.error is not None:
            raise self.error


# -- the consumer's ring -------------------------------------------------------------------------
class SlotState(enum.Enum):
    FREE = "free"
    DISPATCHED = "dispatched"
    WRITTEN = "written"
    LEASED = "leased"
    COPYING = "copying"


FREE, DISPATCHED, WRITTEN, LEASED, COPYING = SlotState


class IllegalTransition(ShmSeqError):
    """A slot was asked to move in a way that could rewrite it while in use, or lose it."""


_DIED, _COPIED, _FAILED = "died", "copied", "failed"
Completion = Callable[[], None]  # blocks until a copy reading the slot is done; may raise


def _lease_died(events: queue.SimpleQueue, wake: Callable[[], None], fence, slot: int,
                _lease: weakref.ref) -> None:
    """The last view of a lease is gone (in whatever thread dropped it): no lock here.

    ``fence`` (a page-locking device's) returns a completion for copies the consumer may have
    enqueued from the slot (a ``non_blocking`` copy from page-locked memory)."""
    try:
        events.put((_DIED, slot, fence() if fence is not None else None))
    except BaseException as exc:  # noqa: BLE001 - reported at the next batch, not swallowed
        events.put((_FAILED, slot, exc))
    wake()


class Ring(_SlotPages):
    """The consumer's mapping of the ring, and the state of every slot."""

    def __init__(self, spec: RingSpec, memory: mmap.mmap, segment, *, wake: Callable[[], None]):
        super().__init__(spec, memory, segment.fd)
        self._segment = segment  # its descriptor stays open: workers map the ring through it
        self._reservation = _Reservation(spec, segment.fd)
        _hold(spec.name, spec.total_bytes, "a live sequence's ring")
        self._states = [FREE] * spec.n_slots
        self._free = list(range(spec.n_slots - 1, -1, -1))
        self.leased = 0  # slots LEASED, kept with the states
        self._leases: list[weakref.ref | None] = [None] * spec.n_slots
        self._copies: list[list[Completion]] = [[] for _ in range(spec.n_slots)]
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = wake
        self._fence: Callable[[], Completion] | None = None
        self._on_death: list[Callable] | None = None  # each slot's lease callback
        self._releaser: Releaser | None = None

    @property
    def fence(self) -> Callable[[], Completion] | None:
        """Set by a device that page-locks the ring (see devices.py)."""
        return self._fence

    @fence.setter
    def fence(self, fence: Callable[[], Completion] | None) -> None:
        self._fence, self._on_death = fence, None

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, **options) -> "Ring":
        """A new ring, its name already unlinked, its memory being reserved (``wait_reserved``);
        ``SharedMemoryFull`` when /dev/shm has not the room for it now."""
        name = f"/{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        spec = RingSpec(name, n_slots, slot_bytes)
        if spec.total_bytes > shm_free_bytes():
            raise _refuse_space(spec.total_bytes, f"the slot ring ({n_slots} slots of "
                                                  f"{spec.stride:,} bytes)")
        segment = unlinked_segment(name)
        try:
            os.ftruncate(segment.fd, spec.total_bytes)
            memory = mmap.mmap(segment.fd, spec.total_bytes, flags=_MAP_FLAGS)
        except BaseException:
            segment.close_fd()
            raise
        return cls(spec._replace(owner_pid=os.getpid(), owner_fd=segment.fd), memory, segment,
                   **options)

    @property
    def address(self) -> int:
        """Where the ring is mapped in this process (for page-locking it)."""
        return self._array.ctypes.data

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s data lies inside this ring (the zero-copy check)."""
        start = self.address
        pointer = array.__array_interface__["data"][0]
        return start <= pointer and pointer + array.nbytes <= start + len(self._array)

    # -- transitions: each method below is one arrow of the diagram ----------------------------
    def _move(self, slot: int, before: SlotState, after: SlotState) -> None:
        state = self._states[slot]
        if state is not before:
            raise IllegalTransition(f"slot {slot} is {state.value}: it cannot go from "
                                    f"{before.value} to {after.value}")
        self._states[slot] = after
        if after is FREE:
            self._free.append(slot)

    def acquire(self) -> int | None:
        """A free slot, now dispatched to a writer; None when every slot is busy."""
        if not self._free:
            self.collect()
            if not self._free:
                return None
        slot = self._free.pop()
        self._move(slot, FREE, DISPATCHED)
        return slot

    def has_free(self) -> bool:
        return bool(self._free) or not self._events.empty()

    def free_count(self) -> int:
        """Slots free now (after applying what other threads reported, if none was)."""
        if not self._free:
            self.collect()
        return len(self._free)

    def has_news(self) -> bool:
        """Whether other threads reported something ``collect()`` has not applied yet."""
        return not self._events.empty()

    def written(self, slot: int) -> None:
        """The writer filled the slot."""
        self._move(slot, DISPATCHED, WRITTEN)

    def unused(self, slot: int) -> None:
        """The writer gave the slot back without a batch in it (an error, an overflow)."""
        self._move(slot, DISPATCHED, FREE)

    def discard(self, slot: int) -> None:
        """A written batch nobody will read (its epoch was left)."""
        self._move(slot, WRITTEN, FREE)

    def lease(self, slot: int) -> np.ndarray:
        """The slot's bytes for the consumer: leased until this array and every view of it die."""
        self._move(slot, WRITTEN, LEASED)
        self.leased += 1
        if self._on_death is None:
            self._on_death = [functools.partial(_lease_died, self._events, self._wake, self._fence,
                                                each) for each in range(self.spec.n_slots)]
        # Made from the mapping itself: numpy sets the base of every view of it to it, and a
        # view of a view would skip the intermediate array, freeing the slot under the view.
        lease = np.frombuffer(self._memory, np.uint8, count=self.spec.slot_bytes,
                              offset=slot * self.spec.stride)
        self._leases[slot] = weakref.ref(lease, self._on_death[slot])
        return lease

    def track_copy(self, slot: int, completion: Completion) -> None:
        """A copy out of a leased slot is in flight: the slot waits for it once the lease dies."""
        if self._states[slot] is not LEASED:
            raise IllegalTransition(f"slot {slot} is {self._states[slot].value}: only a leased "
                                    "slot can be copied from")
        self._copies[slot].append(completion)

    def collect(self) -> None:
        """Apply what happened in other threads: leases that died, copies that completed.

        Raises ``ShmSeqError`` (with the cause) when a copy or a fence failed, and
        ``SharedMemoryFull`` when the ring's memory could not be reserved."""
        self._reservation.check()
        while not self._events.empty():
            kind, slot, detail = self._events.get()
            if kind == _DIED:
                self._lease_ended(slot, detail)
            elif kind == _COPIED:
                self._move(slot, COPYING, FREE)
            else:
                raise ShmSeqError(f"waiting for a copy out of slot {slot} failed: "
                                  f"{type(detail).__name__}: {detail}") from detail

    def _lease_ended(self, slot: int, fence: Completion | None) -> None:
        self._leases[slot] = None
        self.leased -= 1
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
                self.collect()
            except ShmSeqError:
                pass
        if self._releaser is not None:
            self._releaser.stop()

    def wait_reserved(self) -> None:
        """Return once the whole ring is this process's; ``SharedMemoryFull`` if it cannot be."""
        self._reservation.wait()

    def close(self) -> None:
        """Unmap: at once, or when the last view the consumer still holds dies.

        Leases still alive stop reporting back: nothing is left to free their slots to."""
        self.finish_copies()
        self._reservation.join()
        self._segment.close_fd()
        self._leases = [None] * self.spec.n_slots
        self._on_death = None
        self._array = None
        memory, self._memory = self._memory, None
        try:
            memory.close()
        except BufferError:  # views alive: the mapping goes with the last of them
            _hold(self.spec.name, self.spec.total_bytes,
                  "a finished sequence's ring, kept by batches of it still referenced",
                  weakref.ref(memory, functools.partial(_let_go, self.spec.name)))
        else:
            _let_go(self.spec.name)


class Releaser:
    """Waits, on a thread of its own, for the copies still reading slots, then frees them."""

    def __init__(self, events: queue.SimpleQueue, wake: Callable[[], None]):
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
