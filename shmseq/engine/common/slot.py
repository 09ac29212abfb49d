"""Where a batch's arrays go in a slot, and the slot's format, which writer and reader share.

Slot format::

    [0, 16)            header offset, header length (little-endian uint64)
    [64, ...)          array payloads, each 64-byte aligned
    [header offset..]  pickled skeleton: the batch's nesting (namedtuple types
                       kept), with every array replaced by (dtype, shape, payload
                       offset, the torch dtype its bits stand for if numpy lacks
                       it), every ragged leaf by two such arrays (its values and
                       int64 offsets, see ragged.py) and every small extra
                       (number, string) kept as is

Here: the format's constants and skeleton tags, the placement of a payload (``place``), the
``SlotAllocator`` that hands a worker arrays inside its slot to fill in place, and the size of
a slot for batches of a given size. Writing a batch is ``layout``'s, reading it ``unpack``'s.
"""
from __future__ import annotations

import math
import mmap
import struct
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

ALIGN = 64
PAGE = 4096
SLOT_HEADROOM = 1.25  # a slot sized by a batch holds one a quarter larger
PAYLOAD_START = 64
_PREFIX = struct.Struct("<QQ")

# Skeleton tags.
_ARRAY, _TUPLE, _LIST, _DICT, _EXTRA, _NAMED, _PICKLED, _RAGGED = range(8)


class SlotOverflow(Exception):
    """The batch needs ``needed`` bytes, more than the slot holds."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


def align(offset: int, to: int = ALIGN) -> int:
    return -(-offset // to) * to


def place(offset: int, nbytes: int) -> int:
    """Where an array of ``nbytes`` goes at or after ``offset``: on a page boundary when it
    fills a page or more, else on 64 bytes. Rows copied into an image batch 64 bytes into a
    page ran 24 % slower than page-aligned (the destination a few bytes ahead of a page-aligned
    source modulo 4 KiB, which the CPU takes for stores its loads must wait for)."""
    return align(offset, PAGE if nbytes >= PAGE else ALIGN)


class SlotAllocator:
    """Hands out arrays that live inside a slot, for workers that fill batches in place.

    A worker with a ``fill(indices, out)`` method calls ``out.empty(shape, dtype)``
    for each array of its batch, writes into it (decodes an image straight into it,
    say) and returns the nesting of those arrays. They are then already where the
    consumer will read them, and nothing is copied. When the slot is full (or there is none
    yet: the first batches), ``empty`` returns memory of its own (``outside_slot``) and the
    batch is copied into its slot, or takes the overflow path.
    """

    def __init__(self, region: np.ndarray | None) -> None:
        self.region = region
        self.used = PAYLOAD_START
        self.placed: dict[int, tuple[np.ndarray, int]] = {}  # id -> (array, offset in region)

    def empty(self, shape: int | Iterable[int], dtype: DTypeLike) -> np.ndarray:
        """An uninitialised C-contiguous array, inside the slot when it fits."""
        dtype = np.dtype(dtype)
        shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        nbytes = int(math.prod(shape)) * dtype.itemsize
        offset = place(self.used, nbytes)
        if self.region is None or offset + nbytes > len(self.region):
            return outside_slot(shape, dtype, nbytes)
        array = np.ndarray(shape, dtype, buffer=self.region, offset=offset)
        self.placed[id(array)] = (array, offset)  # known in place without pointer arithmetic
        self.used = offset + nbytes
        return array

    def zeros(self, shape: int | Iterable[int], dtype: DTypeLike) -> np.ndarray:
        array = self.empty(shape, dtype)
        array.fill(0)
        return array


def outside_slot(shape: tuple, dtype: np.dtype, nbytes: int) -> np.ndarray:
    """An array of ``nbytes`` for a batch built outside its slot, given back to the system when
    it dies: a page or more is a mapping of its own, since the heap of a worker keeps what it
    freed (``worker.loop._keep_large_buffers``), and a batch built outside its slot once (the
    first one, sizing the ring) would stay there for good."""
    if nbytes < PAGE:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype, math.prod(shape)).reshape(shape)


def stack_into(arrays: list[np.ndarray], out: SlotAllocator) -> np.ndarray:
    """The samples' arrays stacked along a new first axis, written straight into ``out``."""
    shape, dtype = arrays[0].shape, arrays[0].dtype
    batch = out.empty((len(arrays),) + shape, dtype)
    for row, array in enumerate(arrays):
        if array.shape != shape:
            raise ValueError(f"sample {row} of the batch has shape {array.shape} but sample 0 has "
                             f"{shape}: the default collation stacks samples of one shape; pad "
                             "them, or pass your own batchify_fn (collate_fn)")
        batch[row] = array
    return batch


def slot_bytes_for(needed: int) -> int:
    """A slot size for batches of about ``needed`` bytes: headroom, rounded to pages."""
    return -(-int(needed * SLOT_HEADROOM) // PAGE) * PAGE
