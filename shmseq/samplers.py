"""MXNet Gluon's samplers: iterables of sample indices, and of batches of them.

``DataLoader`` does not need them for plain shuffling (its own seeded plan is
reproducible and resumable); they are here for code written against Gluon's
``sampler=`` and ``batch_sampler=`` arguments.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sized

import numpy as np

from .engine import LAST_BATCH_POLICIES


class SequentialSampler:
    """0, 1, ..., length - 1 (from ``start``)."""

    def __init__(self, length: int, start: int = 0) -> None:
        self._length, self._start = length, start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._start + self._length))

    def __len__(self) -> int:
        return self._length


class RandomSampler:
    """A fresh random permutation of ``range(length)`` at every pass (seeded once)."""

    def __init__(self, length: int, seed: int | None = None) -> None:
        self._length = length
        self._rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rng.permutation(self._length).tolist())

    def __len__(self) -> int:
        return self._length


class BatchSampler:
    """Groups a sampler's indices into batches; ``last_batch`` as in Gluon (keep, discard,
    rollover: the short last batch is carried into the next pass)."""

    def __init__(self, sampler: Iterable[int], batch_size: int, last_batch: str = "keep") -> None:
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {', '.join(map(repr, LAST_BATCH_POLICIES))}, "
                             f"got {last_batch!r}")
        self._sampler, self._batch_size, self._last_batch = sampler, batch_size, last_batch
        self._carried: list[int] = []

    @property
    def sampler(self) -> Iterable[int]:
        """The sampler batched (``set_epoch`` reaches it through here, as through torch's)."""
        return self._sampler

    def state_dict(self) -> dict:
        """The samples carried into the next pass (rollover): a loader's state keeps them."""
        return {"carried": [int(index) for index in self._carried]}

    def load_state_dict(self, state: dict) -> None:
        self._carried = list(state["carried"])

    def __iter__(self) -> Iterator[list[int]]:
        batch, self._carried = self._carried, []
        for index in self._sampler:
            batch.append(index)
            if len(batch) == self._batch_size:
                yield batch
                batch = []
        if batch and self._last_batch == "keep":
            yield batch
        elif self._last_batch == "rollover":
            self._carried = batch

    def __len__(self) -> int:
        if not isinstance(self._sampler, Sized):
            raise TypeError(f"object of type '{type(self._sampler).__name__}' has no len()")
        samples = len(self._sampler) + len(self._carried)
        if self._last_batch == "keep":
            return -(-samples // self._batch_size)
        return samples // self._batch_size
