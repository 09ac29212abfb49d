"""The remote bench's peers (litdata, MosaicML streaming, WebDataset): where one is not
installed it is skipped and the report says why (runs everywhere, CI included, where none is
installed); where they are, each reads a tiny set over the servers in the remote mode, every
sample once an epoch (their batches checked as they come), into the peers' table."""
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from shmseq.bench import peers, peers_report, streaming
from shmseq.bench.__main__ import main
from shmseq.bench.runner import Run
from shmseq.bench.streaming_workloads import Prepared
from shmseq.bench.workloads import BatchMismatch
from shmseq.shards import Shard, ShardIndex

SERVERS = ("werkzeug", "fsspec", "aiohttp", "moto", "boto3", "s3fs", "torch")


def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw 32 x 32 images (fast to make, no decode to wait for), 2 batches timed apart."""
    monkeypatch.setitem(streaming.STREAM_WORKLOADS, "shards-uint8",
                        replace(streaming.STREAM_WORKLOADS["shards-uint8"], side=32,
                                early_batches=2))


def run_remote(tmp_path, systems: str) -> tuple[str, dict]:
    main(["--streaming", "--quick", "--remote", "http,s3", "--workloads", "shards-uint8",
          "--images", "256", "--repeats", "1", "--seconds", "0.1", "--delay-ms", "1",
          "--systems", systems, "--out", str(tmp_path)])
    return ((tmp_path / "streaming.md").read_text(),
            json.loads((tmp_path / "streaming.json").read_text()))


def test_a_peer_not_installed_is_skipped_and_the_report_says_why(monkeypatch, tmp_path, capsys):
    for package in SERVERS:
        pytest.importorskip(package)
    tiny(monkeypatch)
    monkeypatch.setattr(peers, "missing", lambda peer: f"{peer} is not here (reason)")
    text, document = run_remote(tmp_path, "shmseq-http,litdata-s3,mosaic-s3,webdataset-http")
    assert {run["system"] for run in document["runs"]} == {"shmseq-http"}
    logged = capsys.readouterr().err
    for peer in peers.PEERS:
        assert f"{peer} skipped: {peer} is not here (reason)" in logged
        assert f"- {peer}: skipped, {peer} is not here (reason)" in text
    assert "| shards-uint8 | http | litdata-http | n/a: litdata reads" in text
    assert document["settings"]["remote"]["peers_skipped"]["mosaic"] == "mosaic is not here (reason)"


def test_a_module_that_does_not_import_is_said_not_installed(monkeypatch):
    monkeypatch.setitem(peers.MODULES, "webdataset", "no_such_module_shmseq_test")
    peers.missing.cache_clear()
    try:
        assert peers.missing("webdataset").startswith("not installed (pip install 'shmseq[peers]'")
    finally:
        peers.missing.cache_clear()


def test_the_peers_check_refuses_a_sample_twice_in_an_epoch():
    """Only the plan's length is read from the index: 4 samples, 2 batches an epoch."""
    workload = replace(streaming.STREAM_WORKLOADS["shards-uint8"], side=2, batch_size=2)
    shards = ShardIndex([Shard("a.tar", np.arange(4) * 1024, 4096)])
    check = peers.checker(Prepared(workload, shards, None))
    image = np.zeros((2, 2, 2, 3), np.uint8)
    check(0, (image, np.array([3, 1])))
    with pytest.raises(BatchMismatch, match="came twice in epoch 0"):
        check(1, (image, np.array([1, 0])))
    check(2, (image, np.array([1, 0])))  # the next epoch
    with pytest.raises(BatchMismatch, match="images"):
        check(3, (image[:1], np.array([2])))


def test_shmseq_over_the_best_peer_is_taken_repeat_by_repeat():
    def run(system: str, repeat: int, epoch: float) -> Run:
        return Run(system, "w", repeat, 10.0, epoch_batches_per_second=epoch)
    runs = [run("shmseq-s3", 0, 6.0), run("litdata-s3", 0, 5.0), run("mosaic-s3", 0, 3.0),
            run("shmseq-s3", 1, 4.0), run("litdata-s3", 1, 2.0), run("mosaic-s3", 1, 4.0),
            run("webdataset-http", 0, 9.0)]
    assert peers_report.best_peer_ratios(runs, "w", "s3") == ([1.2, 1.0], ["litdata-s3",
                                                                            "mosaic-s3"])


@pytest.mark.last  # moto's S3 in this process: see conftest
def test_each_peer_reads_every_sample_once_an_epoch_over_the_servers(monkeypatch, tmp_path):
    """litdata and MosaicML over S3 (their own formats, written from the tar shards), WebDataset
    over HTTP and S3 (the tar shards): each run's batches are checked as they come (full
    batches, no sample twice in an epoch of the plan's length: each sample once)."""
    for package in (*SERVERS, *peers.MODULES.values()):
        pytest.importorskip(package)
    if shutil.which("aws") is None:
        pytest.skip("WebDataset reads S3 through the aws CLI (pip install awscli)")
    tiny(monkeypatch)
    names = ["shmseq-s3", *peers.system_names(["http", "s3"])]
    text, document = run_remote(tmp_path, ",".join(names))
    runs = {run["system"]: run for run in document["runs"]}
    assert set(runs) == set(names)
    for name in names:
        assert runs[name]["epoch_batches_per_second"] > 0
        assert runs[name]["first_batch_seconds"] > 0
    assert "shards-uint8 over s3: shmseq-s3's whole epoch" in text
    assert "| shards-uint8 | s3 | webdataset-s3 |" in text
