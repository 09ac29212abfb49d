"""The shared-memory slot ring: one POSIX segment of ``n_slots`` x ``slot_bytes``.

The consumer creates it once (allocated and faulted in at start), workers attach
it by name, and the name is unlinked as soon as every worker holds a mapping, so
that a killed process cannot leave it behind in /dev/shm. Segments are made with
posix_ipc rather than ``multiprocessing.shared_memory`` so that Python's resource
tracker never warns about, or unlinks, a segment that is still in use.

A slot handed to the consumer is a *lease*: an array over the slot whose death
(once the consumer has dropped every view derived from it) gives the slot back.
"""
from __future__ import annotations

import errno
import functools
import mmap
import os
import secrets
import weakref
from typing import Callable, NamedTuple

import numpy as np
import posix_ipc

from .errors import SharedMemoryFull

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
NAME_PREFIX = "shmseq-"
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class RingSpec(NamedTuple):
    """What a worker needs to attach the ring (picklable)."""
    name: str
    n_slots: int
    slot_bytes: int

    @property
    def stride(self) -> int:
        return -(-self.slot_bytes // PAGE) * PAGE

    @property
    def total_bytes(self) -> int:
        return self.stride * self.n_slots


def shm_free_bytes() -> int:
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def _refuse_space(needed: int, free: int) -> SharedMemoryFull:
    return SharedMemoryFull(
        f"the slot ring needs {needed:,} bytes of shared memory but {SHM_DIR} has {free:,} free: "
        "give the container more (docker run --shm-size=...), or lower buffer or slot_bytes")


class Ring:
    """A mapping of the ring, in the consumer (owner) or in a worker."""

    def __init__(self, spec: RingSpec, memory: mmap.mmap, *, owner: bool):
        self.spec = spec
        self.owner = owner
        self._mmap = memory
        self._array = np.frombuffer(memory, np.uint8)
        self.held = [False] * spec.n_slots
        self._watches: list[weakref.ref | None] = [None] * spec.n_slots  # one per live lease
        self.on_release: Callable[[int], None] = lambda slot: None

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int) -> "Ring":
        spec = RingSpec(f"/{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", n_slots, slot_bytes)
        free = shm_free_bytes()
        if spec.total_bytes > free:
            raise _refuse_space(spec.total_bytes, free)
        segment = posix_ipc.SharedMemory(spec.name, posix_ipc.O_CREX, mode=0o600)
        try:
            try:
                os.posix_fallocate(segment.fd, 0, spec.total_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise _refuse_space(spec.total_bytes, shm_free_bytes()) from exc
                raise
            memory = mmap.mmap(segment.fd, spec.total_bytes, flags=_MAP_FLAGS)
        except BaseException:
            segment.unlink()
            raise
        finally:
            segment.close_fd()
        return cls(spec, memory, owner=True)

    @classmethod
    def attach(cls, spec: RingSpec) -> "Ring":
        segment = posix_ipc.SharedMemory(spec.name)
        try:
            memory = mmap.mmap(segment.fd, spec.total_bytes, flags=_MAP_FLAGS)
        finally:
            segment.close_fd()
        return cls(spec, memory, owner=False)

    @property
    def address(self) -> int:
        """Where the ring is mapped in this process (for page-locking it)."""
        return self._array.ctypes.data

    def region(self, slot: int) -> np.ndarray:
        """The slot's bytes, for a writer."""
        start = slot * self.spec.stride
        return self._array[start:start + self.spec.slot_bytes]

    def lease(self, slot: int) -> np.ndarray:
        """The slot's bytes for the consumer; the slot comes back when this array dies."""
        if self._watches[slot] is not None:
            raise RuntimeError(f"slot {slot} is leased twice: it would be rewritten while in use")
        lease = np.frombuffer(self._mmap, np.uint8, count=self.spec.slot_bytes,
                              offset=slot * self.spec.stride)
        self._watches[slot] = weakref.ref(lease, functools.partial(self._returned, slot))
        return lease

    def _returned(self, slot: int, watch: weakref.ref) -> None:
        # Runs in whatever thread drops the last view: no locks here.
        self._watches[slot] = None
        self.held[slot] = False
        self.on_release(slot)

    def held_count(self) -> int:
        """Slots whose batch the consumer has received and still references."""
        return sum(self.held)

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s data lies inside this ring (the zero-copy check)."""
        start = self._array.__array_interface__["data"][0]
        pointer = array.__array_interface__["data"][0]
        return start <= pointer and pointer + array.nbytes <= start + len(self._array)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed."""
        try:
            posix_ipc.unlink_shared_memory(self.spec.name)
        except posix_ipc.ExistentialError:
            pass

    def close(self) -> None:
        """Unmap, unless the consumer still holds views: then the mapping lives until they die."""
        self.on_release = lambda slot: None
        self._array = None
        try:
            self._mmap.close()
        except BufferError:
            pass
