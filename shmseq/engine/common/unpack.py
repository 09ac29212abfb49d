"""Bytes in a slot -> the batch, its arrays zero-copy views of the slot.

A batch's header (its pickled skeleton, see ``slot``) is unpickled and compiled once into a
function ``region -> batch`` (``BatchReader``), kept for the batches of the same layout; an
object pickled whole is unpickled with its arrays read back as views (``_SlotUnpickler``).
The writing side is ``layout``.
"""
from __future__ import annotations

import io
import pickle
import sys
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from .ragged import copied, make_leaf
from .slot import _ARRAY, _DICT, _LIST, _NAMED, _PICKLED, _PREFIX, _RAGGED, _TUPLE

if TYPE_CHECKING:
    import torch

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
