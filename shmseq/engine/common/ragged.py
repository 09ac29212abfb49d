"""Variable-size items as one values buffer plus int64 offsets (``Ragged``).

A batch leaf whose samples differ in their first dimension (encoded images, detection boxes,
token sequences) cannot be stacked. A worker returns it as ``Ragged.from_items(items)``; the
slot then holds it as one values array (the items one after the other) and ``len + 1`` int64
offsets, written once, and the consumer gets views of both: a ``Ragged`` of numpy views
(``out_type='null'``), or a ``torch.nested`` jagged tensor over tensor views of the slot
(``'cpu'``, ``'cuda'``). A torch jagged tensor returned by a worker travels the same way. The
offsets are delivered as a copy (a few bytes), so that ``clone()`` of a jagged tensor (which
shares its offsets) or ``copy()`` of a ``Ragged`` holds nothing of the slot.

Item ``i`` is ``values[offsets[i]:offsets[i + 1]]``; every item has the trailing shape
``values.shape[1:]``. ``bytes`` items are ``uint8`` arrays of one dimension.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeGuard

import numpy as np

if TYPE_CHECKING:
    import torch

ArrayOrTensor = Any  # a numpy array or a torch tensor, used alike (torch is imported only if loaded)


class Ragged:
    """Items of one dtype and trailing shape whose first dimensions differ.

    ``Ragged(values, offsets)`` wraps existing buffers (numpy arrays, or torch tensors where
    torch cannot hold them jagged); ``Ragged.from_items`` gathers items without concatenating
    them, so that a worker's items are copied only once, into the slot.
    """

    __slots__ = ("_values", "offsets", "_items")

    def __init__(self, values: ArrayOrTensor | None, offsets: ArrayOrTensor) -> None:
        self._values = values
        self.offsets = offsets
        self._items: list[ArrayOrTensor] | None = None

    @classmethod
    def from_items(cls, items: Sequence) -> "Ragged":
        """The items (arrays, tensors or ``bytes``) as one ragged leaf; they must share their
        dtype and all but their first dimension."""
        arrays = [as_item(item, number) for number, item in enumerate(items)]
        _check_alike(arrays)
        lengths = np.fromiter((len(array) for array in arrays), np.int64, len(arrays))
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ragged = cls(None, offsets)
        ragged._items = arrays
        return ragged

    @property
    def values(self) -> ArrayOrTensor:
        """The items one after the other (concatenated on first use for ``from_items``)."""
        if self._values is None:
            assert self._items is not None  # made by from_items
            self._values = _concatenated(self._items)
        return self._values

    @property
    def items(self) -> list[ArrayOrTensor] | None:
        """The items given to ``from_items`` (not yet concatenated), else None."""
        return self._items

    @property
    def lengths(self) -> np.ndarray:
        """Each item's first dimension."""
        return np.diff(np.asarray(self.offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def copy(self) -> "Ragged":
        """A ragged leaf of its own memory (a delivered one is views of its slot)."""
        return Ragged(copied(self.values), copied(self.offsets))

    def __getitem__(self, number: int) -> ArrayOrTensor:
        count = len(self)
        if not -count <= number < count:
            raise IndexError(f"item {number} of a Ragged of {count} items")
        number %= count
        if self._items is not None:
            return self._items[number]
        return self.values[int(self.offsets[number]):int(self.offsets[number + 1])]

    def __iter__(self) -> Iterator[ArrayOrTensor]:
        return (self[number] for number in range(len(self)))

    def __repr__(self) -> str:
        values = self.values
        return (f"Ragged({len(self)} items of {values.dtype}, trailing shape "
                f"{tuple(values.shape[1:])}, {values.shape[0]} rows)")


def as_item(item: object, number: int = 0) -> ArrayOrTensor:
    """An item as an array or tensor of at least one dimension (``bytes`` as ``uint8``)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return np.frombuffer(item, np.uint8)
    if not isinstance(item, np.ndarray) and not is_tensor(item):
        item = np.asarray(item)
    if item.ndim == 0:
        raise ValueError(f"item {number} of a ragged leaf is a scalar: items need a first "
                         "dimension (wrap it, or put scalars in a plain array)")
    return item


def _check_alike(arrays: list[ArrayOrTensor]) -> None:
    if not arrays:
        return
    first = arrays[0]
    for number, array in enumerate(arrays[1:], 1):
        if array.dtype != first.dtype or tuple(array.shape[1:]) != tuple(first.shape[1:]):
            raise ValueError(
                f"items of a ragged leaf must share dtype and trailing shape: item 0 is "
                f"{first.dtype} {tuple(first.shape)}, item {number} is {array.dtype} "
                f"{tuple(array.shape)} (only the first dimension may differ)")


def _concatenated(items: list[ArrayOrTensor]) -> ArrayOrTensor:
    if items and is_tensor(items[0]):
        return sys.modules["torch"].cat(items)
    if not items:
        return np.empty(0, np.uint8)
    return np.concatenate(items)


def copied(array: ArrayOrTensor) -> ArrayOrTensor:
    """A copy of an array or tensor."""
    return array.clone() if is_tensor(array) else array.copy()


def is_tensor(obj: object) -> TypeGuard[torch.Tensor]:
    """A torch tensor, asked without importing torch (numpy-only runs never load it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_jagged(obj: object) -> bool:
    """A torch nested tensor of the jagged layout, its items back to back in ``values()``."""
    if not is_tensor(obj) or not obj.is_nested:
        return False
    torch = sys.modules["torch"]
    # the type ignored: a nested tensor's method, which torch's stubs lack
    return obj.layout is torch.jagged and obj.lengths() is None  # type: ignore[attr-defined]


def make_leaf(values: ArrayOrTensor, offsets: ArrayOrTensor) -> Ragged | torch.Tensor:
    """What the consumer gets for a ragged leaf: a jagged tensor over tensors, else a
    ``Ragged`` (numpy views, or tensors of a dtype torch cannot nest)."""
    if is_tensor(values) and is_tensor(offsets):
        torch = sys.modules["torch"]
        try:
            return torch.nested.nested_tensor_from_jagged(values, offsets)
        except (RuntimeError, TypeError, ValueError):
            return Ragged(values, offsets)
    return Ragged(values, offsets)


def map_ragged(leaf: Ragged | ArrayOrTensor,
               function: Callable[[ArrayOrTensor], ArrayOrTensor]) -> Ragged | torch.Tensor:
    """``function`` applied to a ragged leaf's values and offsets, the leaf rebuilt."""
    if isinstance(leaf, Ragged):
        return make_leaf(function(leaf.values), function(leaf.offsets))
    return make_leaf(function(leaf.values()), function(leaf.offsets()))
