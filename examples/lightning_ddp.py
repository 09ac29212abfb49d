"""Lightning DDP on 2 CPU ranks (gloo), fed by a shmseq.torch.DataLoader built before the
process group exists; every rank writes the sample indices it trained on.

    python examples/lightning_ddp.py OUT --tag full --save-at 5       # checkpoint at step 5
    python examples/lightning_ddp.py OUT --tag resumed --resume OUT/step5.ckpt

The loader is not a torch DataLoader, so Lightning neither re-shards it nor swaps its sampler:
it deals its own plan to the ranks when an epoch starts, by which time Lightning has set up
the process group. It has ``state_dict``/``load_state_dict``, so Lightning stores its state in
the checkpoint by itself (``FitLoop.on_save_checkpoint``, from rank 0, as for any loader) and
loads it on every rank before the resumed epoch starts (``FitLoop.setup_data``); the
``set_epoch`` Lightning calls next keeps the restored position. Lightning's ``ddp`` strategy
starts rank 1 by running this script again, hence the ``__main__`` guard.
"""
import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch

from shmseq.torch import DataLoader

from indexed_run import Indexed, parse_args


class Regression(pl.LightningModule):
    """A linear model that records, batch by batch, which samples it was fed."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append({"epoch": self.current_epoch, "batch": batch_idx,
                          "indices": index.tolist()})
        return torch.nn.functional.mse_loss(self.linear(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SaveAt(pl.Callback):
    """Checkpoints once, after optimizer step ``step``, and trains on: the run goes on to be
    the reference that a run resumed from that checkpoint must repeat exactly."""

    def __init__(self, step: int, path: Path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)  # a collective: every rank calls it


def main() -> None:
    args = parse_args(__doc__.splitlines()[0],
                      "checkpoint after this optimizer step", "checkpoint to resume from")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # warnings only, no banners
    pl.seed_everything(args.seed, verbose=False)  # the loader's shuffle seed is drawn from it
    loader = DataLoader(Indexed(args.samples), batch_size=args.batch_size, shuffle=True,
                        num_workers=1, persistent_workers=True)
    callbacks = [SaveAt(args.save_at, args.out / f"step{args.save_at}.ckpt")] if args.save_at else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    model = Regression()
    trainer.fit(model, train_dataloaders=loader, ckpt_path=args.resume)
    report = {"rank": trainer.global_rank, "seed": loader.seed, "batches": model.seen}
    loader.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}-rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
