"""Lightning DDP on 2 CPU ranks (gloo): the same training run fed by torch's DataLoader and by
shmseq.torch's, for a side-by-side record of what each rank trained and validated on.

    python examples/lightning_ddp.py OUT --loader torch shmseq

A default Trainer (sanity check included), validating twice an epoch (``val_check_interval=0.5``),
checkpointing mid-epoch after step ``--save-at``; then a second Trainer resumes from that
checkpoint; each loader named runs so in turn, in the same two processes. Both loaders are built before the process group, as plain torch code builds them:
Lightning replaces their sampler with its ``DistributedSampler`` by building them again, so a
shmseq loader is rebuilt as a shmseq loader (the report says how many batches came through its
ring). Each rank writes ``LOADER-rankN.json``. Lightning's ``ddp`` strategy starts rank 1 by
running this script again, hence the ``__main__`` guard.
"""
import argparse
import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader as TorchLoader

from shmseq.torch import DataLoader

from indexed_run import Indexed, add_run_arguments

LOADERS = {"torch": TorchLoader, "shmseq": DataLoader}


class Regression(pl.LightningModule):
    """A linear model that records, batch by batch, which samples it trained and validated on."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: dict[str, list] = {"train": [], "val": []}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen["train"].append({"epoch": self.current_epoch, "step": self.global_step,
                                   "indices": index.tolist()})
        return torch.nn.functional.mse_loss(self.linear(x).squeeze(1), y)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y, index = batch
        self.seen["val"].append({"epoch": self.current_epoch, "step": self.global_step,
                                 "sanity": self.trainer.sanity_checking, "indices": index.tolist()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SaveAt(pl.Callback):
    """Checkpoints once, after optimizer step ``step``, and trains on."""

    def __init__(self, step: int, path: Path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)  # a collective: every rank calls it


def fit(Loader, args, checkpoint: Path, resume: bool) -> dict:
    """One Trainer's run: what it saw, and how many batches came through shmseq's ring."""
    pl.seed_everything(args.seed, verbose=False)
    train = Loader(Indexed(args.samples), batch_size=args.batch_size, shuffle=True, num_workers=1)
    val = Loader(Indexed(args.val_samples), batch_size=args.batch_size, num_workers=1,
                 persistent_workers=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         val_check_interval=0.5, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[] if resume else [SaveAt(args.save_at, checkpoint)])
    model = Regression()
    trainer.fit(model, train, val, ckpt_path=checkpoint if resume else None)
    used = {"train": trainer.train_dataloader, "val": trainer.val_dataloaders}
    return {**model.seen, "steps": trainer.global_step,
            "loaders": {part: type(loader).__module__ for part, loader in used.items()},
            "ring_batches": {part: loader.stats.batches if hasattr(loader, "stats") else 0
                             for part, loader in used.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--loader", choices=sorted(LOADERS), nargs="+", required=True)
    parser.add_argument("--val-samples", type=int, default=21)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # no banners, no advice
    for name in args.loader:
        checkpoint = args.out / f"{name}-step{args.save_at}.ckpt"
        report = {"full": fit(LOADERS[name], args, checkpoint, resume=False),
                  "resumed": fit(LOADERS[name], args, checkpoint, resume=True)}
        rank = torch.distributed.get_rank()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
