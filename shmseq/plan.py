"""Epoch index plans: which sample indices go into which batch, epoch after epoch.

Batches are numbered across epochs by ``seq``: epoch ``e`` holds batches
``start(e) .. start(e) + length(e) - 1``. Two plans:

* ``EpochPlan``: a pure function of (indices, batch_size, shuffle, seed, last_batch,
  rank, world_size, epoch), so the pipeline, ``start_test()`` and a resumed run all
  see exactly the same batches, and any epoch can be rebuilt on its own.
* ``SamplerPlan``: batches drawn from a user's batch sampler, once per epoch, in order.

``BatchStream`` walks a plan for the workers' dispatcher: an endless stream of
``(seq, indices)`` that can jump forward.
"""
from __future__ import annotations

import numbers
import threading

import numpy as np

LAST_BATCH_POLICIES = ("keep", "discard", "rollover")


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
    """Cuts each epoch's sample order into batches.

    Shuffling draws from ``default_rng([seed, epoch])``. With ``world_size > 1`` the
    epoch's order is dealt to the ranks (``order[rank::world_size]``), padded by
    wrapping so that every rank gets as many samples (or cut, with
    ``last_batch='discard'``), as ``torch.utils.data.DistributedSampler`` does.
    ``last_batch='rollover'`` (MXNet's) carries a short last batch into the next
    epoch: the batches are then consecutive chunks of the endless concatenation of
    the epochs' orders, so ``start(e) = floor(e * n / batch_size)``.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, *, shuffle: bool, seed: int,
                 last_batch: str = "keep", rank: int = 0, world_size: int = 1):
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {', '.join(map(repr, LAST_BATCH_POLICIES))}, "
                             f"got {last_batch!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.indices = indices
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.last_batch = last_batch
        self.rank = rank
        self.world_size = world_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank sees in an epoch."""
        total, ranks = len(self.indices), self.world_size
        return total // ranks if self.last_batch == "discard" else -(-total // ranks)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's sample order for ``epoch``."""
        order = self.indices
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        if self.world_size == 1 or not len(order):
            return order
        dealt = np.resize(order, self.samples_per_epoch * self.world_size)  # wraps, or cuts
        return dealt[self.rank::self.world_size]

    def length(self, epoch: int) -> int:
        n, size = self.samples_per_epoch, self.batch_size
        if self.last_batch == "rollover":
            return (epoch + 1) * n // size - epoch * n // size
        return n // size if self.last_batch == "discard" else -(-n // size)

    def start(self, epoch: int) -> int:
        if self.last_batch == "rollover":
            return epoch * self.samples_per_epoch // self.batch_size
        return epoch * self.length(0)

    def forget_before(self, epoch: int) -> None:
        """Nothing to forget: any epoch can be rebuilt."""

    def has_batches(self) -> bool:
        n = self.samples_per_epoch
        return n >= self.batch_size if self.last_batch == "discard" else n > 0

    def locate(self, seq: int) -> tuple[int, int]:
        """(epoch, position in the epoch) of batch ``seq``."""
        if self.last_batch != "rollover":
            return divmod(seq, self.length(0))
        epoch = seq * self.batch_size // self.samples_per_epoch
        while self.start(epoch + 1) <= seq:
            epoch += 1
        while self.start(epoch) > seq:
            epoch -= 1
        return epoch, seq - self.start(epoch)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches, each a contiguous int64 array of sample indices."""
        size = self.batch_size
        if self.last_batch != "rollover":
            order = self.order(epoch)
            return [np.ascontiguousarray(order[at:at + size])
                    for at in range(0, self.length(epoch) * size, size)]
        first = self.start(epoch) * size
        samples = self._stream_slice(first, first + self.length(epoch) * size)
        return [samples[at:at + size] for at in range(0, len(samples), size)]

    def _stream_slice(self, begin: int, end: int) -> np.ndarray:
        """Samples ``begin:end`` of the concatenated epoch orders (rollover)."""
        n = self.samples_per_epoch
        parts = [self.order(epoch)[max(begin - epoch * n, 0):end - epoch * n]
                 for epoch in range(begin // n, -(-end // n))]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


def as_batch(indices):
    """A batch sampler's item as indices: one int64 array, or a list of them (multi-shard)."""
    if len(indices) and not isinstance(indices[0], numbers.Integral):
        return [np.asarray(part, dtype=np.int64) for part in indices]
    return np.asarray(indices, dtype=np.int64)


class SamplerPlan:
    """Batches from a user's batch sampler (any iterable of index lists), one pass per epoch.

    Epochs are drawn in order, once, and kept until the consumer is past them
    (``forget_before``), so that the dispatcher and the consumer agree on them.
    """

    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler
        self._epochs: dict[int, tuple[int, list]] = {}
        self._drawn = 0
        self._next_start = 0
        self._has_batches: bool | None = None
        self._lock = threading.Lock()

    def _epoch(self, epoch: int) -> tuple[int, list]:
        with self._lock:
            while self._drawn <= epoch:
                batches = [as_batch(indices) for indices in self.batch_sampler]
                self._epochs[self._drawn] = (self._next_start, batches)
                self._next_start += len(batches)
                self._drawn += 1
            if epoch not in self._epochs:
                raise ValueError(f"epoch {epoch} of a batch sampler is gone: a sampler is drawn "
                                 "once per epoch, in order, and cannot go back")
            return self._epochs[epoch]

    def forget_before(self, epoch: int) -> None:
        with self._lock:
            for old in [e for e in self._epochs if e < epoch]:
                del self._epochs[old]

    def length(self, epoch: int) -> int:
        return len(self._epoch(epoch)[1])

    def start(self, epoch: int) -> int:
        return self._epoch(epoch)[0]

    def batches(self, epoch: int) -> list:
        return self._epoch(epoch)[1]

    def has_batches(self) -> bool:
        if self._has_batches is None:
            self._has_batches = self.length(0) > 0  # a sampler yields as many every epoch
        return self._has_batches

    def locate(self, seq: int) -> tuple[int, int]:
        epoch = max(self._drawn - 1, 0)
        while self.start(epoch) > seq:
            epoch -= 1
        while seq >= self.start(epoch) + self.length(epoch):
            epoch += 1
        return epoch, seq - self.start(epoch)


class BatchStream:
    """An endless stream of ``(seq, batch indices)``, epoch after epoch, for the dispatcher."""

    def __init__(self, plan, start_seq: int = 0):
        self.plan = plan
        self.next_seq = start_seq
        self._first = self._end = 0   # the seqs of the epoch at hand
        self._batches: list = []

    def __bool__(self) -> bool:
        return self.plan.has_batches()

    def seek(self, seq: int) -> None:
        """Jump forward to ``seq`` (never backwards: those batches are in flight already)."""
        self.next_seq = max(self.next_seq, seq)

    def peek(self):
        """The next ``(seq, indices)``, left in the stream."""
        seq = self.next_seq
        if not self._first <= seq < self._end:
            epoch, position = self.plan.locate(seq)
            self._batches = self.plan.batches(epoch)
            self._first, self._end = seq - position, seq - position + len(self._batches)
        return seq, self._batches[seq - self._first]

    def take(self):
        """The next ``(seq, indices)``, taken out of the stream."""
        taken = self.peek()
        self.next_seq += 1
        return taken

    def indices_of(self, seq: int):
        epoch, position = self.plan.locate(seq)
        return self.plan.batches(epoch)[position]
