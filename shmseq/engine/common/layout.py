"""A batch -> bytes in a slot, written once, each array straight to its place.

The batch's nesting becomes a pickled skeleton (the slot's format: ``slot``) and its arrays
payloads; only the skeleton is pickled. Any other object in a batch (a mapping or list of
another type, a dataclass, a sparse tensor, a masked array) is pickled into the skeleton whole,
except the plain arrays and tensors inside it, which are placed in the slot as the others are
and read back as views (``unpack``): nothing is refused. Also here: ``map_arrays``, a
function over every array of a batch.

The names of ``slot`` and ``unpack`` stay importable from here, where they were first.
"""
from __future__ import annotations

import io
import math
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeGuard

import numpy as np

from .errors import UnsupportedBatch
from .ragged import ArrayOrTensor, Ragged, is_jagged, is_tensor, map_ragged
from .slot import (_ARRAY, _DICT, _EXTRA, _LIST, _NAMED, _PICKLED, _PREFIX, _RAGGED, _TUPLE, ALIGN,
                   PAGE, PAYLOAD_START, SLOT_HEADROOM, SlotAllocator, SlotOverflow, align,
                   outside_slot, place, slot_bytes_for, stack_into)
from .unpack import BatchReader, Wrap, batch_reader, read_batch

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "PAGE", "PAYLOAD_START", "SLOT_HEADROOM", "BatchReader", "SlotAllocator",
           "SlotOverflow", "Wrap", "align", "as_ndarray", "batch_reader", "encode_batch",
           "iter_arrays", "map_arrays", "outside_slot", "packed_size", "place", "read_batch",
           "slot_bytes_for", "stack_into", "tensor_bits", "write_batch"]

_EXTRA_TYPES = (bool, int, float, complex, str, bytes, type(None), np.generic)
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # carries a dtype numpy lacks



@dataclass
class _Packed:
    copies: list[tuple[np.ndarray, int]]  # (array, offset) still to write
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


def _is_dense_tensor(obj: object) -> TypeGuard[torch.Tensor]:
    """A tensor whose elements lie in one strided buffer (not sparse, not nested)."""
    return is_tensor(obj) and obj.layout is sys.modules["torch"].strided and not obj.is_nested


def _plain_array(obj: object) -> TypeGuard[np.ndarray]:
    """An ndarray (or a subclass that is only a view of memory, such as a memmap) of values,
    placed in the slot as it is: not a masked array, whose mask would be lost, nor an array of
    Python objects."""
    return isinstance(obj, np.ndarray) and not isinstance(obj, np.ma.MaskedArray) and \
        not obj.dtype.hasobject


def tensor_bits(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A dense tensor's data as numpy, without a copy when on the CPU; a dtype numpy lacks
    (bfloat16, float8, complex32) as its bits, with the dtype's name to restore it."""
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy(), None
    except TypeError:
        torch = sys.modules["torch"]
        bits = getattr(torch, _BITS[tensor.element_size()])
        return tensor.view(bits).numpy(), str(tensor.dtype).removeprefix("torch.")


def as_ndarray(obj: object) -> np.ndarray | None:
    """``obj`` as a numpy array if it is one, or a dense torch tensor of a dtype numpy has."""
    if _is_dense_tensor(obj):
        array, torch_dtype = tensor_bits(obj)
        return array if torch_dtype is None else None
    if isinstance(obj, np.ndarray) and not isinstance(obj, np.ma.MaskedArray):
        return obj
    return None


class _Unplaceable(Exception):
    """Part of a batch cannot travel in a slot: ``reason`` names it ``{where}``, the path to it
    (gathered on the way out, so that batches that do travel pay nothing for it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.keys: list[str] = []

    def error(self) -> UnsupportedBatch:
        return UnsupportedBatch(self.reason.replace("{where}", "batch" + "".join(reversed(self.keys))))


class _Packer:
    def __init__(self, region: np.ndarray | None, start: int,
                 placed: dict[int, tuple[np.ndarray, int]]) -> None:
        self.region = region
        self.cursor = start
        self.copies: list[tuple[np.ndarray, int]] = []
        self.placed = placed

    def skeleton(self, obj: Any) -> tuple:  # Any: dispatched on type(obj), which mypy does not narrow
        kind = type(obj)
        if kind is np.ndarray and not obj.dtype.hasobject:  # the common leaf first
            return self.array(obj, None)
        if _is_dense_tensor(obj):
            return self.array(*tensor_bits(obj))
        if kind is tuple:
            return (_TUPLE, self.children(enumerate(obj)))
        if _is_namedtuple(obj):
            return (_NAMED, kind, self.children(enumerate(obj)))
        if kind is list:
            return (_LIST, self.children(enumerate(obj)))
        if kind is dict:
            return (_DICT, tuple(zip(obj, self.children(obj.items(), repr))))
        if isinstance(obj, _EXTRA_TYPES):
            return (_EXTRA, obj)
        if _plain_array(obj):
            return self.array(obj, None)  # a subclass (a memmap, say): delivered as an array
        if kind is Ragged:
            return self.pickled(obj) if _holds_objects(obj) else self.ragged(obj)
        if is_jagged(obj):
            return self.ragged(Ragged(obj.values(), obj.offsets()))
        return self.pickled(obj)

    def children(self, items: Iterable[tuple[Any, object]],
                 show: Callable[[Any], str] = str) -> tuple:
        skeletons = []
        for key, value in items:
            try:
                skeletons.append(self.skeleton(value))
            except _Unplaceable as exc:
                exc.keys.append(f"[{show(key)}]")
                raise
        return tuple(skeletons)

    def array(self, array: np.ndarray, torch_dtype: str | None) -> tuple:
        placed = self.placed.get(id(array))
        offset = placed[1] if placed is not None and placed[0] is array else \
            _in_place_offset(array, self.region)
        if offset is None:
            offset = place(self.cursor, array.nbytes)
            self.cursor = offset + array.nbytes
            self.copies.append((array, offset))
        return (_ARRAY, _described(array.dtype), array.shape, offset, torch_dtype)

    def ragged(self, leaf: Ragged) -> tuple:
        """One values array (the items back to back, each copied once) and int64 offsets."""
        if leaf.items is None:
            values = self.array(*_bits(leaf.values))
            offsets = _checked_offsets(_bits(leaf.offsets)[0], values[2][0] if values[2] else 0)
        else:
            values, offsets = self.items(leaf.items), leaf.offsets
        return (_RAGGED, values, self.array(offsets, None))

    def items(self, items: list[ArrayOrTensor]) -> tuple:
        """A values node whose rows are ``items``, each written straight to its place."""
        parts = [_bits(item) for item in items] or [(np.empty(0, np.uint8), None)]
        first, torch_dtype = parts[0]
        rows = sum(len(array) for array, _ in parts)
        nbytes = rows * math.prod(first.shape[1:]) * first.dtype.itemsize
        offset = at = place(self.cursor, nbytes)
        self.cursor = offset + nbytes
        for array, _ in parts:
            self.copies.append((array, at))
            at += array.nbytes
        return (_ARRAY, _described(first.dtype), (rows, *first.shape[1:]), offset, torch_dtype)

    def pickled(self, obj: object) -> tuple:
        """An object the skeleton has no node for: pickled whole, the plain arrays and dense
        tensors in it placed in the slot (``_SlotPickler``)."""
        pickler = _SlotPickler(io.BytesIO(), self)
        try:
            pickler.dump(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same fix
            raise _Unplaceable(
                f"{{where}} is a {type(obj).__module__}.{type(obj).__qualname__}, which has to be "
                f"pickled to travel and cannot be ({type(exc).__name__}: {exc}): define its "
                "class at module level, or return arrays, tensors, tuples, lists and dicts") \
                from None
        return (_PICKLED, pickler.getvalue(), tuple(pickler.arrays))


def _described(dtype: np.dtype) -> str | np.dtype:
    """A dtype as the skeleton keeps it: its short string, or the dtype itself where that
    string would lose its fields (records) or subarray shape."""
    return dtype.str if dtype.fields is None and dtype.subdtype is None else dtype


def _holds_objects(leaf: Ragged) -> bool:
    """A ragged leaf of Python objects, whose pointers cannot travel in a slot: pickled whole."""
    first = leaf.items[0] if leaf.items else leaf.values
    return not is_tensor(first) and np.asarray(first).dtype.hasobject


def _bits(obj: ArrayOrTensor) -> tuple[np.ndarray, str | None]:
    """An array or dense tensor as numpy (see ``tensor_bits``)."""
    return tensor_bits(obj) if is_tensor(obj) else (np.asarray(obj), None)


def _checked_offsets(offsets: np.ndarray, rows: int) -> np.ndarray:
    offsets = np.asarray(offsets, np.int64)
    if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != rows or \
            np.any(np.diff(offsets) < 0):
        raise _Unplaceable(f"{{where}} is a ragged leaf whose offsets {offsets[:8].tolist()}"
                           f"{'...' if len(offsets) > 8 else ''} do not run from 0 up to its "
                           f"{rows} values: build it with Ragged.from_items(items)")
    return offsets


class _SlotPickler(pickle.Pickler):
    """Pickles an object but places the plain arrays and dense tensors in it in the slot: each
    is pickled as its array node, and read back as a view (``_SlotUnpickler``)."""

    def __init__(self, file: io.BytesIO, packer: _Packer) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.file = file
        self.packer = packer
        self.arrays: list[tuple] = []

    def persistent_id(self, obj: object) -> tuple | None:
        if _plain_array(obj):
            node = self.packer.array(obj, None)
        elif _is_dense_tensor(obj):
            node = self.packer.array(*tensor_bits(obj))
        else:
            return None
        self.arrays.append(node)
        return node

    def getvalue(self) -> bytes:
        return self.file.getvalue()


def _pack(batch: object, region: np.ndarray | None, start: int, placed: dict) -> _Packed:
    packer = _Packer(region, start, placed)
    try:
        skeleton = packer.skeleton(batch)
    except _Unplaceable as exc:
        raise exc.error() from None
    try:
        header = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UnsupportedBatch(
            f"the batch's structure cannot be pickled ({type(exc).__name__}: {exc}): namedtuple "
            "classes and dict keys in a batch must be picklable (defined at module level)") from exc
    return _Packed(packer.copies, header, align(packer.cursor, 8))


def _emit(packed: _Packed, region: np.ndarray) -> None:
    for array, offset in packed.copies:
        target = np.ndarray(array.shape, array.dtype, buffer=region, offset=offset)
        np.copyto(target, array, casting="no")
    end = packed.header_offset + len(packed.header)
    region[packed.header_offset:end] = np.frombuffer(packed.header, np.uint8)
    # the types ignored here and in batch_reader: numpy declares the buffer protocol from 3.12 on
    _PREFIX.pack_into(region, 0, packed.header_offset, len(packed.header))  # type: ignore[arg-type]


def write_batch(batch: object, region: np.ndarray, allocator: SlotAllocator | None = None) -> int:
    """Write ``batch`` into ``region``; the bytes used, or ``SlotOverflow``.

    Arrays that ``allocator`` placed in the region stay where they are.
    """
    if allocator is None:
        packed = _pack(batch, region, PAYLOAD_START, {})
    else:
        packed = _pack(batch, region, allocator.used, allocator.placed)
    if packed.size > len(region):
        raise SlotOverflow(packed.size)
    _emit(packed, region)
    return packed.size


def packed_size(batch: object) -> int:
    """The bytes ``batch`` takes in a slot (nothing is copied)."""
    return _pack(batch, None, PAYLOAD_START, {}).size


def encode_batch(batch: object) -> np.ndarray:
    """The batch in slot format in a buffer of its own (the overflow path)."""
    packed = _pack(batch, None, PAYLOAD_START, {})
    buffer = np.empty(packed.size, np.uint8)
    _emit(packed, buffer)
    return buffer


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def map_arrays(batch: object, function: Callable[[Any], object],
               leaf_type: type | tuple[type, ...] = np.ndarray) -> object:
    """Apply ``function`` to every array (``leaf_type``) of a batch, keeping its nesting; a
    ragged leaf's values and offsets are two such arrays."""
    if isinstance(batch, Ragged) or is_jagged(batch):
        return map_ragged(batch, lambda part: map_arrays(part, function, leaf_type))
    if isinstance(batch, leaf_type):
        return function(batch)
    if isinstance(batch, tuple):
        items = [map_arrays(item, function, leaf_type) for item in batch]
        # the type ignored: a namedtuple's class takes its fields, not tuple's one iterable
        return type(batch)(*items) if _is_namedtuple(batch) else tuple(items)  # type: ignore[arg-type]
    if isinstance(batch, list):
        return [map_arrays(item, function, leaf_type) for item in batch]
    if isinstance(batch, dict):
        return {key: map_arrays(item, function, leaf_type) for key, item in batch.items()}
    return batch


def iter_arrays(batch: object, leaf_type: type | tuple[type, ...] = np.ndarray) -> list:
    """The arrays (``leaf_type``) of a batch, in ``map_arrays`` order."""
    found: list = []
    map_arrays(batch, found.append, leaf_type)
    return found
