"""A batch <-> bytes in a slot, with zero-copy views on the way back.

Slot format::

    [0, 16)            header offset, header length (little-endian uint64)
    [64, ...)          array payloads, each 64-byte aligned
    [header offset..]  pickled skeleton: the batch's nesting, with every array
                       replaced by (dtype, shape, payload offset) and every
                       small extra (number, string) kept as is

Only the skeleton is pickled; payloads are written once, straight into the slot.
"""
from __future__ import annotations

import pickle
import struct
import sys
from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedBatch

ALIGN = 64
PAYLOAD_START = 64
_PREFIX = struct.Struct("<QQ")
_EXTRA_TYPES = (bool, int, float, complex, str, bytes, type(None), np.generic)

# Skeleton tags.
_ARRAY, _TUPLE, _LIST, _DICT, _EXTRA = range(5)


class SlotOverflow(Exception):
    """The batch needs ``needed`` bytes, more than the slot holds."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


def align(offset: int, to: int = ALIGN) -> int:
    return -(-offset // to) * to


class SlotAllocator:
    """Hands out arrays that live inside a slot, for workers that fill batches in place.

    A worker with a ``fill(indices, out)`` method calls ``out.empty(shape, dtype)``
    for each array of its batch, writes into it (decodes an image straight into it,
    say) and returns the nesting of those arrays. They are then already where the
    consumer will read them, and nothing is copied. When the slot is full, ``empty``
    returns ordinary memory and the batch takes the overflow path.
    """

    def __init__(self, region: np.ndarray | None):
        self.region = region
        self.used = PAYLOAD_START

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array, inside the slot when it fits."""
        dtype = np.dtype(dtype)
        shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        end = self.used + nbytes
        if self.region is None or end > len(self.region):
            return np.empty(shape, dtype)
        array = np.ndarray(shape, dtype, buffer=self.region, offset=self.used)
        self.used = align(end)
        return array

    def zeros(self, shape, dtype) -> np.ndarray:
        array = self.empty(shape, dtype)
        array.fill(0)
        return array


@dataclass
class _Packed:
    copies: list        # (array, offset) still to write
    header: bytes
    header_offset: int

    @property
    def size(self) -> int:
        return self.header_offset + len(self.header)


def _in_place_offset(array: np.ndarray, region: np.ndarray | None) -> int | None:
    """The array's offset in ``region`` if it already lies there, contiguous."""
    if region is None or not array.flags.c_contiguous:
        return None
    start = region.__array_interface__["data"][0]
    pointer = array.__array_interface__["data"][0]
    if start + PAYLOAD_START <= pointer and pointer + array.nbytes <= start + len(region):
        return pointer - start
    return None


def as_ndarray(obj) -> np.ndarray | None:
    """``obj`` as a numpy array if it is one, or a torch tensor (on the CPU, without a copy)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return obj
    return None


class _Packer:
    def __init__(self, region: np.ndarray | None, start: int):
        self.region = region
        self.cursor = align(start)
        self.copies: list = []

    def skeleton(self, obj, path: str):
        array = as_ndarray(obj)
        if array is not None:
            return self.array(array, path)
        if isinstance(obj, tuple):
            return (_TUPLE, tuple(self.skeleton(v, f"{path}[{i}]") for i, v in enumerate(obj)))
        if isinstance(obj, list):
            return (_LIST, tuple(self.skeleton(v, f"{path}[{i}]") for i, v in enumerate(obj)))
        if isinstance(obj, dict):
            return (_DICT, tuple((k, self.skeleton(v, f"{path}[{k!r}]")) for k, v in obj.items()))
        if isinstance(obj, _EXTRA_TYPES):
            return (_EXTRA, obj)
        raise UnsupportedBatch(
            f"batch{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which cannot travel "
            "in a slot: return numpy arrays (or CPU torch tensors), tuples, lists and dicts of them, "
            "and small extras (numbers, strings, bytes)")

    def array(self, array: np.ndarray, path: str):
        if array.dtype.hasobject:
            raise UnsupportedBatch(
                f"batch{path} is an array of dtype {array.dtype}, which holds Python objects and "
                "cannot travel in a slot: use a numeric, bool, bytes or unicode dtype")
        dtype = array.dtype
        described = dtype.str if dtype.fields is None and dtype.subdtype is None else dtype
        offset = _in_place_offset(array, self.region)
        if offset is None:
            offset = self.cursor
            self.cursor = align(offset + array.nbytes)
            self.copies.append((array, offset))
        return (_ARRAY, described, array.shape, offset)


def _pack(batch, region: np.ndarray | None, start: int) -> _Packed:
    if batch is None:
        raise UnsupportedBatch("the worker returned None for a batch: return an array, "
                               "or a tuple/list/dict of arrays")
    packer = _Packer(region, start)
    skeleton = packer.skeleton(batch, "")
    header = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    return _Packed(packer.copies, header, align(packer.cursor, 8))


def _emit(packed: _Packed, region: np.ndarray) -> None:
    for array, offset in packed.copies:
        target = np.ndarray(array.shape, array.dtype, buffer=region, offset=offset)
        np.copyto(target, array, casting="no")
    end = packed.header_offset + len(packed.header)
    region[packed.header_offset:end] = np.frombuffer(packed.header, np.uint8)
    _PREFIX.pack_into(region, 0, packed.header_offset, len(packed.header))


def write_batch(batch, region: np.ndarray, allocator: SlotAllocator | None = None) -> int:
    """Write ``batch`` into ``region``; the bytes used, or ``SlotOverflow``.

    Arrays that ``allocator`` placed in the region stay where they are.
    """
    start = allocator.used if allocator is not None else PAYLOAD_START
    packed = _pack(batch, region, start)
    if packed.size > len(region):
        raise SlotOverflow(packed.size)
    _emit(packed, region)
    return packed.size


def encode_batch(batch) -> np.ndarray:
    """The batch in slot format in a buffer of its own (overflow path and sizing probe)."""
    packed = _pack(batch, None, PAYLOAD_START)
    buffer = np.empty(packed.size, np.uint8)
    _emit(packed, buffer)
    return buffer


def _rebuild(node, region: np.ndarray):
    tag, value = node[0], node[1]
    if tag == _ARRAY:
        return np.ndarray(node[2], np.dtype(value), buffer=region, offset=node[3])
    if tag == _TUPLE:
        return tuple(_rebuild(child, region) for child in value)
    if tag == _LIST:
        return [_rebuild(child, region) for child in value]
    if tag == _DICT:
        return {key: _rebuild(child, region) for key, child in value}
    return value


def read_batch(region: np.ndarray):
    """The batch stored in ``region``, its arrays views of ``region`` (no copy)."""
    header_offset, header_length = _PREFIX.unpack_from(region, 0)
    skeleton = pickle.loads(region[header_offset:header_offset + header_length])
    return _rebuild(skeleton, region)


def map_arrays(batch, function, leaf_type=np.ndarray):
    """Apply ``function`` to every array (``leaf_type``) of a batch, keeping its nesting."""
    if isinstance(batch, leaf_type):
        return function(batch)
    if isinstance(batch, tuple):
        return tuple(map_arrays(item, function, leaf_type) for item in batch)
    if isinstance(batch, list):
        return [map_arrays(item, function, leaf_type) for item in batch]
    if isinstance(batch, dict):
        return {key: map_arrays(item, function, leaf_type) for key, item in batch.items()}
    return batch


def iter_arrays(batch, leaf_type=np.ndarray):
    """The arrays (``leaf_type``) of a batch, in ``map_arrays`` order."""
    found = []
    map_arrays(batch, found.append, leaf_type)
    return found
