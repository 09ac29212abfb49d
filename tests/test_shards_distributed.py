"""Two ranks under torchrun stream tar shards: as many steps on each, shares that overlap only
in the padding, the whole epoch covered (or all but its cut tail), a new order every epoch. Over
HTTP, through the node's shard cache, the server sends each shard once for the node."""
import collections
import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from jobs import output_of
from leaks import shm_entries
from servers import serving
from shmseq.shards import ShardIndex, ShardPlan, write_shards
from test_shard_cache import cache_dir  # noqa: F401 - a cache root, removed after the test

pytest.importorskip("torch.distributed")

EXAMPLE = Path(__file__).parent.parent / "examples" / "ddp_shards.py"
SIZES = (3, 23, 8, 15, 5, 19, 12)  # 85 samples: odd, and not a multiple of 2 x BATCH
EVEN_SIZES = (16, 24, 8, 20, 12, 16)  # 96 samples: 6 batches of 8 on each rank, none cut
BATCH, SEED, WINDOW, EPOCHS = 8, 3, 16, 2
# What ShardPlan.order deals to 2 ranks of 85 samples in batches of 8:
#   keep:    ceil(85 / 2) = 43 each, 86 dealt: the epoch's first sample pads (wraps) on rank 1;
#            5 whole rounds of 2 x 8, then a last batch of 3 on each rank: 6 steps.
#   discard: 85 // 2 = 42 each, cut to whole batches: 40 each, 5 steps; the epoch's last
#            85 - 80 = 5 samples are left out (fewer than 2 x 8).
EXPECTED = {"keep": {"steps": 6, "per_rank": 43, "overlap": 1, "covered": 85},
            "discard": {"steps": 5, "per_rank": 40, "overlap": 0, "covered": 80}}


def write_index(folder: Path, sizes: tuple[int, ...]) -> Path:
    """Shards of ``sizes`` samples (one write_shards call each, ``<shard>/part-00.tar``) under
    one index, ``folder/shards.json``."""
    rng = np.random.default_rng(0)
    parts, number = [], 0
    for shard, size in enumerate(sizes):
        samples = []
        for _ in range(size):
            x = rng.normal(size=2).astype(np.float32)
            samples.append({"__key__": f"s{shard}/{number:05d}", "id": str(number),
                            "x": x.tobytes(), "cls": int(x[0] > 2 * x[1])})
            number += 1
        parts.append(write_shards(samples, str(folder / f"{shard}" / "part-%02d.tar"),
                                  samples_per_shard=size))
    index = ShardIndex(shard for part in parts for shard in part.shards)
    index.save(folder / "shards.json")
    return folder / "shards.json"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Seven shards of uneven sizes."""
    return write_index(tmp_path_factory.mktemp("shards"), SIZES)


def run_ranks(shards: Path | str, report: Path, last_batch: str,
              *options: str) -> tuple[list[dict], float]:
    """Each rank's report of a torchrun run of the example (2 ranks, 2 workers each), and the
    run's seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLE), "--shards", str(shards), "--epochs", str(EPOCHS),
               "--batch-size", str(BATCH), "--workers", "2", "--seed", str(SEED),
               "--last-batch", last_batch, "--timeout", "30", "--report", str(report), *options]
    began = time.monotonic()
    output_of(command, timeout=120)
    seconds = time.monotonic() - began
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in (0, 1)], seconds


def planned(index: ShardIndex, epoch: int, last_batch: str, **shuffle) -> list[list[list[int]]]:
    """Each rank's batches of ``epoch`` as its plan deals them, computed here."""
    return [[b.tolist() for b in ShardPlan(index, BATCH, shuffle=True, seed=SEED, rank=rank,
                                           world_size=2, last_batch=last_batch,
                                           **shuffle).batches(epoch)]
            for rank in (0, 1)]


def samples(rank: dict, epoch: int) -> list[int]:
    """The sample numbers a rank saw in ``epoch``."""
    return [i for batch in rank["epochs"][epoch]["batches"] for i in batch]


def coverage_table(last_batch: str, total: int, ranks: list[dict]) -> str:
    lines = [f"last_batch={last_batch}: {total} samples in {len(SIZES)} shards, batch {BATCH}, "
             "2 ranks",
             f"{'epoch':>5} {'rank0':>6} {'rank1':>6} {'overlap':>8} {'coverage':>9} "
             f"{'missing':>8} {'steps/rank':>11}"]
    for epoch in range(EPOCHS):
        seen = [samples(r, epoch) for r in ranks]
        union = set(seen[0]) | set(seen[1])
        steps = "/".join(str(r["epochs"][epoch]["steps"]) for r in ranks)
        lines.append(f"{epoch:>5} {len(seen[0]):>6} {len(seen[1]):>6} "
                     f"{len(set(seen[0]) & set(seen[1])):>8} {len(union):>4}/{total:<4} "
                     f"{total - len(union):>8} {steps:>11}")
    return "\n".join(lines)


@pytest.mark.parametrize("last_batch", ["keep", "discard"])
def test_two_ranks_stream_shards_in_step(shards, tmp_path, last_batch):
    index = ShardIndex.load(str(shards))
    total = len(index)
    assert total == sum(SIZES) == 85 and total % (2 * BATCH)
    ranks, seconds = run_ranks(shards, tmp_path / "report", last_batch,
                               "--shuffle-window", str(WINDOW))
    print(f"torchrun --last-batch {last_batch}: {seconds:.1f} s")
    print(coverage_table(last_batch, total, ranks))
    expected = EXPECTED[last_batch]
    orders = []
    for epoch in range(EPOCHS):
        got = [r["epochs"][epoch]["batches"] for r in ranks]
        assert got == planned(index, epoch, last_batch, shuffle_window=WINDOW)
        order = ShardPlan(index, BATCH, shuffle=True, seed=SEED,
                          shuffle_window=WINDOW).global_order(epoch).tolist()
        orders.append(order)
        assert sorted(order) == list(range(total))
        # as many steps on each rank, and as many samples in each step
        assert [r["epochs"][epoch]["steps"] for r in ranks] == [expected["steps"]] * 2
        assert [len(b) for b in got[0]] == [len(b) for b in got[1]]
        seen = [samples(r, epoch) for r in ranks]
        assert [len(s) for s in seen] == [expected["per_rank"]] * 2
        assert all(len(set(s)) == len(s) for s in seen)  # no sample twice on one rank
        overlap = set(seen[0]) & set(seen[1])
        union = set(seen[0]) | set(seen[1])
        assert len(overlap) == expected["overlap"] and len(union) == expected["covered"]
        if last_batch == "keep":
            padding = 2 * expected["per_rank"] - total
            assert overlap == set(order[:padding])  # the pad wraps to the epoch's first sample
            assert got[0][0][0] == order[0] and got[1][-1][-1] == order[0]
            assert union == set(range(total))
        else:
            assert not overlap
            assert set(range(total)) - union == set(order[2 * expected["per_rank"]:])
            assert total - len(union) < 2 * BATCH
    assert orders[0] != orders[1]
    for rank in (0, 1):  # a new order for every rank, and a new share of the samples
        first, second = (ranks[rank]["epochs"][e]["batches"] for e in (0, 1))
        assert first != second
        assert {i for b in first for i in b} != {i for b in second for i in b}


def test_two_ranks_fetch_each_remote_shard_once_for_the_node_and_read_every_sample_once(
        tmp_path, cache_dir):
    """2 ranks x 2 workers read shards served over HTTP through one cache on the node, for 2
    epochs: the server sends every shard once in all (the budget holds them: the second epoch
    reads the cache), the ranks read every sample once an epoch, in as many steps. Both name
    the same cache: the job is torchrun's run id (with --standalone a fresh uuid, the same for
    both ranks), and a cache per rank would have fetched every shard twice."""
    folder = tmp_path / "web"
    index = ShardIndex.load(str(write_index(folder, EVEN_SIZES)))
    total = len(index)
    assert total == sum(EVEN_SIZES) and total % (2 * BATCH) == 0
    paths = ["/" + Path(shard.url).relative_to(folder).as_posix() for shard in index.shards]
    with serving(lambda servers: servers.FileServer(folder)) as server:
        ranks, seconds = run_ranks(f"{server.url}/shards.json", tmp_path / "report", "discard",
                                   "--shuffle-shards", "2", "--cache-dir", cache_dir)
    requests = collections.Counter(r.path for r in server.log if r.path.endswith(".tar"))
    gets = collections.Counter(r.path for r in server.log
                               if r.method == "GET" and r.path.endswith(".tar"))
    caches = [r["cache"] for r in ranks]
    print(f"torchrun over HTTP, 2 ranks x 2 workers, {len(paths)} shards, {EPOCHS} epochs: "
          f"requests per shard at the server {[requests[path] for path in paths]} (GETs "
          f"{[gets[path] for path in paths]}), fetched by rank 0/1 "
          f"{caches[0]['fetches']}/{caches[1]['fetches']}, {seconds:.1f} s")
    assert gets == {path: 1 for path in paths}  # once for the node, both epochs
    assert requests == gets  # its version: what the answer that brought its bytes says
    assert [c["refetches"] for c in caches] == [0, 0]
    cache = Path(caches[0]["folder"])
    assert caches[1]["folder"] == caches[0]["folder"] and cache.parent.parent.parent == Path(cache_dir)
    uuid.UUID(cache.parent.name)  # the job: torchrun's run id, not "default"
    assert sorted(os.listdir(cache / "shards")) == [
        f"{number:06d}-part-00.tar" for number in range(len(paths))]
    for epoch in range(EPOCHS):
        assert [r["epochs"][epoch]["batches"] for r in ranks] == planned(
            index, epoch, "discard", shuffle_shards=2)
        assert [r["epochs"][epoch]["steps"] for r in ranks] == [total // (2 * BATCH)] * 2
        seen = [samples(r, epoch) for r in ranks]
        assert sorted(seen[0] + seen[1]) == list(range(total))  # every sample once
    assert not shm_entries({r["pid"] for r in ranks})
