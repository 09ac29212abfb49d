"""Lightning and Accelerate on 2 CPU ranks (gloo), fed by shmseq.torch.DataLoader built before
the process group: in every epoch the ranks' samples are disjoint and cover the dataset, and a
run resumed from a mid-epoch checkpoint trains on exactly the batches the uninterrupted run
trained on after it, in the same order.

Each example runs twice: once through, checkpointing after step ``SAVE_AT`` (the reference),
then resumed from that checkpoint. Every rank reports the batches it trained on as JSON.
"""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SAMPLES, EPOCHS, SAVE_AT = 32, 3, 5  # batches of 4: 4 a rank an epoch, saved mid-epoch 1
RUN_SECONDS = 90
SIZES = ["--samples", str(SAMPLES), "--batch-size", "4", "--epochs", str(EPOCHS)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(command: list[str], env: dict | None = None) -> str:
    """Run a job in its own process group and return its output. On a timeout the whole group
    is killed: a rank left waiting in a collective would otherwise wait for gloo's 30 minutes."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"{' '.join(command)} took over {RUN_SECONDS} s:\n{output[-4000:]}")
    assert job.returncode == 0, f"{' '.join(command)} failed:\n{output[-4000:]}"
    return output


def reports(out: Path, tag: str) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in (0, 1)]


def check_epochs_are_dealt(full: list[dict], log: str) -> None:
    """Each epoch: equal, disjoint shares that together are the dataset, reshuffled."""
    orders = []
    for epoch in range(EPOCHS):
        shares = [[i for batch in report["batches"] if batch["epoch"] == epoch
                   for i in batch["indices"]] for report in full]
        overlap, covered = set(shares[0]) & set(shares[1]), set(shares[0]) | set(shares[1])
        print(f"epoch {epoch}: samples per rank {[len(share) for share in shares]}, "
              f"overlap {len(overlap)}, covered {len(covered)}/{SAMPLES}")
        assert [len(share) for share in shares] == [SAMPLES // 2] * 2, log
        assert not overlap and covered == set(range(SAMPLES)), log
        orders.append(shares[0])
    assert orders[0] != orders[1], "every epoch is shuffled anew\n" + log


def check_resume_is_exact(full: list[dict], resumed: list[dict], log: str) -> None:
    """The resumed run trains on the reference's batches after step SAVE_AT, and no others."""
    for rank, (whole, rest) in enumerate(zip(full, resumed)):
        exact = rest["batches"] == whole["batches"][SAVE_AT:]
        print(f"rank {rank}: resumed after step {SAVE_AT} of {len(whole['batches'])}: "
              f"{len(rest['batches'])} batches, the reference's exactly: {exact}")
        assert exact, f"rank {rank}: {rest['batches']} != {whole['batches'][SAVE_AT:]}\n{log}"


@pytest.mark.timeout(2 * RUN_SECONDS + 30)
def test_lightning_ddp_deals_each_epoch_and_resumes_mid_epoch_exactly(tmp_path):
    pytest.importorskip("lightning.pytorch")
    script = [sys.executable, str(ROOT / "examples" / "lightning_ddp.py"), str(tmp_path), *SIZES]
    port = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    log = run([*script, "--tag", "full", "--save-at", str(SAVE_AT)], port)
    port["MASTER_PORT"] = str(free_port())
    log += run([*script, "--tag", "resumed", "--resume", str(tmp_path / f"step{SAVE_AT}.ckpt")],
               port)
    full = reports(tmp_path, "full")
    check_epochs_are_dealt(full, log)
    check_resume_is_exact(full, reports(tmp_path, "resumed"), log)


@pytest.mark.timeout(2 * RUN_SECONDS + 30)
def test_accelerate_ddp_deals_each_epoch_and_resumes_mid_epoch_exactly(tmp_path):
    pytest.importorskip("accelerate")

    def torchrun(*args: str) -> str:
        return run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                    "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                    str(ROOT / "examples" / "accelerate_ddp.py"), str(tmp_path), *SIZES, *args])

    log = torchrun("--tag", "full", "--save-at", str(SAVE_AT))
    log += torchrun("--tag", "resumed", "--resume", str(tmp_path / f"step{SAVE_AT}"))
    full = reports(tmp_path, "full")
    drawn = [report["drawn_seed"] for report in full]
    print(f"shuffle seeds drawn by the ranks {drawn}, used {[r['seed'] for r in full]}")
    assert drawn[0] != drawn[1] and [r["seed"] for r in full] == [drawn[0]] * 2, log
    check_epochs_are_dealt(full, log)
    check_resume_is_exact(full, reports(tmp_path, "resumed"), log)
