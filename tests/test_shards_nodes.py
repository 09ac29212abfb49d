"""Several nodes under torchrun (agents on 127.0.0.1, each with its own ``TMPDIR``: its own shard
cache, hence its own node) stream shards over HTTP: each node reads its own shards, so the server
sends the data set about once for the whole job, not once per node; every sample once an epoch,
as many steps on every rank."""
import collections
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from jobs import run_jobs
from leaks import shm_entries
from servers import serving
from shmseq.shards import ShardIndex
from test_shards_distributed import EXAMPLE, samples, write_index

pytest.importorskip("torch.distributed")

SHARDS, PER_SHARD, BATCH, EPOCHS = 60, 32, 16, 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_agents(url: str, tmp_path: Path, nodes: int, ranks: int, budget: int,
               *extra: str) -> tuple[list[dict], float]:
    """``nodes`` torchrun agents of ``ranks`` ranks each (one rendezvous on 127.0.0.1), each with
    a ``TMPDIR`` of its own under ``tmp_path``, ``extra`` arguments for the example; each rank's
    report, and the run's seconds."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    report, port = tmp_path / "report", free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
               f"--nproc_per_node={ranks}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nodes-{port}", str(EXAMPLE),
               "--shards", url, "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
               "--workers", "1", "--seed", "5", "--last-batch", "discard", "--timeout", "60",
               "--cache-bytes", str(budget), "--report", str(report), *extra]
    envs = []
    for node in range(nodes):
        tmpdir = tmp_path / f"node{node}"
        tmpdir.mkdir()
        envs.append({**os.environ, "TMPDIR": str(tmpdir)})
    began = time.monotonic()
    agents = run_jobs([command] * nodes, timeout=120, envs=envs)
    seconds = time.monotonic() - began
    assert [agent.returncode for agent in agents] == [0] * nodes, \
        "\n".join(agent.output for agent in agents)
    return [json.loads((report / f"rank{rank}.json").read_text())
            for rank in range(nodes * ranks)], seconds


@pytest.mark.parametrize("nodes, ranks", [(2, 2), (4, 1)])
def test_nodes_read_their_own_shards_and_the_server_sends_the_data_set_about_once(
        tmp_path, nodes, ranks):
    """60 shards over HTTP, a cache of 0.75x the data set on each node, 2 epochs: the bytes the
    server sends for the whole job stay within 1.1x the data set (each node caches its own
    shards: nothing fetched after the first epoch); every sample once an epoch, as many steps
    on every rank."""
    folder = tmp_path / "web"
    index = ShardIndex.load(str(write_index(folder, (PER_SHARD,) * SHARDS)))
    data = sum(shard.size for shard in index.shards)
    with serving(lambda servers: servers.FileServer(folder)) as server:
        ranks_seen, seconds = run_agents(f"{server.url}/shards.json", tmp_path, nodes, ranks,
                                         budget=data * 3 // 4)
    sent = sum(r.sent for r in server.log if r.method == "GET" and r.path.endswith(".tar"))
    gets = collections.Counter(r.path for r in server.log
                               if r.method == "GET" and r.path.endswith(".tar"))
    folders = {r["cache"]["folder"] for r in ranks_seen}
    print(f"{nodes} nodes x {ranks} ranks, {SHARDS} shards ({data:,} bytes), {EPOCHS} epochs: "
          f"{sent:,} bytes served ({sent / data:.2f}x the data set, {sent / data / EPOCHS:.2f}x "
          f"an epoch), GETs per shard {sorted(collections.Counter(gets.values()).items())}, "
          f"{seconds:.1f} s")
    assert len(folders) == nodes  # a cache per node
    assert sent <= 1.1 * data
    for folder in folders:  # each node's own report: what it fetched against its share
        node = [r["cache"] for r in ranks_seen if r["cache"]["folder"] == folder]
        fetched, share = max(c["node_fetch_bytes"] for c in node), node[0]["node_share_bytes"]
        assert {c["node_share_bytes"] for c in node} == {share}
        assert 0.9 * data / nodes <= share <= 1.1 * data / nodes
        assert share <= fetched <= 1.1 * share
    total = SHARDS * PER_SHARD
    for epoch in range(EPOCHS):
        steps = {r["epochs"][epoch]["steps"] for r in ranks_seen}
        assert steps == {total // (nodes * ranks) // BATCH}
        seen = [i for r in ranks_seen for i in samples(r, epoch)]
        assert len(seen) == len(set(seen)) == total  # every sample once (nothing cut here)
    assert not shm_entries({r["pid"] for r in ranks_seen})


def test_a_run_stopped_on_2_nodes_x_2_ranks_resumes_on_1_node_x_3_ranks_exactly(tmp_path):
    """Stopped after 3 steps of the first epoch on 2 nodes of 2 ranks (each rank's state saved),
    resumed on 1 node of 3 ranks from one rank's state: the rest of that epoch is every sample
    the first run did not take, once, in as many steps on every rank; then a whole epoch."""
    folder, state = tmp_path / "web", str(tmp_path / "state")
    index = ShardIndex.load(str(write_index(folder, (PER_SHARD,) * SHARDS)))
    budget = sum(shard.size for shard in index.shards) * 3 // 4
    with serving(lambda servers: servers.FileServer(folder)) as server:
        url = f"{server.url}/shards.json"
        stopped, _ = run_agents(url, tmp_path / "stopped", 2, 2, budget, "--stop-after", "3",
                                "--state", state)
        resumed, _ = run_agents(url, tmp_path / "resumed", 1, 3, budget, "--state", state)
    total = SHARDS * PER_SHARD
    before = [i for r in stopped for i in samples(r, 0)]
    rest = [i for r in resumed for i in samples(r, 0)]
    assert len(before) == 4 * 3 * BATCH
    assert sorted(before + rest) == list(range(total))  # every sample once
    assert {r["epochs"][0]["steps"] for r in resumed} == {(total - len(before)) // 3 // BATCH}
    whole = [i for r in resumed for i in samples(r, 1)]
    assert sorted(whole) == list(range(total))
