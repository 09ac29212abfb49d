"""Torch's collate, written into the slot: ``slot_collate`` stacks each column of a batch of
samples straight into the ring (where ``default_collate`` would make new tensors), and
``RaggedCollate`` keeps the fields it names ragged. Both run in ``shmseq.torch``'s workers; a
``RaggedCollate`` gives torch's own loader the same batches.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence, cast

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map

from .engine import Ragged, SlotAllocator, as_ndarray, make_leaf, stack_into

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


def slot_collate(samples: list, out: SlotAllocator | None = None) -> Any:
    """``default_collate(samples)``, each stackable column written straight into ``out``:
    tensors and arrays are stacked, numbers become a 1-D column (ints int64, floats float64),
    strings stay lists; mappings, namedtuples and sequences are collated field by field."""
    return collate(samples, collate_fn_map=_slot_collate_map(out or SlotAllocator(None)))


def _slot_collate_map(out: SlotAllocator) -> dict:
    def tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: dict) -> object:
        arrays = [as_ndarray(tensor) for tensor in batch]
        if arrays[0] is None:  # bfloat16, sparse, nested: collated by torch (or refused alike)
            return default_collate_fn_map[torch.Tensor](batch, collate_fn_map=collate_fn_map)
        return stack_into(cast("list[np.ndarray]", arrays), out)  # as the first: else it fails

    def arrays(batch: list[np.ndarray], *, collate_fn_map: dict) -> object:
        if batch[0].dtype.kind in "SaUO":  # torch refuses these: say so as it does
            return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)
        return stack_into(batch, out)

    def column(dtype: DTypeLike | None = None) -> Callable[..., object]:
        def stack(batch: list, *, collate_fn_map: dict) -> object:
            values = np.asarray(batch, dtype)
            if values.dtype.kind == "O":
                return torch.as_tensor(batch)  # raises as torch's collation does
            placed = out.empty(values.shape, values.dtype)
            placed[...] = values
            return placed
        return stack

    return {**default_collate_fn_map, torch.Tensor: tensors, np.ndarray: arrays,
            (np.bool_, np.number, np.object_): column(), float: column(np.float64),
            int: column()}


class RaggedCollate:
    """``collate_fn`` that keeps the named fields of the samples ragged, where torch's
    ``default_collate`` fails on tensors whose first dimensions differ (detection boxes, token
    sequences, encoded images as ``bytes``).

    ``RaggedCollate("boxes")`` for dict samples, ``RaggedCollate(1)`` for tuple samples (by
    position): each named field becomes one ``torch.nested`` jagged tensor, its items back to
    back in ``values()`` with ``offsets()``; every other field is collated by
    ``default_collate``. Naming the fields, rather than going ragged wherever lengths differ,
    keeps each field's type the same in every batch, even one whose items happen to be equal.
    Items of a dtype torch lacks (numpy strings, records) become a ``shmseq.Ragged`` of numpy
    arrays instead. The result is a torch object, so torch's own ``DataLoader`` gives the same
    batches (its workers pickle a jagged tensor through its queues as any tensor); through
    ``shmseq.torch.DataLoader`` the jagged tensor is written into the slot once and delivered as
    views of it."""

    def __init__(self, *fields: str | int) -> None:
        if not fields:
            raise ValueError("RaggedCollate needs the fields to keep ragged: keys of dict samples "
                             "(RaggedCollate('boxes')) or positions of tuple samples (RaggedCollate(1))")
        unhashable = [field for field in fields if not isinstance(field, Hashable)]
        if unhashable:
            raise TypeError(f"RaggedCollate takes each field as an argument of its own, got "
                            f"{unhashable[0]!r}: write RaggedCollate('boxes', 'jpg'), not "
                            "RaggedCollate(['boxes', 'jpg'])")
        self.fields = fields

    def __call__(self, samples: list) -> Any:
        first = samples[0]
        if isinstance(first, dict):
            self._check_fields(list(first), "keys")
            return {key: self._column(key, [sample[key] for sample in samples]) for key in first}
        if isinstance(first, (tuple, list)):
            self._check_fields(range(len(first)), "positions")
            columns = [self._column(place, list(column)) for place, column in
                       enumerate(zip(*samples))]
            return type(first)(*columns) if hasattr(type(first), "_fields") else columns
        raise TypeError(f"RaggedCollate names fields of dict or tuple samples, got a "
                        f"{type(first).__name__}: return a dict or tuple from the dataset")

    def _check_fields(self, known: Collection[object], kind: str) -> None:
        missing = [field for field in self.fields if field not in known]
        if missing:
            raise ValueError(f"RaggedCollate{self.fields!r}: the samples have no field "
                             f"{missing[0]!r} (their {kind}: {list(known)}); name one of those")

    def _column(self, field: str | int, items: list) -> Any:
        if field not in self.fields:
            return default_collate(items)
        try:
            ragged = Ragged.from_items(items)
        except ValueError as exc:
            raise ValueError(f"RaggedCollate: field {field!r}: {exc}") from None
        return _jagged(ragged)


def _jagged(ragged: Ragged) -> Ragged | torch.Tensor:
    """The items as a jagged tensor; a ``Ragged`` of numpy arrays where torch has no dtype for
    them (strings, records), as the ring delivers such a leaf."""
    values = ragged.values
    if isinstance(values, np.ndarray):
        try:
            values = torch.as_tensor(values)
        except TypeError:
            return ragged
    return make_leaf(values, torch.from_numpy(ragged.offsets))
