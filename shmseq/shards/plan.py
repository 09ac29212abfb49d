"""The order of a stream of shards: ``ShardPlan``, an ``EpochPlan`` whose epochs are drawn from
the seed and dealt to the ranks batch by batch, so that a run resumes on another world size.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..engine import EpochPlan
from .index import ShardIndex


class ShardPlan(EpochPlan):
    """The epoch's ids: shards in an order drawn from (seed, epoch), samples moved within
    ``shuffle_window`` places, dealt to the ranks batch by batch (rank r takes batches r,
    r + world_size, ...), so that the batches all ranks have taken after n steps are the first
    n * world_size of the epoch, whatever the number of workers. That prefix is what lets a run
    resume on another world size: the rest of the epoch is dealt anew (``resume_after``).

    With ``shuffle_shards`` (W) instead, the window is measured in shards: the shards, in the
    epoch's order, are dealt to W lanes in turn, each shard's samples shuffled within, and the
    lanes are read in a uniformly random interleaving. Every point of the stream, its first and
    last batches too, draws from W shards (one per lane: what a shard cache holds), and each
    shard is read in one stretch. ``on_release`` hears where the consumer is (a shard cache's
    prefetcher follows it)."""

    def __init__(self, index: ShardIndex, batch_size: int, *, shuffle_window: int = 1000,
                 shuffle_shards: int | None = None, **options: Any) -> None:
        super().__init__(np.arange(len(index), dtype=np.int64), batch_size, **options)
        self.shard_index = index
        self.shuffle_window = shuffle_window
        self.shuffle_shards = shuffle_shards
        self._consumed: dict[int, int] = {}  # epoch -> its first samples taken before a resume
        self.on_release: Callable[[int, int], None] | None = None

    def global_order(self, epoch: int) -> np.ndarray:
        """Every id of the epoch once, before dealing to ranks."""
        if not self.shuffle or not len(self.indices):
            return self.indices
        index = self.shard_index
        rng = np.random.default_rng([self.seed, epoch])
        shards = rng.permutation(len(index.shards))
        ids = np.concatenate([np.arange(index.starts[s], index.starts[s + 1]) for s in shards])
        if self.shuffle_shards is not None:
            places = np.repeat(np.arange(len(shards)), np.diff(index.starts)[shards])
            lanes = places % self.shuffle_shards
            in_lanes = ids[np.lexsort((rng.random(len(ids)), places, lanes))]  # shuffled within
            interleaved = np.argsort(rng.permutation(lanes), kind="stable")  # each lane's places
            ids = np.empty_like(ids)
            ids[interleaved] = in_lanes
        elif self.shuffle_window > 1:
            ids = ids[np.argsort(np.arange(len(ids)) + rng.uniform(0, self.shuffle_window, len(ids)),
                                 kind="stable")]
        return ids

    def release(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position``: told to ``on_release``."""
        if self.on_release is not None:
            self.on_release(epoch, position)

    def consumed(self, epoch: int) -> int:
        """How many of ``epoch``'s first samples (of its global order) a run before took."""
        return self._consumed.get(epoch, 0)

    def resume_after(self, epoch: int, consumed: int) -> None:
        """Deal only what follows the first ``consumed`` samples of ``epoch`` (every rank of
        the run that stopped had taken those), over this plan's ranks."""
        if consumed and self.last_batch == "rollover":
            raise ValueError("last_batch='rollover' carries samples across epochs: a stream "
                             "resumes on another world size with 'keep' or 'discard' only")
        self._consumed = {epoch: consumed} if consumed else {}
        self.version += 1

    def _per_rank(self, epoch: int) -> int:
        total = len(self.indices) - self.consumed(epoch)
        return total // self.world_size if self.last_batch == "discard" else -(-total // self.world_size)

    def length(self, epoch: int) -> int:
        if not self.consumed(epoch):
            return super().length(epoch)
        samples = self._per_rank(epoch)
        return samples // self.batch_size if self.last_batch == "discard" else -(-samples // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        ids = self.global_order(epoch)[self.consumed(epoch):]
        if self.world_size == 1 or not len(ids):
            return ids
        per_rank, size = self._per_rank(epoch), self.batch_size
        dealt = np.resize(ids, per_rank * self.world_size)  # wraps (pads), or cuts
        full = per_rank // size * size  # each rank's samples in whole batches
        rounds = dealt[:full * self.world_size].reshape(-1, self.world_size, size)
        tail = dealt[full * self.world_size:].reshape(self.world_size, -1)
        return np.concatenate([rounds[:, self.rank].reshape(-1), tail[self.rank]])
