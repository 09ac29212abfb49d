"""Accelerate DDP on 2 CPU ranks (gloo): the same training runs fed by torch's DataLoader and by
shmseq.torch's, prepared by Accelerate and not, for a side-by-side record of what each rank saw.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_ddp.py OUT

Each run trains ``--epochs`` epochs, evaluates after each (``gather_for_metrics``), saves its
state after step ``--save-at``; a second run then loads that state and trains on from there
(``skip_first_batches`` for the rest of the interrupted epoch), as a restarted job does.

* prepared: ``accelerator.prepare(loader)`` shards the batches to the ranks. It rebuilds the
  loader as torch's own (inside a ``DataLoaderShard``), so shmseq's loader is put back on its
  ring with ``shmseq.torch.on_ring``, after ``prepare`` and after ``skip_first_batches``.
* not prepared: the loader takes a ``DistributedSampler`` itself.

Rank N writes ``rankN.json``: per loader and mode, the full run and the resumed one.
"""
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import DistributedSampler

from shmseq.torch import DataLoader, on_ring

from indexed_run import Indexed, add_run_arguments

LOADERS = {"torch": TorchLoader, "shmseq": DataLoader}


def loaders(accelerator: Accelerator, Loader, args, prepared: bool):
    """The training and evaluation loaders, prepared by Accelerate or dealing to ranks
    themselves."""
    train_set, eval_set = Indexed(args.samples), Indexed(args.eval_samples)
    if prepared:
        train = Loader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=1)
        evaluate = Loader(eval_set, batch_size=args.batch_size, num_workers=1)
        return [keep_ring(loader, like) for loader, like in
                zip(accelerator.prepare(train, evaluate), (train, evaluate))]
    ranks = {"num_replicas": accelerator.num_processes, "rank": accelerator.process_index}
    train = Loader(train_set, batch_size=args.batch_size, num_workers=1,
                   sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed, **ranks))
    evaluate = Loader(eval_set, batch_size=args.batch_size, num_workers=1,
                      sampler=DistributedSampler(eval_set, shuffle=False, **ranks))
    return [train, evaluate]


def keep_ring(loader, like):
    """shmseq's loader back on its ring after Accelerate rebuilt it from ``like``; torch's as
    it is."""
    return on_ring(loader, like) if isinstance(like, DataLoader) else loader


def set_epoch(loader, epoch: int) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)  # prepared: tells its sampler
    else:
        loader.sampler.set_epoch(epoch)


def run(accelerator: Accelerator, Loader, args, prepared: bool, state: str, resume: bool) -> dict:
    accelerator.free_memory()  # forget the runs before: each run prepares its own model
    set_seed(args.seed)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    train, evaluate = loaders(accelerator, Loader, args, prepared)
    used = [train, evaluate]
    epoch, skip = 0, 0
    if resume:
        accelerator.load_state(state)
        epoch, skip = divmod(args.save_at, len(train))
    seen, gathered, step = [], [], args.save_at if resume else 0
    for epoch in range(epoch, args.epochs):
        set_epoch(train, epoch)
        batches = train
        if skip:  # the rest of the interrupted epoch
            batches = keep_ring(accelerator.skip_first_batches(train, skip), train)
            used.append(batches)
            skip = 0
        for x, y, index in batches:
            loss = torch.nn.functional.mse_loss(model(x.to(accelerator.device)).squeeze(1),
                                                y.to(accelerator.device))
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            seen.append({"epoch": epoch, "indices": index.tolist()})
            step += 1
            if step == args.save_at and not resume:
                accelerator.save_state(state)
        gathered.append(sum(len(accelerator.gather_for_metrics(index.to(accelerator.device)))
                            for _, _, index in evaluate))
    return {"batches": seen, "steps": step, "gathered": gathered,
            "ring_batches": sum(loader.stats.batches for loader in used if hasattr(loader, "stats"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--eval-samples", type=int, default=21)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    report = {}
    for name, Loader in LOADERS.items():
        for prepared in (True, False):
            key = f"{name}-{'prepared' if prepared else 'unprepared'}"
            state = os.path.join(args.out, f"state-{key}")
            report[key] = {"full": run(accelerator, Loader, args, prepared, state, resume=False),
                           "resumed": run(accelerator, Loader, args, prepared, state, resume=True)}
            accelerator.wait_for_everyone()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()  # no rank tears the process group down under another
    accelerator.end_training()


if __name__ == "__main__":
    main()
