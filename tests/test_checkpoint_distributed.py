"""A torchtitan-style checkpoint under torchrun: model, optimizer and each rank's
``StatefulDataLoader`` state saved together with ``torch.distributed.checkpoint``, then a
second launch resumes from it. On the same world size the resumed steps are the uninterrupted
run's, loss for loss; on another (which torchtitan refuses for its data loader), the new ranks
read what no rank had read of the epoch, each sample once, then the sampler's next epoch."""
import collections
import json
import sys
import warnings
from pathlib import Path

import pytest

from jobs import output_of
from leaks import shm_entries

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

SAMPLES = 56    # 7 batches for each worker of 2 ranks; the 36 unread at SAVE_AT deal evenly to 3
BATCH = 2
SAVE_AT = 5     # mid-epoch, and an odd step: the resume starts at the loader's second worker
EPOCHS = 2
SEED = 3

SCRIPT = '''
"""Train nn.Linear on every rank (DDP, gloo, CPU) fed by shmseq's StatefulDataLoader; save
model, optimizer and loader with torch.distributed.checkpoint at a step, or resume from it."""
import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from shmseq.torch import StatefulDataLoader

WEIGHTS = torch.tensor([0.5, -1.0, 2.0, 0.1])


def sample(index):
    """Features and target computed from the id alone: every run sees the same sample."""
    x = torch.tensor([math.sin(index), math.cos(index), index / 64, 1.0])
    return x, x @ WEIGHTS, index


class Shard(IterableDataset):
    """This rank's share of the global samples, split again among the loader's workers; its
    state is how far its worker's stream has read."""

    def __init__(self, count, rank, world):
        self.ids = list(range(count))[rank::world]
        self.position = 0

    def __iter__(self):
        info = get_worker_info()
        mine = self.ids if info is None else self.ids[info.id::info.num_workers]
        while self.position < len(mine):
            self.position += 1
            yield sample(mine[self.position - 1])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Points(Dataset):
    """The global samples, for a DistributedSampler to deal to the ranks."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return sample(index)


class LoaderState(Stateful):
    """The loader's state as torchtitan saves it: serialized, under this rank's own key."""

    def __init__(self, loader, key):
        self.loader, self.key = loader, key

    def state_dict(self):
        return {self.key: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state):
        self.loader.load_state_dict(json.loads(state[self.key]))


class TrainState(Stateful):
    """Model, optimizer, and the epoch and step the checkpoint was taken at."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.epoch = self.step = 0

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer,
                "progress": torch.tensor([self.epoch, self.step])}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.epoch, self.step = state["progress"].tolist()


def loader_key(resume, rank):
    """This rank's saved loader state; on a rank the saving run did not have, rank 0's (each
    rank's state says how far the ranks read together)."""
    own = f"dp_rank_{rank}"
    if resume is None:
        return own
    saved = dcp.FileSystemReader(resume).read_metadata().state_dict_metadata
    return own if f"dataloader.{own}" in saved else "dp_rank_0"


def make_loader(args, case, rank, world):
    """The loader and, for the map-style case, its DistributedSampler (set_epoch each epoch)."""
    if case == "stream":
        dataset, sampler = Shard(args.samples, rank, world), None
    else:
        dataset = Points(args.samples)
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=2)
    return loader, sampler


def under(folder, case):
    """A case's checkpoint in a run's folder of them; None without one."""
    return None if folder is None else folder / case


def train(args, case, rank, world):
    """Run to the end of the last epoch, saving at args.save_at; one JSON line a step."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    loader, sampler = make_loader(args, case, rank, world)
    progress = TrainState(model, optimizer)
    resume = under(args.resume, case)
    states = {"train": progress, "dataloader": LoaderState(loader, loader_key(resume, rank))}
    if resume is not None:
        dcp.load(states, checkpoint_id=resume)
    step = progress.step
    with open(args.out / f"{case}-rank{rank}.jsonl", "w") as log:
        log.write(json.dumps({"pid": os.getpid()}) + "\\n")
        for epoch in range(progress.epoch, args.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for x, y, ids in loader:
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                log.write(json.dumps({"epoch": epoch, "step": step, "ids": ids.tolist(),
                                      "loss": loss.item()}) + "\\n")
                if step == args.save_at:
                    progress.epoch, progress.step = epoch, step
                    dcp.save(states, checkpoint_id=under(args.checkpoint, case))
    loader.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", type=lambda text: text.split(","), help="stream,sampler")
    parser.add_argument("out", type=Path)
    for name in ("samples", "batch", "epochs", "seed", "save_at"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    try:
        for case in args.cases:  # one launch for both: each torchrun start costs seconds
            train(args, case, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


main()
'''


def torchrun(tmp_path: Path, ranks: int, cases: str, out: str, *options: str) -> dict:
    """Run the script on ``ranks`` ranks; each case's steps on each rank, once the ranks'
    rings are gone from /dev/shm."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(script), cases, str(tmp_path / out),
               f"--samples={SAMPLES}", f"--batch={BATCH}", f"--epochs={EPOCHS}",
               f"--seed={SEED}", f"--save_at={SAVE_AT}", *options]
    output_of(command, timeout=120)  # ranks with unequal batch counts would wait for each other
    steps = {}
    for case in cases.split(","):
        logs = [[json.loads(line) for line in (tmp_path / out / f"{case}-rank{rank}.jsonl").open()]
                for rank in range(ranks)]
        assert not shm_entries({log[0]["pid"] for log in logs})
        steps[case] = [log[1:] for log in logs]
    return steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted 2-rank runs of both cases, checkpointed at SAVE_AT: the folder of
    their checkpoints, and their steps."""
    tmp_path = tmp_path_factory.mktemp("saved")
    return tmp_path, torchrun(tmp_path, 2, "stream,sampler", "whole",
                              f"--checkpoint={tmp_path / 'checkpoints'}")


def resumed(saved: tuple[Path, dict], ranks: int, case: str) -> list[list[dict]]:
    """Each rank's steps, resumed on ``ranks`` ranks from the case's checkpoint."""
    tmp_path = saved[0]
    return torchrun(tmp_path, ranks, case, f"resumed-{case}-{ranks}",
                    f"--resume={tmp_path / 'checkpoints'}")[case]


def saved_loader_state(saved: tuple[Path, dict], case: str, rank: int) -> dict:
    """The loader state ``rank`` saved in the case's checkpoint, read back here as a resumed
    rank reads it."""
    key = f"dp_rank_{rank}"
    state = {"dataloader": {key: ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp notes that one process reads
        dcp.load(state, checkpoint_id=saved[0] / "checkpoints" / case, no_dist=True)
    return json.loads(state["dataloader"][key])


def test_a_stream_resumes_on_the_same_world_size_loss_for_loss(saved):
    """Each rank's IterableDataset state is saved in its own loader workers (where each
    worker's stream stands) and restored there: the resumed steps read the same samples and,
    model and optimizer restored, give the same losses."""
    whole = saved[1]["stream"]
    handed = [BATCH * ((SAVE_AT + 1 - worker) // 2) for worker in (0, 1)]  # turn by turn
    for rank in (0, 1):
        workers = saved_loader_state(saved, "stream", rank)["_snapshot"]["_worker_snapshots"]
        assert [workers[f"worker_{w}"]["dataset_state"] for w in (0, 1)] == [
            {"position": count} for count in handed]
    again = resumed(saved, 2, "stream")
    for rank in (0, 1):
        assert len(whole[rank]) == EPOCHS * SAMPLES // 2 // BATCH
        assert again[rank] == whole[rank][SAVE_AT:]


def expected_epoch(epoch: int, rank: int, world: int) -> list[int]:
    """What ``rank`` of ``world`` reads in ``epoch``: the DistributedSampler's own pass."""
    sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, shuffle=True,
                                 seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def read_in(steps: list[dict], epoch: int) -> list[int]:
    """The sample ids a rank's steps read in ``epoch``."""
    return [sample for step in steps if step["epoch"] == epoch for sample in step["ids"]]


@pytest.mark.parametrize("world", [1, 3])
def test_a_distributed_sampler_resumes_on_another_world_size(saved, world):
    """Saved on 2 ranks, resumed on ``world``: the samples no rank had read before the
    checkpoint are read once each over the new ranks in the rest of the epoch, and the next
    epoch is the sampler's normal one for ``world`` ranks."""
    whole = saved[1]["sampler"]
    assert [read_in(steps, 0) for steps in whole] == [expected_epoch(0, r, 2) for r in (0, 1)]
    again = resumed(saved, world, "sampler")
    before = [sample for steps in whole for sample in read_in(steps[:SAVE_AT], 0)]
    read = collections.Counter(before + [sample for steps in again for sample in read_in(steps, 0)])
    lost = sorted(set(range(SAMPLES)) - set(read))
    twice = {sample: count for sample, count in read.items() if count > 1}
    assert not lost and not twice, f"lost: {lost}; read more than once: {twice}"
    assert [read_in(steps, 1) for steps in again] == [expected_epoch(1, r, world)
                                                      for r in range(world)]
