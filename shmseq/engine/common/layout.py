"""A batch <-> bytes in a slot, with zero-copy views on the way back.

Slot format::

    [0, 16)            header offset, header length (little-endian uint64)
    [64, ...)          array payloads, each 64-byte aligned
    [header offset..]  pickled skeleton: the batch's nesting (namedtuple types
                       kept), with every array replaced by (dtype, shape, payload
                       offset, the torch dtype its bits stand for if numpy lacks
                       it), every ragged leaf by two such arrays (its values and
                       int64 offsets, see ragged.py) and every small extra
                       (number, string) kept as is

Only the skeleton is pickled; payloads are written once, straight into the slot. Any other
object in a batch (a mapping or list of another type, a dataclass, a sparse tensor, a masked
array) is pickled into the skeleton whole, except the plain arrays and tensors inside it,
which are placed in the slot as the others are and read back as views: nothing is refused.
"""
from __future__ import annotations

import io
import math
import mmap
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, TypeGuard

import numpy as np

from .errors import UnsupportedBatch
from .ragged import ArrayOrTensor, Ragged, copied, is_jagged, is_tensor, make_leaf, map_ragged

if TYPE_CHECKING:
    import torch
    from numpy.typing import DTypeLike

ALIGN = 64
PAGE = 4096
SLOT_HEADROOM = 1.25  # a slot sized by a batch holds one a quarter larger
PAYLOAD_START = 64
_PREFIX = struct.Struct("<QQ")
_EXTRA_TYPES = (bool, int, float, complex, str, bytes, type(None), np.generic)

# Skeleton tags.
_ARRAY, _TUPLE, _LIST, _DICT, _EXTRA, _NAMED, _PICKLED, _RAGGED = range(8)
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # carries a dtype numpy lacks


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


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, region: np.ndarray, wrap: Wrap | None) -> None:
        super().__init__(io.BytesIO(data))
        self.region = region
        self.wrap = wrap

    def persistent_load(self, node: tuple) -> object:
        _, dtype, shape, offset, torch_dtype = node
        return _array_builder(np.dtype(dtype), shape, offset, torch_dtype, self.wrap)(self.region)

    def load(self) -> object:
        try:
            return super().load()
        finally:
            _validate_sparse_tensors()


def _validate_sparse_tensors() -> None:
    """Check the sparse tensors just unpickled, as ``torch.load`` does: until then torch keeps
    each in a list of its own, and with it the slot it views."""
    validate = getattr(getattr(sys.modules.get("torch"), "_utils", None),
                       "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()


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


class BatchReader(NamedTuple):
    """How to read batches of one layout (one header): compiled once, used for every batch."""
    build: Callable   # region -> the batch, its arrays views of region (made leaves)
    arrays: int       # how many arrays a batch holds
    nbytes: int       # their bytes


Wrap = Callable[[np.dtype], "Callable | None"]  # dtype -> what wraps its views, or None
_READERS: dict[tuple[bytes, Wrap | None], BatchReader] = {}
_MOST_READERS = 256


def batch_reader(region: np.ndarray, wrap: Wrap | None = None) -> BatchReader:
    """The reader of the batch in ``region``: batches of one shape share a header, so the
    header is unpickled and compiled once, not for every batch. ``wrap(dtype)`` says, once
    per array of the layout, what its views become (a torch tensor, say); None: views."""
    header_offset, header_length = _PREFIX.unpack_from(region, 0)  # type: ignore[arg-type]
    key = (region[header_offset:header_offset + header_length].tobytes(), wrap)
    reader = _READERS.get(key)
    if reader is None:
        if len(_READERS) >= _MOST_READERS:
            _READERS.clear()
        skeleton = pickle.loads(key[0])
        arrays = _arrays_of(skeleton)
        reader = _READERS[key] = BatchReader(_compile(skeleton, wrap), len(arrays),
                                             sum(_nbytes(node) for node in arrays))
    return reader


def read_batch(region: np.ndarray, wrap: Wrap | None = None) -> object:
    """The batch stored in ``region``, its arrays views of ``region`` (no copy), made leaves
    by ``wrap`` when given (see ``batch_reader``)."""
    return batch_reader(region, wrap).build(region)


def _arrays_of(node: tuple) -> list[tuple]:
    tag = node[0]
    if tag == _ARRAY:
        return [node]
    if tag == _PICKLED:
        return list(node[2])
    if tag == _RAGGED:
        return [node[1], node[2]]
    if tag in (_TUPLE, _LIST, _NAMED):
        return [leaf for child in node[2 if tag == _NAMED else 1] for leaf in _arrays_of(child)]
    if tag == _DICT:
        return [leaf for _, child in node[1] for leaf in _arrays_of(child)]
    return []


def _nbytes(node: tuple) -> int:
    return int(np.prod(node[2], dtype=np.int64)) * np.dtype(node[1]).itemsize


def _compile(node: tuple, wrap: Wrap | None) -> Callable[[np.ndarray], object]:
    """A function ``region -> part of the batch`` for a skeleton node."""
    tag = node[0]
    if tag == _ARRAY:
        return _array_builder(np.dtype(node[1]), node[2], node[3], node[4], wrap)
    if tag in (_TUPLE, _LIST, _NAMED):
        parts = [_compile(child, wrap) for child in node[2 if tag == _NAMED else 1]]
        make = {_TUPLE: tuple, _LIST: list}.get(tag) or (lambda items: node[1](*items))
        return lambda region: make([part(region) for part in parts])
    if tag == _DICT:
        items = [(key, _compile(child, wrap)) for key, child in node[1]]
        return lambda region: {key: part(region) for key, part in items}
    if tag == _PICKLED:
        data = node[1]
        return lambda region: _SlotUnpickler(data, region, wrap).load()
    if tag == _RAGGED:  # offsets copied (a few bytes): a jagged tensor's clone() shares them
        values, offsets = _compile(node[1], wrap), _compile(node[2], wrap)
        return lambda region: make_leaf(values(region), copied(offsets(region)))
    value = node[1]
    return lambda region: value


def _array_builder(dtype: np.dtype, shape: tuple, offset: int, torch_dtype: str | None,
                   wrap: Wrap | None) -> Callable[[np.ndarray], object]:
    ndarray = np.ndarray
    if torch_dtype is not None:
        return lambda region: _restored_tensor(ndarray(shape, dtype, region, offset), torch_dtype)
    make = None if wrap is None else wrap(dtype)
    if make is None:
        return lambda region: ndarray(shape, dtype, region, offset)
    return lambda region: make(ndarray(shape, dtype, region, offset))


def _restored_tensor(bits: np.ndarray, torch_dtype: str) -> torch.Tensor:
    """A tensor of a dtype numpy lacks, from its bits (a view of them: no copy)."""
    import torch
    return torch.from_numpy(bits).view(getattr(torch, torch_dtype))


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


def slot_bytes_for(needed: int) -> int:
    """A slot size for batches of about ``needed`` bytes: headroom, rounded to pages."""
    return -(-int(needed * SLOT_HEADROOM) // PAGE) * PAGE
