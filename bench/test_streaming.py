"""Streaming shards, stage by stage, with pytest-benchmark: ``python -m pytest bench/test_shards.py``.

What a worker spends on one batch (reading the samples at their offsets, decoding, stacking),
split where it can be: the reading alone, and one JPEG's decode and crop; then a whole batch's
trip through ``ShardSequence`` and through torch's ``DataLoader`` over the same ``ShardWorker``,
and on the JPEGs through the ``ShardSequence`` whose trainer decodes them (``DecodeStage``)
(2 workers, 10 batches in flight, as ``python -m shmseq.bench --streaming`` runs them), on
small sets of both kinds of shards (``--quick``'s: 256 samples, 4 batches of 64 an epoch).
"""
from __future__ import annotations

import numpy as np
import pytest

from shmseq.bench.report import Cell
from shmseq.bench.runner import LIMIT, Run
from shmseq.bench.shard_data import decoder, load_index, make_shards
from shmseq.bench.systems import IN_FLIGHT
from shmseq.bench.streaming import (SHMSEQ, STAGE, STREAM_SYSTEMS, STREAM_WORKLOADS, TORCH,
                                    Prepared, checker, markdown, quick, ratios, runs_on, shown,
                                    table)
from shmseq.shards import ShardReader, ShardWorker

WORKLOADS = {name: quick(workload) for name, workload in STREAM_WORKLOADS.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Prepared]:
    """Both kinds of shards, made once for the module (a second or two), in a temporary folder."""
    pytest.importorskip("simplejpeg")
    root = tmp_path_factory.mktemp("shards")
    prepared = {}
    for name, workload in WORKLOADS.items():
        folder = make_shards(root / workload.folder, workload.kind, workload.images,
                             workload.samples_per_shard, workload.side)
        prepared[name] = Prepared(workload, load_index(folder), decoder(workload.kind))
    return prepared


def _first_batch(prepared: Prepared) -> np.ndarray:
    return prepared.workload.plan(prepared.index).batches(0)[0]


@pytest.fixture(params=list(WORKLOADS))
def kind(request, shards) -> Prepared:
    return shards[request.param]


def test_worker_batch(benchmark, kind):
    """Worker side, both loaders alike: ``worker[ids]``, read + decode + stack of 64 samples."""
    worker = ShardWorker(kind.index, kind.decode)
    ids = _first_batch(kind)
    images, labels = benchmark(worker.__getitem__, ids)
    assert images.shape == (64, 224, 224, 3) and np.array_equal(labels, ids)


def test_read_batch(benchmark, shards):
    """The reading alone, raw images: 64 samples' bytes at their offsets, tar headers parsed."""
    prepared = shards["shards-uint8"]
    reader = ShardReader(prepared.index)
    samples = benchmark(reader.read, _first_batch(prepared))
    assert len(samples) == 64


def test_decode_one_jpeg(benchmark, shards):
    """One photo-like JPEG decoded at reduced scale and random-resized-cropped to 224."""
    prepared = shards["shards-jpeg"]
    sample = ShardReader(prepared.index).read(np.array([0]))[0]
    image, label = benchmark(prepared.decode, sample)
    assert image.shape == (224, 224, 3) and label == 0


TRIP_ROUNDS = 4 * IN_FLIGHT  # fixed: calibrating on a batch already waiting in the ring would
                             # ask for thousands of decode-bound rounds
TRIPS = [(system, name) for name, workload in WORKLOADS.items() for system in STREAM_SYSTEMS
         if runs_on(system, workload)]


@pytest.fixture(params=TRIPS, ids=["-".join(trip) for trip in TRIPS])
def trip(request, shards) -> tuple[str, Prepared]:
    system, name = request.param
    if system != SHMSEQ:
        pytest.importorskip("torch")
    return system, shards[name]


def test_batch_trip(benchmark, trip):
    """A batch as the consumer takes it, steady state (every batch checked, as the bench does):
    raw images, the loader's own cost on top of what its two workers read and stack; JPEGs, the
    decode's pace, in the workers or, for the decode stage, in the trainer."""
    system, prepared = trip
    check = checker(prepared, system)
    taken = [0]

    def take(batches):
        check(taken[0], next(batches))
        taken[0] += 1

    with STREAM_SYSTEMS[system](prepared) as batches:
        for _ in range(8):
            take(batches)
        benchmark.pedantic(take, args=(batches,), rounds=TRIP_ROUNDS)


def test_the_decode_stage_delivers_the_plans_images(shards):
    """Across an epoch's end: each batch the plan's samples, decoded to normalized floats, and
    batches that differ (no stale slot read twice)."""
    pytest.importorskip("torch")
    prepared = shards["shards-jpeg"]
    check = checker(prepared, STAGE)
    with STREAM_SYSTEMS[STAGE](prepared) as batches:
        delivered = []
        for k in range(6):
            batch = next(batches)
            check(k, batch)
            delivered.append(batch[0].cpu().clone())
    assert all(not a.equal(b) for a, b in zip(delivered, delivered[1:]))


def test_both_loaders_deliver_the_same_batches(shards):
    """The comparison is fair: the same ids, the same crops, byte for byte, across an epoch's end."""
    pytest.importorskip("torch")
    prepared = shards["shards-jpeg"]
    delivered = {}
    for name in (SHMSEQ, TORCH):
        with STREAM_SYSTEMS[name](prepared) as batches:
            delivered[name] = [tuple(np.asarray(part).copy() for part in next(batches))
                               for _ in range(6)]
    check = checker(prepared)
    for k, (ours, theirs) in enumerate(zip(delivered[SHMSEQ], delivered[TORCH])):
        check(k, ours)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), f"batch {k} differs"


def test_the_report_takes_ratios_repeat_by_repeat():
    runs = [Run(SHMSEQ, "shards-uint8", 0, 400.0, 250.0, 0.05, 300.0),
            Run(TORCH, "shards-uint8", 0, 100.0, 2500.0, 0.06, 100.0),
            Run(LIMIT, "shards-uint8", 0, 500.0),
            Run(TORCH, "shards-uint8", 1, 50.0, 2000.0, 0.06, 50.0),
            Run(SHMSEQ, "shards-uint8", 1, 300.0, 200.0, 0.05, 300.0),
            Run(LIMIT, "shards-uint8", 1, 300.0)]
    assert ratios(runs, "shards-uint8") == {"rate": [4.0, 6.0], "cpu": [10.0, 10.0],
                                            "first": [0.05 / 0.06] * 2}
    assert ratios(runs, "shards-jpeg") is None
    text = markdown(runs, WORKLOADS, {"nproc": 2, "cpu": "x", "ram": "1 GiB", "python": "3",
                                      "numpy": "2", "torch": "2"},
                    {"repeats": 2, "seconds": 1.0, "buffer": 10}, ["shards"], ["idle"], "cmd")
    ours = "| shards-uint8 | shmseq-shards | 22,400 (19,200-25,600) | 350.0 | 225 | 3.5 | 0.050 |"
    assert f"{ours} 0.88 | 0.88 |" in text
    assert "| shards-uint8 | limit | 25,600 (19,200-32,000) | 400.0 | — | — | — | — | 1.00 |" in text
    assert "5.00x (4.00-6.00) torch's DataLoader" in text and "10.00x (10.00-10.00) less" in text
    assert "shmseq-shards at 0.88x the limit; torch-shards at 0.19x the limit" in text


def test_the_decode_stage_is_compared_with_both_loaders_and_not_with_their_limit():
    runs = [Run(LIMIT, "shards-jpeg", 0, 20.0), Run(SHMSEQ, "shards-jpeg", 0, 20.0, 500.0, 0.1, 20.0),
            Run(TORCH, "shards-jpeg", 0, 16.0, 2500.0, 0.1, 16.0),
            Run(STAGE, "shards-jpeg", 0, 40.0, 50_000.0, 0.1, 40.0)]
    text = markdown(runs, WORKLOADS, {"nproc": 2, "cpu": "x", "ram": "1 GiB", "python": "3",
                                      "numpy": "2", "torch": "2"},
                    {"repeats": 1, "seconds": 1.0, "buffer": 10}, ["shards"], ["idle"], "cmd")
    assert f"| shards-jpeg | {shown(STAGE)} | 2,560 | 40.0 | 50,000 | 781.2 | 0.100 | 1.00 | — |" in text
    assert "Above the limit" not in text
    assert "2.50x the images/s of torch's DataLoader with 20.00x more trainer CPU" in text
    assert "2.00x the images/s of shmseq-shards with 100.00x more trainer CPU" in text
    assert f"{STAGE}: the workers only read each JPEG's encoded bytes" in text


def test_a_single_run_has_no_spread():
    cell = Cell("shards-jpeg", SHMSEQ, 64 * (224 * 224 * 3 + 8) * 10 / 1e9, (0.0, 0.0), 10.0, 640.0,
                0.1, None, 0.5, 1)
    assert "| shards-jpeg | shmseq-shards | 640 | 10.0 | 640 | 10.0 | 0.100 | 0.50 | — |" in table(
        [cell], WORKLOADS)


def test_a_ratio_above_the_limit_is_marked_in_images_per_second():
    runs = [Run(LIMIT, "shards-jpeg", 0, 30.0), Run(SHMSEQ, "shards-jpeg", 0, 33.0, 300.0, 0.1, 20.0),
            Run(TORCH, "shards-jpeg", 0, 27.0, 2400.0, 0.1, 27.0)]
    text = markdown(runs, WORKLOADS, {"nproc": 2, "cpu": "x", "ram": "1 GiB", "python": "3",
                                      "numpy": "2", "torch": "2"},
                    {"repeats": 1, "seconds": 1.0, "buffer": 10}, ["shards"], ["idle"], "cmd")
    assert "| shards-jpeg | shmseq-shards | 2,112 | 33.0 | 300 | 4.7 | 0.100 | 0.61 | 1.10† |" in text
    assert "† Above the limit: shards-jpeg shmseq-shards 1.10." in text
    assert "(shards-jpeg 1,920 images/s)" in text and "GB/s" not in text


def test_the_report_gives_each_loaders_tree_pss_and_shmseqs_ratio_to_torchs():
    runs = [Run(SHMSEQ, "shards-uint8", 0, 400.0, 250.0, 0.05, 300.0, 360_000_000),
            Run(TORCH, "shards-uint8", 0, 100.0, 2500.0, 0.10, 100.0, 300_000_000),
            Run(LIMIT, "shards-uint8", 0, 500.0)]
    text = markdown(runs, WORKLOADS, {"nproc": 2, "cpu": "x", "ram": "1 GiB", "python": "3",
                                      "numpy": "2", "torch": "2"},
                    {"repeats": 1, "seconds": 1.0, "buffer": 10}, ["shards"], ["idle"], "cmd")
    assert "| × limit | tree PSS MB |" in text
    assert "| 0.80 | 360 |" in text and "| 0.20 | 300 |" in text and "| 1.00 | — |" in text
    assert "its first batch in 0.50x torch's time (0.050 against 0.100 s)" in text
    assert "1.20x its process tree's PSS (360 against 300 MB)" in text
