"""Accelerate DDP on 2 CPU ranks (gloo), fed by a shmseq.torch.DataLoader built before
``Accelerator()``; every rank writes the sample indices it trained on.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_ddp.py OUT --tag full --save-at 5
    torchrun --standalone --nproc_per_node=2 examples/accelerate_ddp.py OUT --tag resumed \\
        --resume OUT/step5

The loader stays out of ``accelerator.prepare``: Accelerate wraps only torch's ``DataLoader``
and hands anything else back untouched, so passing it would change nothing. The loader deals
its own plan to the ranks when an epoch starts, by which time ``Accelerator()`` has set up
the process group. Accelerate saves only the loaders it prepared, so this one is registered
with ``register_for_checkpointing``: ``save_state`` stores its ``state_dict()`` (rank 0's, as
for every custom object) and ``load_state`` loads it on every rank; ``loader.epoch`` is then
the epoch to go on with, and ``set_epoch`` of that epoch keeps the restored position.
"""
import json
import os

import torch
from accelerate import Accelerator

from shmseq.torch import DataLoader

from indexed_run import Indexed, parse_args


def train(accelerator: Accelerator, loader: DataLoader, model, optimizer, args) -> list[dict]:
    """Epochs from the loader's own (restored) epoch on; saves the state once after step
    ``--save-at`` and trains on, so that the run is also the reference a resumed run repeats."""
    seen, step = [], 0
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y, index in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            seen.append({"epoch": epoch, "indices": index.tolist()})
            step += 1
            if step == args.save_at:
                accelerator.save_state(args.out / f"step{step}")  # a collective: every rank
    return seen


def main() -> None:
    args = parse_args(__doc__.splitlines()[0],
                      "save_state after this optimizer step", "directory of a save_state to resume from")
    # Seeded per rank (as set_seed(..., device_specific=True) would): the shuffle seeds the
    # ranks draw differ, and they shuffle alike only by taking rank 0's at the first epoch.
    torch.manual_seed(args.seed + int(os.environ.get("RANK", 0)))
    loader = DataLoader(Indexed(args.samples), batch_size=args.batch_size, shuffle=True,
                        num_workers=1, persistent_workers=True)
    drawn = loader.seed
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.resume)
    seen = train(accelerator, loader, model, optimizer, args)
    report = {"rank": accelerator.process_index, "drawn_seed": drawn, "seed": loader.seed,
              "batches": seen}
    loader.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}-rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()  # no rank tears the process group down under another
    accelerator.end_training()


if __name__ == "__main__":
    main()
