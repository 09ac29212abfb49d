"""The ring's memory: one shared-memory segment, how each process maps it, and who holds it.

The consumer makes the segment and unlinks its name at once (``unlinked_segment``): workers map
it through the consumer's descriptor (``/proc/PID/fd/N``, ``owners_segment``), so a trainer
killed at any moment leaves nothing in /dev/shm. Its memory is reserved as soon as it exists,
slot by slot in the order they are first used, on a thread of the consumer (``Reservation``):
the first batch need not wait for the whole ring, a writer allocates a slot the thread has not
reached yet, and no write can find /dev/shm full. A ring sized by its first batches is
allocated as far as they took in each slot (``RingSpec.expected``); the room left for larger
batches, only when one comes. Each writer maps a slot's pages in one call the first time it
writes the slot (``MADV_POPULATE_WRITE``), rather than a page fault at a
time while the batch is written; the consumer's reads fault in 16 pages at a time. Segments are
made with posix_ipc so that Python's resource tracker never warns about, or unlinks, a segment
in use. A ring closed while the consumer still holds views of it stays mapped until the last of
them dies, and is listed meanwhile, with its size, in the ``SharedMemoryFull`` a new ring would
raise. Forked workers give back every ring they inherited (``drop_inherited_rings``): a worker
maps its own ring and nothing else.

What each slot is doing (free, written, leased...) is not this module's business: ring.py.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import secrets
import threading
import weakref
from typing import Callable, NamedTuple

import numpy as np
import posix_ipc

from .errors import SharedMemoryFull

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
NAME_PREFIX = "shmseq-"
_MAP_FLAGS = mmap.MAP_SHARED  # no MAP_POPULATE: a writer maps a slot's pages as it first writes it
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels fault the pages in as they are written


class RingSpec(NamedTuple):
    """What a worker needs to attach the ring (picklable): the consumer's descriptor of it.
    ``expected``: the bytes of a slot its batches are expected to take (0: all of them), which
    are allocated up front; the rest of a slot only once a batch needs it (a ring sized by its
    first batches leaves room for larger ones that may never come)."""
    name: str
    n_slots: int
    slot_bytes: int
    owner_pid: int = -1
    owner_fd: int = -1
    expected: int = 0

    @property
    def stride(self) -> int:
        return -(-self.slot_bytes // PAGE) * PAGE

    @property
    def total_bytes(self) -> int:
        return self.stride * self.n_slots

    @property
    def reserved(self) -> int:
        """The bytes of each slot allocated up front."""
        return min(self.stride, -(-self.expected // PAGE) * PAGE) if self.expected else self.stride

    @property
    def reserved_bytes(self) -> int:
        """The bytes of the ring allocated up front."""
        return self.reserved * self.n_slots


def shm_free_bytes() -> int:
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


# -- what holds /dev/shm, for the user who finds it full ----------------------------------------
_held_here: dict[str, tuple] = {}  # ring name -> (bytes, what it is, [its mapping's weakref])
# The weakref's callback is ``_held_here.pop(name, the_weakref)``: a C call, so that no Ctrl-C can
# be raised, and lost, inside it (see ring.py).


def _hold(name: str, size: int, what: str, *watch: weakref.ref) -> None:
    _held_here[name] = (size, what, *watch)


def _let_go(name: str) -> None:
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
def _madvise() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def _populate(address: int, size: int) -> None:
    """Map ``size`` bytes at ``address`` into this process's page tables in one call, not a
    fault a page; nothing where the kernel cannot (they are then faulted in as they are
    touched). Through ctypes, which lets go of the GIL (``mmap.madvise`` holds it)."""
    _madvise()(address, size, _MADV_POPULATE_WRITE)


class SlotPages:
    """A process's mapping of the ring, each slot's pages mapped the first time it is used."""

    def __init__(self, spec: RingSpec, memory: mmap.mmap, fd: int) -> None:
        self.spec = spec
        self._memory: mmap.mmap | None = memory  # None once closed
        self._array: np.ndarray | None = np.frombuffer(memory, np.uint8)
        self._fd = fd
        self._mapped = bytearray(spec.n_slots)  # 1: populated in this process
        self._whole = bytearray(spec.n_slots)  # 1: a batch needed the whole slot (``whole``)

    def region(self, slot: int) -> np.ndarray:
        """The slot's bytes batches are expected to take (``RingSpec.expected``; all of them
        once one needed more), its pages allocated and mapped."""
        start, reserved = slot * self.spec.stride, self.spec.reserved
        array = self._array
        assert array is not None, "the ring is closed"
        if not self._mapped[slot]:
            self._allocate(slot, start, reserved)
            _populate(array.ctypes.data + start, reserved)
            self._mapped[slot] = 1
        size = self.spec.slot_bytes if self._whole[slot] else min(reserved, self.spec.slot_bytes)
        return array[start:start + size]

    def whole(self, slot: int) -> np.ndarray:
        """The whole slot, for a batch larger than expected: the rest of it allocated first."""
        if not self._whole[slot]:
            reserved = self.spec.reserved
            self._allocate(slot, slot * self.spec.stride + reserved, self.spec.stride - reserved)
            self._whole[slot] = 1
        return self.region(slot)

    def _allocate(self, slot: int, start: int, size: int) -> None:
        """Allocate ``size`` bytes of the slot from ``start`` unless the whole ring is (a page
        /dev/shm could not supply would kill its writer with SIGBUS): the slot may be used before
        the reservation reaches it."""
        if not size or os.fstat(self._fd).st_blocks * 512 >= self.spec.total_bytes:
            return
        try:
            os.posix_fallocate(self._fd, start, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise _refuse_space(size, f"slot {slot} of the ring") from exc
            raise


class WorkerRing(SlotPages):
    """A worker's mapping of the ring: the slots it writes."""

    def __init__(self, spec: RingSpec) -> None:
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
        assert self._memory is not None, "the ring is closed already"
        try:
            self._memory.close()
        except BufferError:
            pass  # a batch of the worker's still views it: unmapped when that dies
        self._memory = None


class Reservation:
    """Allocates the ring's pages on a thread of its own, slot by slot in the order they are
    first used (0.09 s for a 385 MB ring here: the first batch waits for its slot, not all of
    them). The consumer's own mapping is left to fault in as it reads: a read fault maps 16
    pages at once, which costs no more than mapping them ahead."""

    def __init__(self, spec: RingSpec, fd: int, slots: int) -> None:
        self.error: SharedMemoryFull | None = None
        self._allocated = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(spec, fd, slots),
                                        name="shmseq-reservation", daemon=True)
        self._thread.start()

    def _run(self, spec: RingSpec, fd: int, slots: int) -> None:
        try:
            self.error = self._allocate(spec, fd, slots)
        finally:
            self._allocated.set()

    @staticmethod
    def _allocate(spec: RingSpec, fd: int, slots: int) -> SharedMemoryFull | None:
        for slot in range(slots):
            try:
                os.posix_fallocate(fd, slot * spec.stride, spec.reserved)
            except OSError as exc:
                error = _refuse_space((slots - slot) * spec.reserved,
                                      f"the slot ring ({spec.n_slots} slots of {spec.stride:,} "
                                      f"bytes; {slot} reserved)")
                error.__cause__ = exc
                return error
        return None

    def wait(self) -> None:
        """Return once the slots to reserve are allocated; raise ``SharedMemoryFull`` if they
        could not be."""
        self._allocated.wait()
        self.check()

    def join(self) -> None:
        self._thread.join()

    def check(self) -> None:
        """Raise the reservation's failure, if it failed already: a new exception each time,
        since one kept here would keep the frames it was raised through (and the batches they
        hold) until a garbage collection."""
        if self.error is not None:
            raise SharedMemoryFull(*self.error.args) from self.error.__cause__




class RingSegment(SlotPages):
    """The consumer's segment: made, its first ``reserve`` slots reserved (None: all of them;
    a writer allocates any other as it first writes it), mapped; unmapped at close, or with
    the last view."""

    def __init__(self, n_slots: int, slot_bytes: int, expected: int = 0,
                 reserve: int | None = None) -> None:
        name = f"/{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        spec = RingSpec(name, n_slots, slot_bytes, expected=expected)
        reserve = n_slots if reserve is None else min(reserve, n_slots)
        if spec.reserved * reserve > shm_free_bytes():
            raise _refuse_space(spec.reserved * reserve, f"the slot ring ({reserve} slots of "
                                                         f"{spec.stride:,} bytes)")
        segment = unlinked_segment(name)
        try:
            os.ftruncate(segment.fd, spec.total_bytes)
            memory = mmap.mmap(segment.fd, spec.total_bytes, flags=_MAP_FLAGS)
        except BaseException:
            segment.close_fd()
            raise
        super().__init__(spec._replace(owner_pid=os.getpid(), owner_fd=segment.fd), memory,
                         segment.fd)
        self._segment = segment  # its descriptor stays open: workers map the ring through it
        self.reservation = Reservation(spec, segment.fd, reserve)
        _hold(spec.name, spec.reserved * reserve, "a live sequence's ring")

    @property
    def address(self) -> int:
        """Where the ring is mapped in this process (for page-locking it)."""
        assert self._array is not None, "the ring is closed"
        return self._array.ctypes.data

    @property
    def mapped(self) -> bool:
        """Whether this process still maps the ring through this object (until ``close``)."""
        return self._memory is not None

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s data lies inside this ring (the zero-copy check)."""
        start, size = self.address, self.spec.total_bytes
        pointer = array.__array_interface__["data"][0]
        return start <= pointer and pointer + array.nbytes <= start + size

    def slot_bytes_of(self, slot: int) -> np.ndarray:
        """A new array of the slot's bytes, made from the mapping itself: numpy sets the base of
        every view of it to it (a view of a view would skip the intermediate array), so that
        the slot is in use exactly as long as this array or any view of it lives."""
        assert self._memory is not None, "the ring is closed"
        return np.frombuffer(self._memory, np.uint8, count=self.spec.slot_bytes,
                             offset=slot * self.spec.stride)

    def close(self) -> None:
        """Unmap: at once, or when the last view the consumer still holds dies."""
        self.reservation.join()
        self._segment.close_fd()
        self._array = None
        memory, self._memory = self._memory, None
        assert memory is not None, "the ring is closed already"
        try:
            memory.close()
        except BufferError:  # views alive: the mapping goes with the last of them
            _hold(self.spec.name, self.spec.reserved_bytes,
                  "a finished sequence's ring, kept by batches of it still referenced",
                  weakref.ref(memory, functools.partial(_held_here.pop, self.spec.name)))
        else:
            _let_go(self.spec.name)
