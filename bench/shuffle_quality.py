"""How well bounded shuffles mix a data set whose shards were written class by class, and what
each must hold at once: shmseq's shuffle_shards (its shard cache's unit) and shuffle_window,
against WebDataset's buffer (``shuffle(1000)`` after its shards are shuffled) and MosaicML
streaming's py1e. The figures behind the default of ``ShardSequence(shuffle_shards=...)``.

    python bench/shuffle_quality.py            # 200 classes x 1000 samples, shards of 1000
    python bench/shuffle_quality.py 1000 1281  # ImageNet's shape: 1000 classes of 1281

WebDataset's and py1e's orders are re-implemented here in numpy from their algorithms (no
package needed): webdataset's ``_shuffle`` (a buffer of ``bufsize`` samples, yielding a random
one once it holds ``initial``, filled two at a time while it is not full) over shards in a random
order, in one stream (one worker); streaming's ``get_shuffle_py1e`` on one canonical node (the
shards in a random order, each shuffled within, each sample then shifted uniformly within
+-(block - shard)/2 places, block drawn in [0.75, 1.25) x ``block_size``).

Per order: how far samples move from their place in the order of their shards (median, 99th
percentile, as samples), the shards read at once (most; mean) or samples held (WebDataset's
buffer), and per batch of 256: distinct labels (mean; least) and the longest run of one label
(mean; most). Every shard is one class, so a batch's labels are its shards.
"""
import sys

import numpy as np

from shmseq.shards import Shard, ShardIndex, ShardPlan

BATCH = 256


def shard_order(sizes: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shards in a random order: (their order, the ids shard after shard)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    order = rng.permutation(len(sizes))
    return order, np.concatenate([np.arange(starts[s], starts[s + 1]) for s in order])


def webdataset(sizes: np.ndarray, seed: int, bufsize: int = 1000, initial: int = 100) -> np.ndarray:
    """webdataset's shuffle(bufsize) over its shards in a random order (``shardshuffle``)."""
    rng = np.random.default_rng(seed)
    stream = iter(shard_order(sizes, rng)[1].tolist())
    picks = iter(rng.random(int(sizes.sum())).tolist())
    out, buf = [], []
    initial = min(initial, bufsize)

    def pick():
        k = int(next(picks) * len(buf))
        sample, buf[k] = buf[k], buf[-1]
        buf.pop()
        return sample

    for sample in stream:
        buf.append(sample)
        if len(buf) < bufsize:  # filled two at a time while not full
            extra = next(stream, None)
            if extra is not None:
                buf.append(extra)
        if len(buf) >= initial:
            out.append(pick())
    while buf:
        out.append(pick())
    return np.array(out, np.int64)


def py1e(sizes: np.ndarray, seed: int, block_size: int = 1 << 18) -> np.ndarray:
    """MosaicML streaming's py1e on one canonical node."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    order = rng.permutation(len(sizes))
    ids = np.concatenate([rng.permutation(np.arange(starts[s], starts[s + 1])) for s in order])
    positions = np.arange(len(ids), dtype=np.float64)
    offset = 0
    for span in sizes[order]:
        block = rng.integers(int(0.75 * block_size), int(1.25 * block_size))
        cutoff = max((block - span) / 2, 0)
        low, high = max(-cutoff, -offset), min(cutoff, len(ids) - offset - span)
        positions[offset:offset + span] += rng.uniform(low, high, span)
        offset += span
    return ids[np.argsort(positions, kind="stable")]


def shmseq(sizes: np.ndarray, seed: int, nodes: int = 1, **window) -> np.ndarray:
    """The epoch's order; on ``nodes`` nodes of one rank each, the first node's (its rank's)."""
    index = ShardIndex(Shard(f"{n}", np.arange(size, dtype=np.int64), int(size))
                       for n, size in enumerate(sizes))
    return ShardPlan(index, BATCH, shuffle=True, seed=seed, rank=0, world_size=nodes,
                     nodes=range(nodes), **window).order(0)


def full(sizes: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(int(sizes.sum()))


def measure(order: np.ndarray, sizes: np.ndarray, held: str | None = None) -> dict:
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    shards = shard_of[order]
    begin = np.full(len(sizes), len(order))
    np.minimum.at(begin, shards, np.arange(len(order)))
    started = np.argsort(begin, kind="stable")  # the shards in the order the stream starts them
    before = np.empty(len(sizes), np.int64)  # samples of the shards started before each
    before[started] = np.concatenate([[0], np.cumsum(sizes[started])])[:-1]
    in_shard_order = before[shard_of] + np.arange(len(shard_of)) - starts[shard_of]  # by sample id
    moved = np.abs(np.arange(len(order)) - in_shard_order[order])
    begin = np.full(len(sizes), len(order))
    end = np.zeros(len(sizes), np.int64)
    np.minimum.at(begin, shards, np.arange(len(order)))
    np.maximum.at(end, shards, np.arange(len(order)))
    read = begin < len(order)  # a node's order reads its own shards only
    change = np.zeros(len(order) + 1, np.int64)
    np.add.at(change, begin[read], 1)
    np.add.at(change, end[read] + 1, -1)
    open_shards = np.cumsum(change)[:len(order)]
    batches = shards[:len(order) // BATCH * BATCH].reshape(-1, BATCH)
    distinct = np.array([len(np.unique(b)) for b in batches])
    runs = np.array([max(np.diff(np.flatnonzero(np.diff(np.r_[-1, b, -1]) != 0))) for b in batches])
    return {"moved": (int(np.median(moved)), int(np.percentile(moved, 99))),
            "held": held or f"{open_shards.max()} shards ({open_shards.mean():.1f})",
            "distinct": (distinct.mean(), distinct.min()), "run": (runs.mean(), runs.max())}


def main(classes: int = 200, per_class: int = 1000):
    sizes = np.full(classes, per_class, np.int64)  # a shard per class
    rows = [("full shuffle (random access to everything)", full(sizes, 0), "the whole set")]
    for window in (1, 2, 4, 8, 16, 32):
        rows.append((f"shmseq shuffle_shards={window}", shmseq(sizes, 0, shuffle_shards=window), None))
    for nodes in (2, 4):
        rows.append((f"shmseq shuffle_shards=8, one of {nodes} nodes ({1 / nodes:.0%} of the shards)",
                     shmseq(sizes, 0, nodes, shuffle_shards=8), None))
    rows.append(("shmseq shuffle_window=1000", shmseq(sizes, 0, shuffle_window=1000), None))
    rows.append(("WebDataset shuffle(1000)", webdataset(sizes, 0), "1000 samples"))
    rows.append(("WebDataset shuffle(5000)", webdataset(sizes, 0, 5000), "5000 samples"))
    for shards in (4, 8, 16):
        rows.append((f"py1e block_size={shards * per_class}", py1e(sizes, 0, shards * per_class), None))
    rows.append((f"py1e block_size={1 << 18} (default)", py1e(sizes, 0), None))
    print(f"{classes} classes x {per_class} samples, a shard per class; batches of {BATCH}\n")
    print("| order | moved (median; p99) | holds at once (most; mean) | distinct labels / batch "
          "(mean; least) | longest label run / batch (mean; most) |")
    print("|---|---|---|---|---|")
    for name, order, held in rows:
        assert len(np.unique(order)) == len(order) and order.max() < sizes.sum(), name
        found = measure(order, sizes, held)
        print(f"| {name} | {found['moved'][0]:,}; {found['moved'][1]:,} | {found['held']} | "
              f"{found['distinct'][0]:.1f}; {found['distinct'][1]} | "
              f"{found['run'][0]:.1f}; {found['run'][1]} |")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
