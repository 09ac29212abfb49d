"""Train a tiny model with DistributedDataParallel (gloo, CPU), fed by shmseq on every rank.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py

Each rank's DataLoader takes its rank and world size from torch.distributed and sees its
own share of every epoch; all ranks get the same number of batches, so none waits on
another in the gradient all-reduce.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shmseq import DataLoader


class Points:
    """2-D points labelled by the side of a line they fall on; samples carry their index."""

    def __init__(self, count: int):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(count, 2)).astype(np.float32)
        self.y = (self.x @ np.array([1.0, -2.0]) > 0).astype(np.int64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--report", type=Path, help="write each rank's sample ids here (JSON)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Points(args.samples), batch_size=args.batch_size, shuffle=True, seed=0,
                        num_workers=1, out_type="cpu")
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        seen.append([])
        for x, y, index in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen[-1] += index.tolist()
        print(f"rank {rank} epoch {epoch}: {len(seen[-1])} samples, loss {loss.item():.3f}", flush=True)
    loader.close()
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
