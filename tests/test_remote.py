"""shmseq.remote against real servers on 127.0.0.1 (shmseq.bench.servers: files over HTTP with
Range, moto's S3): ranges and whole objects come back as stored, transient failures (503, 500,
a reset connection, a timeout) are retried and counted, the others raised at once naming the URL,
and a ShardSequence over either delivers every sample once, its workers' reads counted in
``seq.stats``. Nothing leaks (conftest; the fixtures check threads)."""
import os
import sys
import threading
import time

import pytest

import shard_data as sd
from servers import s3, server, serving  # noqa: F401 - fixtures
from shmseq import remote
from shmseq.remote import Counters, RemotePolicy
from shmseq.shards import ShardError, ShardIndex, ShardReader, ShardSequence

QUICK = RemotePolicy(attempts=3, backoff=0.01)  # retries 5 to 20 ms apart
DATA = bytes(range(256)) * 40  # 10,240 bytes


@pytest.fixture(params=["http", pytest.param("s3", marks=pytest.mark.last)])
def store(request, tmp_path):
    """(the URL of a folder holding ``data.bin`` and the shards, storage_options, its server)."""
    (tmp_path / "data.bin").write_bytes(DATA)
    sd.write(tmp_path / "shards", 50, 12)
    if request.param == "http":
        served = request.getfixturevalue("server")
        return served.url, None, served
    served = request.getfixturevalue("s3")
    return served.upload(tmp_path, "bucket"), served.storage_options, served


def test_a_range_and_a_whole_object_come_back_as_stored_and_counted(store, tmp_path):
    root, options, served = store
    url, counters = f"{root}/data.bin", Counters()

    def read(start, end):
        return remote.read_range(url, start, end, storage_options=options, counters=counters)

    assert read(100, 1100) == DATA[100:1100]
    assert read(10_000, 20_000) == DATA[10_000:]  # the object ends first: fewer bytes
    assert read(20_000, 30_000) == b""  # past its end: none
    assert remote.size(url, storage_options=options) == len(DATA)
    target = tmp_path / "fetched" / "data.bin"
    target.parent.mkdir()
    assert remote.fetch(url, target, storage_options=options, counters=counters) == len(DATA)
    assert target.read_bytes() == DATA and os.listdir(target.parent) == ["data.bin"]
    counted = counters.snapshot()
    gets = [request for request in served.log if request.method == "GET"]
    assert counted["requests"] == len(gets) == 4  # a whole object shorter than a chunk: one
    assert counted["bytes"] == 1000 + 240 + len(DATA)
    assert counted["retries"] == 0 and counted["wait_s"] > 0


def test_a_whole_object_is_fetched_chunk_by_chunk(server, tmp_path, monkeypatch):
    """Until a chunk comes short: 10,240 bytes in 4,096-byte chunks take 3 requests, and so do
    8,192 (the third finds nothing)."""
    monkeypatch.setattr(remote, "FETCH_CHUNK_BYTES", 4096)
    for name, data in [("data.bin", DATA), ("exact.bin", DATA[:8192])]:
        (tmp_path / name).write_bytes(data)
        counters = Counters()
        target = tmp_path / f"copy-{name}"
        assert remote.fetch(f"{server.url}/{name}", target, counters=counters) == len(data)
        assert target.read_bytes() == data
        assert counters.snapshot()["requests"] == 3


def test_a_failed_fetch_leaves_the_file_there_as_it_was_and_no_part(server, tmp_path):
    (tmp_path / "data.bin").write_bytes(DATA)
    target = tmp_path / "kept" / "data.bin"
    target.parent.mkdir()
    target.write_bytes(b"old")
    server.fail_next(3)
    with pytest.raises(OSError, match="overloaded or failing"):
        remote.fetch(f"{server.url}/data.bin", target, policy=QUICK)
    assert os.listdir(target.parent) == ["data.bin"] and target.read_bytes() == b"old"


def stopped_fetch(url: str, target, options=None, policy=None) -> tuple[BaseException, float]:
    """Fetch ``url`` in a thread, set its stop event 0.2 s in: (what it raised, the seconds from
    the stop to its end)."""
    stop, raised = threading.Event(), []

    def run():
        try:
            remote.fetch(url, target, storage_options=options, policy=policy, stop=stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)
    stop.set()
    stopped = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    return raised[0], time.monotonic() - stopped


def test_a_stopped_fetch_ends_in_flight_and_writes_nothing(store, tmp_path):
    """A request the server holds for 30 s is cancelled once its stop is set (a loader closing
    does not wait for it), and no part file stays behind."""
    root, options, served = store
    served.delay = 30.0  # cut short when the server stops
    target = tmp_path / "fetched" / "data.bin"
    target.parent.mkdir()
    raised, took = stopped_fetch(f"{root}/data.bin", target, options)
    assert isinstance(raised, remote.FetchStopped) and took < 5  # not the 30 s of the request
    assert os.listdir(target.parent) == []


def test_a_stopped_fetch_ends_in_its_back_off(server, tmp_path):
    """A server that fails: the retry's back-off (4 s at least here) is cut short by the stop."""
    (tmp_path / "data.bin").write_bytes(DATA)
    server.fail_next(2)
    raised, took = stopped_fetch(f"{server.url}/data.bin", tmp_path / "copy.bin",
                                 policy=RemotePolicy(backoff=8.0, max_backoff=8.0))
    assert isinstance(raised, remote.FetchStopped) and took < 3
    assert server.requests == 1 and not (tmp_path / "copy.bin").exists()


@pytest.mark.parametrize("fault", ["503", "500"])
def test_two_server_errors_then_success_are_retried_and_counted(store, fault):
    root, options, served = store
    served.fail_next(2, fault)
    counters = Counters()
    got = remote.read_range(f"{root}/data.bin", 0, 500, storage_options=options,
                            counters=counters, policy=QUICK)
    assert got == DATA[:500]
    assert counters.snapshot() | {"wait_s": 0} == {"requests": 3, "bytes": 500, "retries": 2,
                                                   "wait_s": 0}
    assert [request.fault for request in served.log] == [fault, fault, None]


def test_a_reset_connection_is_retried(store):
    """aiohttp repeats a GET once by itself on a dropped connection (uncounted): two resets
    fail one attempt of ours."""
    root, options, served = store
    served.fail_next(2, "reset")
    counters = Counters()
    got = remote.read_range(f"{root}/data.bin", 0, 500, storage_options=options,
                            counters=counters, policy=QUICK)
    assert got == DATA[:500]
    assert counters.snapshot()["retries"] >= 1
    assert [request.fault for request in served.log][:2] == ["reset", "reset"]


def test_a_missing_object_is_raised_at_once_naming_the_url(store):
    root, options, served = store
    url, counters = f"{root}/no-such.bin", Counters()
    with pytest.raises(FileNotFoundError) as info:
        remote.read_range(url, 0, 10, storage_options=options, counters=counters, policy=QUICK)
    assert info.value.filename == url and url in str(info.value)
    assert "404" in str(info.value) or "not found" in str(info.value)
    assert counters.snapshot()["requests"] == 1 and len(served.log) == 1


def test_access_denied_is_raised_at_once_naming_the_url(store):
    root, options, served = store
    url, counters = f"{root}/data.bin", Counters()
    served.fail_next(1, "403")
    with pytest.raises(PermissionError, match="access denied") as info:
        remote.read_range(url, 0, 10, storage_options=options, counters=counters, policy=QUICK)
    assert info.value.filename == url and "storage_options" in str(info.value)
    assert counters.snapshot()["requests"] == 1


def test_an_unreachable_server_is_named_with_its_url_and_the_cause(server, tmp_path):
    url = f"{server.url}/data.bin"
    server.stop()
    counters = Counters()
    with pytest.raises(ConnectionError) as info:
        remote.read_range(url, 0, 10, counters=counters, policy=QUICK)
    message = str(info.value)
    assert f"the server of {url} could not be reached" in message, message
    assert "ConnectionRefusedError" in message and "3 attempts" in message, message
    assert counters.snapshot()["requests"] == 3


def test_a_server_slower_than_the_timeout_raises_a_timeout_naming_the_url(store):
    root, options, served = store
    served.delay = 30.0  # cut short when the server stops
    url, counters = f"{root}/data.bin", Counters()
    policy = RemotePolicy(attempts=2, timeout=0.2, backoff=0.01)
    with pytest.raises(TimeoutError) as info:
        remote.read_range(url, 0, 10, storage_options=options, counters=counters, policy=policy)
    assert str(info.value).startswith(f"{url}: no answer within 0.2 s (2 attempts)")
    assert counters.snapshot()["requests"] == 2 and counters.snapshot()["retries"] == 1


def test_a_server_with_a_delay_and_a_bandwidth_cap_serves_and_counts_every_byte(tmp_path):
    data = DATA * 20  # 204,800 bytes: paced in 4 writes
    (tmp_path / "data.bin").write_bytes(data)
    with serving(lambda servers: servers.FileServer(tmp_path, delay=0.01, bandwidth=20e6)) as capped:
        assert remote.fetch(f"{capped.url}/data.bin", tmp_path / "copy.bin") == len(data)
    assert (tmp_path / "copy.bin").read_bytes() == data
    assert (capped.requests, capped.bytes_sent) == (1, len(data))


def test_local_paths_are_read_without_fsspec(tmp_path, monkeypatch):
    (tmp_path / "data.bin").write_bytes(DATA)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # an import of fsspec would fail
    for url in (str(tmp_path / "data.bin"), f"file://{tmp_path}/data.bin"):
        assert remote.read_range(url, 5, 50) == DATA[5:50]
        assert remote.size(url) == len(DATA)
        assert remote.fetch(url, tmp_path / "copy.bin") == len(DATA)
        assert (tmp_path / "copy.bin").read_bytes() == DATA


def test_a_truncated_remote_shard_is_named_with_its_real_end(server, tmp_path):
    index = sd.write(tmp_path / "shards", 50, 12)
    size = index.shards[1].end // 2
    with open(tmp_path / "shards" / "train-001.tar", "r+b") as shard:
        shard.truncate(size)
    remote_index = ShardIndex.load(f"{server.url}/shards/shards.json")
    reader = ShardReader(remote_index, policy=QUICK)
    with pytest.raises(ShardError, match=f"shard {remote_index.shards[1].url} ends at byte "
                                         f"{size}, before the sample at byte"):
        reader.read(remote_index.starts[1:2] + 11)  # the shard's last sample


@pytest.mark.parametrize("num_workers", [2, 0])
def test_a_sequence_delivers_every_sample_once_its_remote_reads_counted(store, tmp_path,
                                                                         num_workers):
    """Two 503s on the first reads are retried. A worker's counts reach the consumer's stats
    before its batch does: they hold every sample's bytes at least once, and at most what the
    server sent (workers run ahead into the next epoch, and are stopped before they send the
    counts of what they read there). In the consumer's process nothing runs ahead: the stats
    are what the server sent."""
    root, options, served = store
    seq = ShardSequence(f"{root}/shards/shards.json", sd.decode, batch_size=8, seed=1,
                        shuffle_window=5, num_workers=num_workers, out_type="null",
                        storage_options=options, remote=QUICK, timeout=60)
    served.clear_log()
    served.fail_next(2)
    with seq.start():
        numbers = [number for batch in seq for number in sd.consistent(batch)]
    assert sorted(numbers) == list(range(50))
    reads = [request for request in served.log if request.path.endswith(".tar")]
    assert all(request.method == "GET" and request.range for request in reads)
    sent = sum(request.sent for request in reads if request.fault is None)
    every_sample = sum(shard.end - int(shard.offsets[0])
                       for shard in ShardIndex.load(str(tmp_path / "shards" / "shards.json")).shards)
    stats = seq.stats
    assert stats.remote_retries == 2 and stats.as_dict()["remote_retries"] == 2
    assert every_sample <= stats.remote_bytes <= sent and stats.remote_wait_s > 0
    assert stats.remote_requests <= len(reads)
    if num_workers == 0:
        assert (stats.remote_requests, stats.remote_bytes) == (len(reads), sent)


def test_the_policy_names_a_wrong_argument():
    with pytest.raises(ValueError, match="attempts must be an integer >= 1, got 0"):
        RemotePolicy(attempts=0)
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0"):
        RemotePolicy(timeout=-1)
    with pytest.raises(TypeError, match=r"backoff must be a number of seconds >= 0, got 'x' \(str"):
        RemotePolicy(backoff="x")
    with pytest.raises(ValueError, match="max_backoff must be a number of seconds >= 0, got -1"):
        RemotePolicy(max_backoff=-1)
    with pytest.raises(TypeError, match="remote must be a shmseq.remote.RemotePolicy or None"):
        ShardSequence([], sd.decode, remote={"attempts": 3})
