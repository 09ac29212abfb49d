"""Lightning and Accelerate on 2 CPU ranks (gloo), fed by torch's DataLoader and by
shmseq.torch's in the same runs: every rank's samples, step counts, validation and
``gather_for_metrics`` counts, and the batches of a run resumed from a mid-epoch checkpoint are
the same under both loaders, and shmseq's batches come through its ring.

The examples (examples/lightning_ddp.py, examples/accelerate_ddp.py) write each rank's record
as JSON; the tests compare them and print the table the docs quote. Accelerate's checkpoints of
a stateful loader (``use_stateful_dataloader``) are checked in this process, on one CPU rank.
"""
import importlib.util
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest

from jobs import run_job

ROOT = Path(__file__).parent.parent
SAMPLES, EVAL_SAMPLES, BATCH, EPOCHS, SAVE_AT = 30, 21, 4, 3, 5  # 4 steps a rank an epoch
SIZES = ["--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
         "--save-at", str(SAVE_AT)]
RUN_SECONDS = 60  # a run takes 8-15 s on 2 cores; one stuck in a fork (see run) costs this


def installed(package: str) -> None:
    """Skip unless ``package`` is installed; looked up, not imported: the examples import it,
    and Lightning in this process would add 180 MB that every worker forked after it copies the
    page tables of."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}, not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(command: Callable[[int], list[str]]) -> str:
    """Run a job, ``command(port)`` with a free port for its ranks to meet on (also given as
    ``MASTER_PORT``), and return its output. A job that timed out with a process stuck in the
    child side of ``os.fork`` (``jobs.stuck_in_fork``) runs once more."""
    for attempt in (1, 2):
        port = free_port()
        args = command(port)
        paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join(paths)}
        ended = run_job(args, RUN_SECONDS, env)
        if ended.timed_out:
            if ended.stuck and attempt == 1:
                warnings.warn(f"processes {ended.stuck} hung in the child side of os.fork "
                              f"(CPython gh-112275, fixed in 3.11.8): running the job again")
                continue
            pytest.fail(f"{' '.join(args)} took over {RUN_SECONDS} s:\n{ended.output[-4000:]}")
        assert ended.returncode == 0, f"{' '.join(args)} failed:\n{ended.output[-4000:]}"
        return ended.output
    raise AssertionError("unreachable: the second attempt returns or fails")


def shares(ranks: list[list[dict]], epoch: int) -> list[list[int]]:
    return [[i for batch in batches if batch["epoch"] == epoch for i in batch["indices"]]
            for batches in ranks]


def summary(name: str, full: list[list[dict]], resumed: list[list[dict]], steps: list[int],
            counted: str) -> str:
    """A row of the table: samples per rank and epoch, overlap, coverage, steps, a count, and
    the batches of the resumed run."""
    per_epoch = [shares(full, epoch) for epoch in range(EPOCHS)]
    sizes = "/".join(str(len(share)) for share in per_epoch[0])
    overlap = sum(len(set(a) & set(b)) for a, b in per_epoch)
    covered = min(len(set(a) | set(b)) for a, b in per_epoch)
    return (f"{name:24} samples/rank {sizes}, overlap {overlap}, covered {covered}/{SAMPLES}, "
            f"steps {steps}, {counted}, resumed batches {[len(r) for r in resumed]}")


def check_epochs_are_dealt(full: list[list[dict]], padded: int = 0) -> None:
    """Each epoch: shares that together are the dataset, overlapping only by the ``padded``
    samples repeated to give every rank as many batches, reshuffled."""
    for epoch in range(EPOCHS):
        first, second = shares(full, epoch)
        assert set(first) | set(second) == set(range(SAMPLES))
        assert len(first) + len(second) == SAMPLES + padded
    assert shares(full, 0)[0] != shares(full, 1)[0], "every epoch is shuffled anew"


@pytest.mark.timeout(2 * RUN_SECONDS + 30)  # a run, and one more if it hung in a fork
def test_lightning_sees_the_same_run_from_both_loaders_and_resumes_ours_exactly(tmp_path):
    installed("lightning")
    run(lambda port: [sys.executable, str(ROOT / "examples" / "lightning_ddp.py"),
                      str(tmp_path), "--loader", "torch", "shmseq", *SIZES])
    reports = {loader: [json.loads((tmp_path / f"{loader}-rank{rank}.json").read_text())
                        for rank in (0, 1)] for loader in ("torch", "shmseq")}
    for loader, ranks in reports.items():
        full, resumed = ([rank[part]["train"] for rank in ranks] for part in ("full", "resumed"))
        validated = [len([b for b in rank["full"]["val"] if not b["sanity"]]) for rank in ranks]
        print(summary(f"Lightning, {loader}", full, resumed,
                      [rank["full"]["steps"] for rank in ranks], f"validation batches {validated}"))
        check_epochs_are_dealt(full)
    for ours, theirs in zip(reports["shmseq"], reports["torch"]):
        for key in ("train", "val", "steps"):
            assert ours["full"][key] == theirs["full"][key], f"full {key} differ"
        assert ours["resumed"]["steps"] == theirs["resumed"]["steps"]
        # Lightning saves a loader's state when it has one: shmseq's resumes the epoch where
        # the checkpoint was taken, torch's starts it again (in its first epoch's order)
        resumed = ours["resumed"]["train"]
        assert resumed == [b for b in ours["full"]["train"] if b["step"] >= resumed[0]["step"]]
        assert theirs["resumed"]["train"] != resumed
        for part in ("full", "resumed"):
            assert ours[part]["loaders"] == {"train": "shmseq.torch", "val": "shmseq.torch"}
            assert all(ours[part]["ring_batches"].values()), "shmseq's batches came from its ring"
            assert not any(theirs[part]["ring_batches"].values())
    sanity = [b for b in reports["torch"][0]["full"]["val"] if b["sanity"]]
    assert len(sanity) == 2, "Lightning's sanity check, then the epochs, through the same loader"


@pytest.mark.timeout(2 * RUN_SECONDS + 30)  # a run, and one more if it hung in a fork
def test_accelerate_sees_the_same_runs_from_both_loaders_prepared_or_not(tmp_path):
    installed("accelerate")
    run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                      "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                      str(ROOT / "examples" / "accelerate_ddp.py"), str(tmp_path), *SIZES,
                      "--eval-samples", str(EVAL_SAMPLES)])
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for mode, gathered in (("prepared", EVAL_SAMPLES), ("unprepared", EVAL_SAMPLES + 1)):
        for loader in ("torch", "shmseq"):
            runs = [rank[f"{loader}-{mode}"] for rank in ranks]
            full, resumed = ([r[part]["batches"] for r in runs] for part in ("full", "resumed"))
            print(summary(f"Accelerate, {loader}, {mode}", full, resumed,
                          [r["full"]["steps"] for r in runs],
                          f"gather_for_metrics {runs[0]['full']['gathered'][0]}/{EVAL_SAMPLES}"))
            check_epochs_are_dealt(full, padded=2 if mode == "prepared" else 0)
            assert all(r["full"]["gathered"] == [gathered] * EPOCHS for r in runs)
            assert all(bool(r[part]["ring_batches"]) == (loader == "shmseq")
                       for r in runs for part in ("full", "resumed"))
        for rank in ranks:
            ours, theirs = rank[f"shmseq-{mode}"], rank[f"torch-{mode}"]
            for part in ("full", "resumed"):
                for key in ("batches", "steps", "gathered"):
                    assert ours[part][key] == theirs[part][key], f"{mode} {part} {key} differ"


ACCELERATE_SAMPLES, ACCELERATE_EPOCHS = 16, 2  # 4 batches of 4 an epoch


def accelerate_run(save_at: dict[int, Path], load: Path | None = None) -> tuple[list, int]:
    """Train a linear model for 2 epochs with Accelerate's stateful loaders
    (``use_stateful_dataloader``), shmseq's loader prepared and put back on the ring:
    ``accelerator.save_state`` into ``save_at[k]`` after ``k`` steps (0: before the first
    batch), or ``load_state`` from ``load`` first, as a restarted job does. Each batch's sample
    indices and loss, and the batches that came through the ring."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from shmseq.torch import DataLoader, on_ring
    from torch_datasets import Counting

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    set_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
    loader = DataLoader(Counting(ACCELERATE_SAMPLES), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    prepared = on_ring(prepared, like=loader)
    if load is not None:
        accelerator.load_state(str(load))
    if 0 in save_at:
        accelerator.save_state(str(save_at[0]))
    seen: list = []
    for _ in range(ACCELERATE_EPOCHS):
        for batch in prepared:
            loss = model(batch.float()[:, None]).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append((batch.tolist(), loss.item()))
            if len(seen) in save_at:
                accelerator.save_state(str(save_at[len(seen)]))
    return seen, prepared.base_dataloader.stats.batches


@pytest.mark.timeout(60)
def test_accelerate_saves_and_loads_a_stateful_loaders_state_on_the_ring(tmp_path):
    """A state saved mid-epoch, and one saved before the loader's first batch, resume to the
    uninterrupted run's batches and losses, every batch through the ring."""
    installed("accelerate")
    installed("torchdata")  # Accelerate's use_stateful_dataloader needs it
    saved = {0: tmp_path / "start", 3: tmp_path / "step-3"}
    full, ring = accelerate_run(saved)
    assert ring == len(full) == ACCELERATE_EPOCHS * ACCELERATE_SAMPLES // 4
    for step, state in saved.items():
        resumed, ring = accelerate_run({}, load=state)
        assert resumed == full[step:], f"resumed after step {step}"
        assert ring == len(resumed)
