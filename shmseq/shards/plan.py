"""The order of a stream of shards: ``ShardPlan``, an ``EpochPlan`` whose epochs are drawn from
the seed and dealt to the nodes shard by shard, then to each node's ranks batch by batch, so that
a node reads its own shards only and a run resumes on another number of nodes and ranks.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import numpy as np

from ..engine import EpochPlan
from .index import ShardIndex

Layout = tuple[int, ...]  # each rank's node, nodes numbered in the order their first rank comes
History = list[tuple[Layout, int]]  # an epoch's runs before a resume: (their layout, steps taken)


def as_layout(nodes: Sequence[Any]) -> Layout:
    """Each rank's node number, from any labels of the ranks' nodes (equal labels: one node),
    numbered in the order of their first rank."""
    numbers: dict[Any, int] = {}
    return tuple(numbers.setdefault(label, len(numbers)) for label in nodes)


class ShardPlan(EpochPlan):
    """The epoch's ids. Each node (the ranks sharing one shard cache, ``nodes``: each rank's
    node) owns shards drawn once from the seed and its number of nodes and ranks, balanced by
    samples, so that from epoch to epoch it reads its own shards only (its cache keeps them).
    Each epoch a node's stream puts its shards in an order drawn from (seed, epoch) and moves
    samples within ``shuffle_window`` places; its ranks take the stream's batches in turn (rank
    r of the node takes batches r, r + ranks, ...). Every rank gets as many samples: a node with
    more than its ranks' share hands the surplus (the last samples of its last shards) to nodes
    with less, which read them at the end of their stream (a few reads of another node's shards).
    With one node the stream is the epoch's ``global_order``, dealt as such.

    With ``shuffle_shards`` (W) instead, the window is measured in shards: a stream's shards, in
    the epoch's order, are dealt to W lanes in turn, each shard's samples shuffled within, and
    the lanes are read in a uniformly random interleaving. Every point of the stream, its first
    and last batches too, draws from W shards (one per lane: what a shard cache holds), and each
    shard is read in one stretch.

    A resume on another layout (``resume_after``) deals only what the runs before left: the
    samples their ranks took are recomputed from each run's layout and steps.
    ``on_release`` hears where the consumer is (a shard cache's prefetcher follows it)."""

    def __init__(self, index: ShardIndex, batch_size: int, *, shuffle_window: int = 1000,
                 shuffle_shards: int | None = None, nodes: Sequence[Any] | None = None,
                 **options: Any) -> None:
        super().__init__(np.arange(len(index), dtype=np.int64), batch_size, **options)
        self.shard_index = index
        self.shuffle_window = shuffle_window
        self.shuffle_shards = shuffle_shards
        self.nodes: Layout | None = as_layout(nodes) if nodes is not None else None
        self._history: dict[int, History] = {}  # epoch -> the runs before a resume
        self._owners: dict[tuple[int, ...], np.ndarray] = {}  # (seed, ranks per node) -> nodes
        self.on_release: Callable[[int, int], None] | None = None

    def set_nodes(self, nodes: Sequence[Any] | None) -> None:
        """Each rank's node (any labels, one per rank), found once the ranks are known."""
        layout = as_layout(nodes) if nodes is not None else None
        if layout != self.nodes:
            self.nodes = layout
            self.version += 1

    @property
    def layout(self) -> Layout:
        """Each rank's node; one node when none were told for this world size."""
        if self.nodes is not None and len(self.nodes) == self.world_size:
            return self.nodes
        return (0,) * self.world_size

    def global_order(self, epoch: int) -> np.ndarray:
        """Every id of the epoch once, as one node reads them."""
        if not self.shuffle or not len(self.indices):
            return self.indices
        return self._stream(np.random.default_rng([self.seed, epoch]),
                            np.arange(len(self.shard_index.shards)))[0]

    def _stream(self, rng: np.random.Generator, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, by shard): the samples of ``shards`` in the order ``rng`` draws, and in
        the order of their shards (the stream's shards, in their drawn order)."""
        index = self.shard_index
        shards = shards[rng.permutation(len(shards))]
        empty = np.empty(0, np.int64)
        ids = np.concatenate([empty, *(np.arange(index.starts[s], index.starts[s + 1]) for s in shards)])
        by_shard = ids
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
        return ids, by_shard

    def owners(self, layout: Layout) -> np.ndarray:
        """Each shard's node: the shards, largest first (ties in an order drawn from the seed
        and the ranks per node), each to the node with the fewest samples per rank so far. The
        same every epoch, so that a node's cache keeps its shards."""
        ranks = tuple(np.bincount(layout).tolist())
        key = (self.seed, *ranks)
        if key not in self._owners:
            sizes = np.diff(self.shard_index.starts)
            order = np.random.default_rng(key).permutation(len(sizes))
            order = order[np.argsort(-sizes[order], kind="stable")]
            owner = np.empty(len(sizes), np.int64)
            loads = [(0.0, node) for node in range(len(ranks))]
            for shard in order.tolist():
                load, node = heapq.heappop(loads)
                owner[shard] = node
                heapq.heappush(loads, (load + sizes[shard] / ranks[node], node))
            self._owners[key] = owner
        return self._owners[key]

    def own_shards(self) -> np.ndarray:
        """The shards this rank's node owns: what its cache fetches (all of them on one node)."""
        layout = self.layout
        if max(layout, default=0) == 0:
            return np.arange(len(self.shard_index.shards))
        return np.flatnonzero(self.owners(layout) == layout[self.rank])

    def _node_streams(self, epoch: int, layout: Layout) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each node's (stream, by shard) of ``epoch``."""
        if max(layout, default=0) == 0:
            order = self.global_order(epoch)
            return [(order, order)]
        owner, count = self.owners(layout), max(layout) + 1
        if not self.shuffle:
            return [(ids, ids) for ids in (self.indices[np.repeat(owner, np.diff(
                self.shard_index.starts)) == node] for node in range(count))]
        return [self._stream(np.random.default_rng([self.seed, epoch, count, node]),
                             np.flatnonzero(owner == node)) for node in range(count)]

    def dealt(self, epoch: int, layout: Layout, taken: np.ndarray | None = None) -> list[np.ndarray]:
        """Every rank's samples of ``epoch`` under ``layout``, ``taken`` (a mask of the samples
        runs before took) left out: each node's stream, balanced to its ranks' share (surplus
        handed on, padded by wrapping with ``keep``, cut with ``discard``), dealt to its ranks
        batch by batch."""
        layout = as_layout(layout)
        streams = self._node_streams(epoch, layout)
        if taken is not None:
            streams = [(ids[~taken[ids]], by_shard[~taken[by_shard]]) for ids, by_shard in streams]
        ranks = np.bincount(layout)
        total = sum(len(ids) for ids, _ in streams)
        per_rank = total // len(layout) if self.last_batch == "discard" else -(-total // len(layout))
        quotas = ranks * per_rank
        handed = self._handed(streams, quotas)
        dealt: list[np.ndarray] = [np.empty(0, np.int64)] * len(layout)
        pool = np.concatenate([np.empty(0, np.int64), *handed])
        at = 0
        for node, ((ids, _), given, quota) in enumerate(zip(streams, handed, quotas)):
            kept = ids[~np.isin(ids, given)] if len(given) else ids
            need = max(int(quota) - len(kept), 0)
            mine = np.concatenate([kept, pool[at:at + need]])
            at += need
            source = mine if len(mine) else np.concatenate([ids for ids, _ in streams])
            mine = np.resize(source, int(quota))  # wraps (pads), or cuts
            members = np.flatnonzero(np.asarray(layout) == node)
            for member, share in zip(members, self._to_ranks(mine, len(members), per_rank)):
                dealt[member] = share
        return dealt

    @staticmethod
    def _handed(streams: list[tuple[np.ndarray, np.ndarray]], quotas: np.ndarray) -> list[np.ndarray]:
        """What each node hands to nodes short of their quota: the last samples of its last
        shards, as many as it has over its quota and the others lack (the rest is cut)."""
        sizes = np.array([len(ids) for ids, _ in streams])
        lacking = int(np.maximum(quotas - sizes, 0).sum())
        handed = []
        for (_, by_shard), over in zip(streams, np.maximum(sizes - quotas, 0).tolist()):
            give = min(over, lacking)
            lacking -= give
            handed.append(by_shard[len(by_shard) - give:])
        return handed

    def _to_ranks(self, ids: np.ndarray, ranks: int, per_rank: int) -> list[np.ndarray]:
        """``ids`` (``ranks * per_rank`` of them) dealt to ``ranks`` batch by batch: whole
        rounds of a batch each, then each rank's part of the tail."""
        size = self.batch_size
        full = per_rank // size * size  # each rank's samples in whole batches
        rounds = ids[:full * ranks].reshape(-1, ranks, size)
        tail = ids[full * ranks:].reshape(ranks, -1)
        return [np.concatenate([rounds[:, rank].reshape(-1), tail[rank]]) for rank in range(ranks)]

    def release(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position``: told to ``on_release``."""
        if self.on_release is not None:
            self.on_release(epoch, position)

    def history(self, epoch: int) -> History:
        """The runs of ``epoch`` before a resume: each one's layout and steps taken."""
        return list(self._history.get(epoch, []))

    def resume_after(self, epoch: int, history: History) -> None:
        """Deal only what the runs of ``history`` (each: its layout, and the steps every one of
        its ranks had taken) left of ``epoch``, over this plan's ranks."""
        if history and self.last_batch == "rollover":
            raise ValueError("last_batch='rollover' carries samples across epochs: a stream "
                             "resumes on another world size with 'keep' or 'discard' only")
        self._history = {epoch: [(as_layout(layout), int(steps)) for layout, steps in history]} \
            if history else {}
        self.version += 1

    def _taken(self, epoch: int) -> np.ndarray | None:
        """The samples of ``epoch`` the runs before a resume took (a mask), or None."""
        if not self._history.get(epoch):
            return None
        taken = np.zeros(len(self.indices), bool)
        for layout, steps in self._history[epoch]:
            for ids in self.dealt(epoch, layout, taken):
                taken[ids[:steps * self.batch_size]] = True
        return taken

    def _per_rank(self, left: int) -> int:
        return left // self.world_size if self.last_batch == "discard" else -(-left // self.world_size)

    def length(self, epoch: int) -> int:
        taken = self._taken(epoch)
        if taken is None:
            return super().length(epoch)
        samples = self._per_rank(len(taken) - int(taken.sum()))
        return samples // self.batch_size if self.last_batch == "discard" else -(-samples // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        taken, layout = self._taken(epoch), self.layout
        if taken is None and max(layout, default=0) == 0 and self.world_size == 1:
            return self.global_order(epoch)
        return self.dealt(epoch, layout, taken)[self.rank]
