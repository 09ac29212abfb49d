"""Train a tiny model with DistributedDataParallel (gloo, CPU) on tar shards read by offset.

    torchrun --standalone --nproc_per_node=2 examples/ddp_shards.py --shards DIR/shards.json
    torchrun --standalone --nproc_per_node=2 examples/ddp_shards.py \
        --shards https://HOST/DIR/shards.json --cache-dir /scratch/shard-cache

Each rank's ``ShardSequence`` takes its rank and world size from torch.distributed and gets its
share of every epoch: as many batches as every other rank (padded by wrapping, or cut with
``--last-batch discard``), so none waits on another in the gradient all-reduce. Unequal batch
counts would leave one rank alone in a collective: the process group's timeout turns that hang
into an error, and the ranks also compare their step counts after every epoch.

Remote shards (a URL) are read through the node's shard cache (``shmseq.shards.cache``): every
shard fetched whole, once for all the node's ranks and their workers, into ``--cache-dir``, in a
folder named after torchrun's run id (``TORCHELASTIC_RUN_ID``: the same for every rank it starts;
with ``--standalone`` a new one at every launch, so a relaunched run fetches its shards again
unless ``SLURM_JOB_ID`` names the job).

A sample is a WebDataset-style group of members: ``<key>.id`` (its number, as text, also the
last part of its key), ``<key>.x`` (2 float32s) and ``<key>.cls`` (its label)::

    x = np.random.default_rng(0).normal(size=(500, 2)).astype(np.float32)
    write_shards(({"__key__": f"train/{i:05d}", "id": str(i), "x": x[i].tobytes(),
                   "cls": int(x[i, 0] > x[i, 1])} for i in range(500)),
                 "DIR/part-%02d.tar", samples_per_shard=64)

Each rank writes (``--report``) the sample numbers it saw and its steps, epoch by epoch, its
pid, and with the cache its folder and counts.
"""
import argparse
import datetime
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shmseq.shards import ShardSequence


def decode(sample: dict):
    """(features, label, sample number); the key must name the number the sample carries."""
    number = int(sample["id"])
    if not sample["__key__"].endswith(f"/{number:05d}"):
        raise ValueError(f"sample {sample['__key__']} carries id {number}")
    return np.frombuffer(sample["x"], np.float32), np.int64(int(sample["cls"])), np.int64(number)


def resumed_epoch(seq: ShardSequence, folder: Path | None) -> int:
    """The epoch to start with: a saved state's (loaded: the rest of that epoch comes first,
    dealt over this run's nodes and ranks, whatever the saved run's were), else 0."""
    saved = sorted(folder.glob("rank*.json")) if folder is not None else []
    if not saved:
        return 0
    state = json.loads(saved[0].read_text())
    seq.load_state_dict(state)
    return state["epoch"]


def save_state(seq: ShardSequence, folder: Path, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(seq.state_dict()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True,
                        help="a shard index (shards.json): a path, or a URL (http://, s3://, ...)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shuffle-window", type=int,
                        help="how far a sample may move from its shard's order (the default for "
                             "local shards: 1000)")
    parser.add_argument("--shuffle-shards", type=int,
                        help="instead, over how many shards a shard's samples are spread (the "
                             "default for remote shards: 8)")
    parser.add_argument("--cache-dir", type=Path,
                        help="read the shards through the node's shard cache, rooted here "
                             "(remote shards are read through it anyway, in $TMPDIR or /var/tmp "
                             "unless this is given)")
    parser.add_argument("--cache-bytes", type=int,
                        help="the node's shard cache budget (default: the data set, at most half "
                             "the free space)")
    parser.add_argument("--last-batch", choices=("keep", "discard"), default="keep")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a collective (or a batch) may wait before the run fails")
    parser.add_argument("--report", type=Path,
                        help="write each rank's batches (sample numbers) and steps here (JSON)")
    parser.add_argument("--stop-after", type=int,
                        help="stop after this many steps of the first epoch, each rank's state "
                             "saved in --state (a preemption, say)")
    parser.add_argument("--state", type=Path,
                        help="the folder of the ranks' states: written with --stop-after, read "
                             "(any rank's will do) when it holds one, to resume there")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seq = ShardSequence(args.shards, decode, batch_size=args.batch_size, num_workers=args.workers,
                        seed=args.seed, shuffle_window=args.shuffle_window,
                        shuffle_shards=args.shuffle_shards, cache=True if args.cache_dir else None,
                        cache_dir=args.cache_dir, cache_bytes=args.cache_bytes, out_type="cpu",
                        last_batch=args.last_batch, timeout=args.timeout)
    epochs, first = [], resumed_epoch(seq, args.state)
    with seq:
        for epoch in range(first, args.epochs):
            seq.set_epoch(epoch)
            batches, loss = [], torch.zeros(())
            for x, y, number in seq:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # DDP's all-reduce: every rank must take this step
                optimizer.step()
                batches.append(number.tolist())
                if args.stop_after is not None and len(batches) == args.stop_after:
                    save_state(seq, args.state, rank)
                    break
            steps = len(batches)
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, steps)
            if len(set(counts)) != 1:
                raise RuntimeError(f"epoch {epoch}: the ranks took {counts} steps")
            epochs.append({"epoch": epoch, "batches": batches, "steps": steps})
            print(f"rank {rank} epoch {epoch}: {steps} steps, {sum(map(len, batches))} samples, "
                  f"loss {loss.item():.3f}", flush=True)
            if args.stop_after is not None:
                break
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        report = {"rank": rank, "world_size": dist.get_world_size(), "epochs": epochs,
                  "batch_size": args.batch_size, "seed": args.seed, "pid": os.getpid(),
                  "shuffle_window": seq.shuffle_window, "shuffle_shards": seq.shuffle_shards,
                  "last_batch": args.last_batch}
        if seq.cache is not None:
            stats = seq.stats
            report["cache"] = {"folder": seq.cache.folder, "fetches": stats.shard_fetches,
                               "refetches": stats.shard_refetches,
                               "node_fetch_bytes": stats.node_fetch_bytes,
                               "node_share_bytes": stats.node_share_bytes}
        (args.report / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
