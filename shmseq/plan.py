"""Epoch index plans: which sample indices go into which batch, epoch after epoch.

A plan is a pure function of (indices, batch_size, shuffle, seed, epoch), so the
threaded/process pipeline and ``start_test()`` see exactly the same batches.
"""
from __future__ import annotations

import numbers

import numpy as np

LAST_BATCH_POLICIES = ("keep", "discard")


def as_index_array(dset_size) -> np.ndarray:
    """The dataset's sample indices from an int size or a 1-D index array."""
    if isinstance(dset_size, numbers.Integral) and not isinstance(dset_size, bool):
        if dset_size < 0:
            raise ValueError(f"dset_size must be >= 0, got {dset_size}; "
                             "pass the number of samples or a 1-D array of sample indices")
        return np.arange(int(dset_size), dtype=np.int64)
    try:
        indices = np.asarray(dset_size)
    except Exception as exc:  # noqa: BLE001 - reported with the argument's name
        raise TypeError(f"dset_size must be an int or a 1-D array of indices, "
                        f"got {type(dset_size).__name__}") from exc
    if indices.ndim != 1:
        raise ValueError(f"dset_size as an index array must be 1-D, got shape {indices.shape}")
    if indices.size and not np.issubdtype(indices.dtype, np.integer):
        raise TypeError(f"dset_size as an index array must hold integers, got dtype {indices.dtype}")
    return indices.astype(np.int64, copy=True)


class EpochPlan:
    """Cuts each epoch's (optionally shuffled) index order into batches.

    Shuffling draws from ``default_rng([seed, epoch])``: any epoch can be
    rebuilt on its own, which keeps ``start()`` and ``start_test()`` in step.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, *, shuffle: bool,
                 seed: int, last_batch: str = "keep"):
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
        self.indices = indices
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.last_batch = last_batch

    def __len__(self) -> int:
        full, rest = divmod(len(self.indices), self.batch_size)
        return full + (1 if rest and self.last_batch == "keep" else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order."""
        if not self.shuffle:
            return self.indices
        return np.random.default_rng([self.seed, epoch]).permutation(self.indices)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches, each a contiguous int64 array of sample indices."""
        order = self.order(epoch)
        size = self.batch_size
        return [np.ascontiguousarray(order[start:start + size])
                for start in range(0, len(self) * size, size)]


class BatchStream:
    """An endless stream of ``(seq, batch indices)``, epoch after epoch.

    ``seq`` numbers batches across epochs: batch ``k`` of epoch ``e`` is
    ``e * len(plan) + k``. The stream can jump forward (a consumer that left an
    epoch early starts the next one at its first batch).
    """

    def __init__(self, plan: EpochPlan, start_seq: int = 0):
        self.plan = plan
        self.next_seq = start_seq
        self._epoch = None
        self._batches: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return len(self.plan) > 0

    def seek(self, seq: int) -> None:
        self.next_seq = max(self.next_seq, seq)

    def take(self) -> tuple[int, np.ndarray]:
        epoch, position = divmod(self.next_seq, len(self.plan))
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self.plan.batches(epoch)
        seq = self.next_seq
        self.next_seq += 1
        return seq, self._batches[position]

    def indices_of(self, seq: int) -> np.ndarray:
        epoch, position = divmod(seq, len(self.plan))
        return self.plan.batches(epoch)[position]
