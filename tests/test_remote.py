"""shmseq.remote against real servers on 127.0.0.1 (shmseq.bench.servers: files over HTTP with
Range, moto's S3): ranges and whole objects come back as stored, transient failures (503, 500,
a reset connection, a timeout) are retried and counted, the others raised at once naming the URL,
and a ShardSequence over either delivers every sample once, its workers' reads counted in
``seq.stats``. Nothing leaks (conftest; the fixtures check threads)."""
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

import shard_data as sd
import shmseq.shards
from servers import PlainServer, RawServer, s3, server, serving  # noqa: F401 - fixtures
from shmseq import ShmSeqError, remote
from shmseq.remote import Counters, RemotePolicy
from shmseq.shards import ShardError, ShardIndex, ShardReader, ShardSequence

QUICK = RemotePolicy(attempts=3, timeout=2, backoff=0.01)  # retries 5 to 20 ms apart
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
    return stopped(lambda stop: remote.fetch(url, target, storage_options=options, policy=policy,
                                             stop=stop))


def stopped(call) -> tuple[BaseException, float]:
    """``call(stop)`` in a thread, its stop event set 0.2 s in: (what it raised, the seconds
    from the stop to its end)."""
    stop, raised = threading.Event(), []

    def run():
        try:
            call(stop)
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
    assert message.startswith(f"{url}: the server could not be reached"), message
    assert "ConnectionRefusedError" in message and "3 attempts" in message, message
    assert counters.snapshot()["requests"] == 3


def test_a_server_slower_than_the_timeout_raises_a_timeout_naming_the_url(store):
    root, options, served = store
    served.delay = 30.0  # cut short when the server stops
    url, counters = f"{root}/data.bin", Counters()
    policy = RemotePolicy(attempts=2, timeout=0.2, backoff=0.01)
    with pytest.raises(TimeoutError) as info:
        remote.read_range(url, 0, 10, storage_options=options, counters=counters, policy=policy)
    assert str(info.value).startswith(f"{url}: no answer within 0.2 s (2 attempts in ")
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
    with pytest.raises(ValueError, match="deadline must be a number of seconds > 0, or None for "
                                         "no deadline, got 0"):
        RemotePolicy(deadline=0)


# -- what a server that stalls or answers wrongly is reported as -----------------------------------


def faulty(folder, fault: str, only: str = ""):
    """A ``RawServer`` of ``folder`` answering the paths that end with ``only`` with ``fault``."""
    return serving(lambda _: RawServer(folder, fault, only))


@pytest.mark.parametrize("policy", [None, RemotePolicy(attempts=3, timeout=0.25, backoff=0.01)],
                         ids=["default", "given"])
def test_a_server_that_stalls_before_the_first_batch_is_named_before_the_timeout(tmp_path, policy):
    """A server that accepts the connection and never answers: a worker fetching a shard of the
    first batch gives up within a third of the sequence's timeout (the default policy's deadline;
    the given policy fits in it), naming the shard's URL once, the attempts and the time. It
    was "the workers did not start within timeout=...: " naming nobody, the default policy's
    5 attempts of 30 s outlasting the sequence's timeout. A ShardError, not the sequence's own
    timeout, is what shows it came first."""
    sd.write(tmp_path / "shards", 50, 12)
    with faulty(tmp_path, "stall", only=".tar") as stalled:
        seq = ShardSequence(f"{stalled.url}/shards/shards.json", sd.decode, batch_size=8, seed=1,
                            num_workers=2, out_type="null", timeout=4.5, remote=policy,
                            cache_dir=tmp_path / "cache")
        with pytest.raises(ShardError) as info:
            with seq.start():
                next(iter(seq))
    message = str(info.value)
    assert re.match(rf"shard {stalled.url}/shards/train-\d+\.tar: ", message), message
    assert message.count(stalled.url) == 1, message
    said = (r"no answer \(1 attempt in \d+\.\d s, ended by RemotePolicy\(deadline=1\.5\)\)"
            if policy is None else r"no answer within 0\.25 s \(3 attempts in \d+\.\d s\)")
    assert re.search(said, message), message


@pytest.mark.parametrize("cached", [False, True], ids=["in place", "through the cache"])
def test_a_server_that_stalls_mid_epoch_is_named_before_the_batch_times_out(tmp_path, cached):
    """train-003.tar stalls, the shards before it are served: the worker's read gives up at its
    deadline and the batch fails naming the shard and "no answer" (it was a BatchTimeout naming
    the batch alone, the default policy outlasting the timeout). Through the cache, the
    prefetcher's fetch stalls first, and a worker waits for it, then fetches the shard itself
    (a failed prefetch is left to the workers from then on)."""
    sd.write(tmp_path / "shards", 50, 12)
    taken = []
    # through the cache, a batch may wait for two fetches of the stalled shard (the prefetcher's,
    # then its worker's own), and its other shard's fetch, 4 at once, may wait a moment for a core
    reading = ({"cache": True, "cache_dir": str(tmp_path / "cache"), "timeout": 15} if cached else
               {"shuffle_window": 1, "timeout": 4.5})
    with faulty(tmp_path, "stall", only="train-003.tar") as stalled:
        seq = ShardSequence(f"{stalled.url}/shards/shards.json", sd.decode, batch_size=8,
                            shuffle=False, num_workers=2, out_type="null", **reading)
        with pytest.raises(ShardError) as info:
            with seq.start():
                for batch in seq:
                    taken += sd.consistent(batch)
                    del batch  # info's traceback holds this frame: it must not hold a batch
    message = str(info.value)
    assert taken == list(range(32)), message  # batch 4 reads samples 36-39 from train-003.tar
    assert message.startswith(f"shard {stalled.url}/shards/train-003.tar: "), message
    assert "no answer (1 attempt in " in message and message.count(stalled.url) == 1, message


def test_a_given_policy_that_outlasts_the_sequence_timeout_is_refused(tmp_path):
    """Its worst case (5 attempts of 30 s and their back-offs: 157.5 s) past a third of the
    sequence's timeout would let the batch time out before the remote error could name the
    URL: refused, saying what fits. The default policy is given that deadline instead; without
    a timeout, any policy goes."""
    sd.write(tmp_path / "shards", 50, 12)
    index = str(tmp_path / "shards" / "shards.json")
    given = RemotePolicy()
    assert given.worst_case() == 157.5 and RemotePolicy(deadline=9).worst_case() == 9
    assert RemotePolicy(timeout=None).worst_case() is None
    with pytest.raises(ValueError) as info:
        ShardSequence(index, sd.decode, remote=given, timeout=3, out_type="null")
    message = str(info.value)
    assert message.startswith(f"remote={given!r} may wait up to 157.5 s for one request"), message
    assert "longer than 1 s, a third of the sequence's timeout=3 s" in message, message
    assert "Give the policy deadline=1 " in message and "(at least 472.5 s)" in message, message
    fits = RemotePolicy(attempts=2, timeout=0.4, backoff=0.1)
    for policy, timeout, used in [(fits, 3, fits), (None, 3, RemotePolicy(deadline=1)),
                                  (given, None, given)]:
        seq = ShardSequence(index, sd.decode, remote=policy, timeout=timeout, out_type="null")
        assert seq.worker.reader.policy == used


def test_a_first_batch_slower_than_the_timeout_names_the_batch_and_its_worker(tmp_path):
    """Each request is answered within its deadline (0.5 s of 1.5), but the one batch reads 200
    shards (a request each, the fetch process's and the worker's fetches 12 at a time: 8 s):
    start() gives up after its timeout saying that the worker started and which batch it is
    building (it said "did not start within timeout=...: " and nothing more)."""
    sd.write(tmp_path / "shards", 200, 1)
    with serving(lambda servers: servers.FileServer(tmp_path, delay=0.5)) as slow:
        seq = ShardSequence(f"{slow.url}/shards/shards.json", sd.decode, batch_size=200,
                            num_workers=1, out_type="null", timeout=4.5, cache_dir=tmp_path / "c")
        with pytest.raises(ShmSeqError, match=r"did not start within timeout=4\.5 s: each started, "
                                              r"but none has built its first batch yet, which the "
                                              r"ring is sized by; the first, batch 0 of epoch 0, is "
                                              r"with worker 0 \(pid \d+\): a first batch "
                                              r"that takes longer needs a longer timeout="):
            seq.start()


def test_a_body_cut_short_is_retried_and_said_so_with_its_counts(tmp_path):
    """The connection closes halfway through the body: a transient failure, retried, and then
    not "the server could not be reached" but how many of the bytes came."""
    (tmp_path / "data.bin").write_bytes(DATA)
    counters = Counters()
    with faulty(tmp_path, "cut") as cut:
        url = f"{cut.url}/data.bin"
        with pytest.raises(ConnectionError) as info:
            remote.read_range(url, 100, 1100, counters=counters, policy=QUICK)
    message = str(info.value)
    assert message.startswith(f"{url}: the server cut its answer short: the connection closed "
                              "after 500 of the 1,000 bytes of its answer's body (3 attempts in "), message
    assert "could not be reached" not in message and counters.snapshot()["retries"] == 2


def test_bytes_after_a_body_are_counted_never_quoted(tmp_path):
    """A server that sends 1 KiB more than its Content-Length: aiohttp's own error quotes those
    bytes; the message says how many were asked for and that more came."""
    (tmp_path / "data.bin").write_bytes(DATA)
    with faulty(tmp_path, "extra") as extra:
        url = f"{extra.url}/data.bin"
        with pytest.raises(OSError) as info:
            remote.read_range(url, 100, 1100, policy=QUICK)
    message = str(info.value)
    assert message.startswith(f"{url}: asked for bytes 100-1100 (1,000 bytes), the server sent "
                              "more than its answer announced"), message
    assert "\\x" not in message and "abcdef" not in message and len(message) < 400, message


def test_a_server_that_ignores_range_serves_a_whole_object_and_refuses_a_part(tmp_path):
    """A 200 with the whole object answers a fetch (the cache's way) but not a range from the
    middle: said once, not taken for an object that ends early."""
    (tmp_path / "data.bin").write_bytes(DATA)
    with faulty(tmp_path, "whole") as whole:
        url = f"{whole.url}/data.bin"
        assert remote.fetch(url, tmp_path / "copy.bin", policy=QUICK) == len(DATA)
        with pytest.raises(remote.RangeIgnored) as info:
            remote.read_range(url, 5000, 20_000, policy=QUICK)
    assert str(info.value) == (f"{url}: the server ignored the Range request for bytes "
                               "5000-20000 (it answered 200 with the whole object, 10,240 "
                               "bytes): reading part of an object needs a server that "
                               "honours Range requests")


def test_a_large_object_from_a_server_that_ignores_range_is_streamed_whole(tmp_path):
    """``python -m http.server`` answers a fetch's first range (32 MiB) with the whole 40 MiB
    object: taken in that one request, written as it comes, never held in memory (it failed:
    "asked for bytes 0-33554432, the server answered 200 with the whole object")."""
    data = os.urandom(1 << 20) * 40
    (tmp_path / "big.bin").write_bytes(data)
    with serving(lambda _: PlainServer(tmp_path)) as served:
        url, counters = f"{served.url}/big.bin", Counters()
        remote.size(url)  # what a request imports, imported before memory is traced
        tracemalloc.start()
        try:
            assert remote.fetch(url, tmp_path / "copy.bin", counters=counters) == len(data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert (tmp_path / "copy.bin").read_bytes() == data
    assert peak < 4 << 20, f"the fetch held {peak:,} bytes at most"
    assert [method for method, path, _ in served.log if path == "/big.bin"] == ["HEAD", "GET"]
    assert counters.snapshot()["bytes"] == len(data)


def test_a_whole_object_in_place_of_a_range_is_timed_chunk_by_chunk(tmp_path, monkeypatch):
    """Where a fetch asks for a chunk, a server that ignores Range sends the whole object: each
    chunk's worth of it must come within the policy's timeout, as a range would, not all of it.
    40 kB in 4 kB pieces 50 ms apart (0.5 s) come whole in chunks of 8 kB under a timeout of
    0.3 s; a server that stalls after its first piece is cut off, named with the timeout."""
    monkeypatch.setattr(remote, "FETCH_CHUNK_BYTES", 8192)
    (tmp_path / "data.bin").write_bytes(DATA * 4)
    policy = RemotePolicy(attempts=2, timeout=0.3, backoff=0.01)
    with serving(lambda _: PlainServer(tmp_path, pace=0.05)) as slow:
        began = time.monotonic()
        got = remote.fetch(f"{slow.url}/data.bin", tmp_path / "copy.bin", policy=policy)
        took = time.monotonic() - began
    assert got == len(DATA) * 4 and (tmp_path / "copy.bin").read_bytes() == DATA * 4
    assert took > policy.timeout and len(slow.log) == 1
    with serving(lambda _: PlainServer(tmp_path, pace=30)) as stalled:
        url = f"{stalled.url}/data.bin"
        with pytest.raises(TimeoutError) as info:
            remote.fetch(url, tmp_path / "stalled.bin", policy=policy)
    assert re.fullmatch(rf"{url}: no answer within 0.3 s \(2 attempts in 0\.\d s\): .*",
                        str(info.value)), info.value
    assert not (tmp_path / "stalled.bin").exists()


def test_a_whole_object_stopped_as_it_comes_writes_nothing(tmp_path):
    """A fetch stopped while a server that ignores Range sends the whole object (40 kB in 4 kB
    pieces 50 ms apart, stopped 0.2 s in) ends at once, and leaves no file."""
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "data.bin").write_bytes(DATA * 4)
    target = tmp_path / "fetched" / "data.bin"
    target.parent.mkdir()
    with serving(lambda _: PlainServer(tmp_path / "served", pace=0.05)) as slow:
        raised, took = stopped_fetch(f"{slow.url}/data.bin", target)
    assert isinstance(raised, remote.FetchStopped) and took < 1
    assert os.listdir(target.parent) == []


def test_a_read_in_place_from_a_server_that_ignores_range_says_so_once(tmp_path):
    """``python -m http.server`` answers a sample's range with the whole shard: the batch fails
    with one error that names the shard once, the bytes asked for once, that the server ignored
    the Range request, and what to do: the cache (it said "reading bytes A-B failed: OSError:
    asked for bytes A-B", and told only to change the server)."""
    sd.write(tmp_path / "shards", 50, 12)
    with serving(lambda _: PlainServer(tmp_path)) as served:
        seq = ShardSequence(f"{served.url}/shards/shards.json", sd.decode, batch_size=8, seed=1,
                            num_workers=1, out_type="null", timeout=20, remote=QUICK,
                            shuffle_window=1)
        with pytest.raises(ShardError) as info:
            with seq.start():
                for _ in seq:
                    pass
    message = str(info.value)
    assert re.match(rf"shard {served.url}/shards/train-\d+\.tar: the server ignored the Range "
                    r"request for bytes \d+-\d+ \(it answered 200 with the whole object, [\d,]+ "
                    r"bytes\): reading shards in place needs Range requests: pass cache=True to "
                    r"read them through the node's shard cache \(it fetches whole shards\), or "
                    r"serve them from a server that honours Range \(object stores and common web "
                    r"servers do\)$", message), message
    assert message.count(served.url) == 1 and len(re.findall(r"\d+-\d+", message)) == 1, message
    asked = [(path, ranged) for method, path, ranged in served.log if path.endswith(".tar")]
    assert len(asked) == len(set(asked)), asked  # not retried: it would answer the same


SAID = {"whole": r"the server ignored the Range request for bytes \d+-\d+ \(it answered 200 "
                 r"with the whole object, [\d,]+ bytes\): reading shards in place needs Range",
        "short": r"asked for bytes \d+-\d+ \([\d,]+ bytes\) of an object of [\d,]+ bytes, the "
                 r"server sent only [\d,]+: it answers ranges short",
        "extra": r"asked for bytes \d+-\d+ \([\d,]+ bytes\), the server sent more than its "
                 r"answer announced: bytes past the end of its body",
        "cut": r"the server cut its answer short: the connection closed after [\d,]+ of the "
               r"[\d,]+ bytes of its answer's body \(3 attempts in \d+\.\d s\)"}


@pytest.mark.parametrize("cached", [False, True], ids=["in place", "cached"])
@pytest.mark.parametrize("fault", list(SAID))
def test_what_a_faulty_server_sent_is_said_once_through_a_sequence(tmp_path, fault, cached):
    """What the user gets from the loop: the shard reader names the shard, the remote layer what
    came, once each (a server ignoring Range was "url: OSError: url: ..." inside "shard url:",
    a short answer "the shard ends at byte S, before the sample ... ends (byte E)" with S past
    E, and bytes after a body a kilobyte of them). A whole object is all a cached shard needs."""
    sd.write(tmp_path / "shards", 50, 12)
    options = {"cache_dir": tmp_path / "cache"} if cached else {"shuffle_window": 1}
    with faulty(tmp_path, fault, only=".tar") as served:
        seq = ShardSequence(f"{served.url}/shards/shards.json", sd.decode, batch_size=8, seed=1,
                            num_workers=1, out_type="null", timeout=20, remote=QUICK, **options)
        if fault == "whole" and cached:
            with seq.start():
                assert sorted(n for batch in seq for n in sd.consistent(batch)) == list(range(50))
            return
        with pytest.raises(ShardError) as info:
            with seq.start():
                for batch in seq:
                    del batch  # else the traceback's frame, in a cycle with info, keeps it mapped
    message = str(info.value)
    assert re.match(rf"shard {served.url}/shards/train-\d+\.tar: ", message), message
    assert re.search(SAID[fault], message) and message.count(served.url) == 1, message
    assert "\\x" not in message and len(message) < 600, message


@pytest.mark.parametrize("local", ["absolute", "file"])
def test_a_remote_index_naming_local_files_is_refused(server, tmp_path, local):
    """An index from a server must not make the reader read (and cache) this machine's files:
    an absolute path or a file:// URL in it is refused, naming the index and the entry; a
    relative entry stays relative to the index's URL."""
    written = sd.write(tmp_path / "local", 20, 10)
    with open(tmp_path / "local" / "shards.json") as file:
        saved = json.load(file)
    named = written.shards[1].url if local == "absolute" else f"file://{written.shards[1].url}"
    saved["shards"][0]["url"] = "../local/train-000.tar"
    saved["shards"][1]["url"] = named
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "shards.json").write_text(json.dumps(saved))
    url = f"{server.url}/served/shards.json"
    with pytest.raises(ValueError) as info:
        ShardIndex.load(url)
    assert str(info.value).startswith(f"the index {url} names a local file for shard 1: "
                                      f"{named!r}"), info.value
    with pytest.raises(ValueError, match="names a local file for shard 1"):
        ShardSequence(url, sd.decode, out_type="null")
    saved["shards"][1]["url"] = "../local/train-001.tar"
    (tmp_path / "served" / "shards.json").write_text(json.dumps(saved))
    assert [shard.url for shard in ShardIndex.load(url).shards] == [
        f"{server.url}/served/../local/train-{n:03d}.tar" for n in range(2)]


def test_writing_and_a_remote_scan_show_labelled_progress(server, tmp_path, capsys, monkeypatch):
    """write_shards' bar and the scan's are labelled; a remote scan (a request for each header)
    shows beside its bar the samples found in the shard it reads."""
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread left behind
    shmseq.shards.write_shards(sd.samples(30), str(tmp_path / "shards" / "t-%03d.tar"),
                               samples_per_shard=10, progress=True)
    monkeypatch.setattr(shmseq.shards.progress, "POSTFIX_S", 0)  # each sample found is shown
    ShardIndex.scan([f"{server.url}/shards/t-{n:03d}.tar" for n in range(3)], progress=True)
    shown = capsys.readouterr().err
    assert "writing shards" in shown and "scanning shards" in shown and "3/3" in shown, shown
    assert "t-002.tar: 10 samples" in shown, shown


# -- a whole-object fetch streamed without fsspec ---------------------------------------------------


FETCHED_IN_A_FRESH_PROCESS = """
import json, sys, threading
from shmseq import remote
options = json.loads(sys.argv[3])
version = remote.version(sys.argv[1], storage_options=options)
size = remote.fetch(sys.argv[1], sys.argv[2], storage_options=options)
print(json.dumps({"size": size, "version": version.startswith(f"size {size} "),
                  "fsspec": sorted(m for m in sys.modules if m.split(".")[0] in (
                      "fsspec", "aiohttp", "s3fs", "aiobotocore")),
                  "threads": [thread.name for thread in threading.enumerate()]}))
"""


def test_a_fetch_and_its_version_go_in_their_own_thread_without_fsspec(store, tmp_path):
    """fsspec's event loop thread received and copied every byte of a fetch (about twice the
    CPU of a streamed GET), and importing it and its clients cost a cold process 0.15 s (HTTP)
    to 0.4 s (S3) before its first shard's version: in a fresh process, a version and a fetch
    of 4 MB over HTTP or S3 import no fsspec, aiohttp or s3fs and start no thread."""
    root, options, served = store
    data = os.urandom(4 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    if options is not None:
        root = served.upload(tmp_path, "big")
    target = tmp_path / "copy.bin"
    done = subprocess.run([sys.executable, "-c", FETCHED_IN_A_FRESH_PROCESS, f"{root}/big.bin",
                           str(target), json.dumps(options)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said == {"size": len(data), "version": True, "fsspec": [],
                    "threads": ["MainThread"]}, said
    assert target.read_bytes() == data


def test_an_s3_object_is_fetched_chunk_by_chunk_to_its_end(tmp_path, monkeypatch):
    """As over HTTP: 8,192 bytes in 4,096-byte chunks take 3 requests, the third past the end
    (S3's 416, InvalidRange, is the object's end)."""
    pytest.importorskip("moto.moto_server.werkzeug_app")
    monkeypatch.setattr(remote, "FETCH_CHUNK_BYTES", 4096)
    (tmp_path / "exact.bin").write_bytes(DATA[:8192])
    counters = Counters()
    with serving(lambda servers: servers.S3Server()) as moto:
        root = moto.upload(tmp_path, "chunks")
        assert remote.fetch(f"{root}/exact.bin", tmp_path / "copy.bin", counters=counters,
                            storage_options=moto.storage_options) == 8192
    assert (tmp_path / "copy.bin").read_bytes() == DATA[:8192]
    assert counters.snapshot()["requests"] == 3 and [r.range for r in moto.log] == [
        "bytes=0-4095", "bytes=4096-8191", "bytes=8192-12287"]


class CutOnce(RawServer):
    """A ``RawServer`` whose second answer is cut halfway through its body."""

    def answer(self, method, path, headers):
        self.answers = getattr(self, "answers", 0) + 1
        self.fault = "cut" if self.answers == 2 else None
        return super().answer(method, path, headers)


def test_a_chunk_cut_short_is_fetched_again_from_its_start(tmp_path, monkeypatch):
    """The second of three chunks is cut halfway: what it wrote is dropped, it is asked again,
    and the file is the object."""
    monkeypatch.setattr(remote, "FETCH_CHUNK_BYTES", 4096)
    (tmp_path / "data.bin").write_bytes(DATA)
    counters = Counters()
    with serving(lambda _: CutOnce(tmp_path)) as cut:
        assert remote.fetch(f"{cut.url}/data.bin", tmp_path / "copy.bin", counters=counters,
                            policy=QUICK) == len(DATA)
    assert (tmp_path / "copy.bin").read_bytes() == DATA
    assert counters.snapshot() | {"wait_s": 0} == {"requests": 4, "bytes": len(DATA),
                                                   "retries": 1, "wait_s": 0}


class Redirector:
    """Answers every GET with 302 to the same path at ``to``."""

    def __init__(self, to: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(302)
                self.send_header("Location", to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,))
        self._thread.start()

    def stop(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def test_a_fetch_follows_redirects_and_goes_through_a_proxy_given(tmp_path):
    """As aiohttp did: a redirect followed, and a ``proxy`` in storage_options asked for the
    URL (the file server, asked for a whole URL, serves its path)."""
    (tmp_path / "data.bin").write_bytes(DATA)
    with serving(lambda servers: servers.FileServer(tmp_path)) as served:
        with serving(lambda _: Redirector(served.url)) as moved:
            assert remote.fetch(f"{moved.url}/data.bin", tmp_path / "a.bin") == len(DATA)
        proxied = {"proxy": served.url, "headers": {"X-Asked": "yes"}}
        assert remote.fetch("http://shards.invalid/data.bin", tmp_path / "b.bin",
                            storage_options=proxied) == len(DATA)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes() == DATA
    assert [request.path for request in served.log] == ["/data.bin",
                                                        "http://shards.invalid/data.bin"]


def test_storage_options_a_fetch_cannot_honour_are_named(tmp_path):
    """Named before any request, rather than left out of the requests."""
    url, options = "http://127.0.0.1:9/data.bin", {"client_kwargs": {"cookies": {}}, "timeout": 5,
                                                   "block_size": 0}
    with pytest.raises(ValueError) as info:
        remote.fetch(url, tmp_path / "copy.bin", storage_options=options)
    assert str(info.value).startswith(f"{url}: storage_options client_kwargs['cookies'], "
                                      "timeout cannot be honoured by a fetch"), info.value
    assert os.listdir(tmp_path) == []


# -- an object's version and size: one HEAD through the same streamed path --------------------------


def rewrite(store, tmp_path, data: bytes) -> None:
    """``data.bin`` written again with ``data``: uploaded again to S3, or served a few seconds
    later than it was (a time of change is all the file server says of it)."""
    root, options, served = store
    (tmp_path / "data.bin").write_bytes(data)
    later = time.time() + 5
    os.utime(tmp_path / "data.bin", (later, later))
    if options is not None:
        served.upload(tmp_path, root.removeprefix("s3://"))


def test_a_version_is_one_head_and_tells_a_rewritten_object(store, tmp_path):
    """One request, no body; the same object keeps its version, one rewritten with as many
    bytes gets another (the ETag, or the file server's time of change), and ``size`` is the
    same HEAD's."""
    root, options, served = store
    url, counters = f"{root}/data.bin", Counters()
    first = remote.version(url, storage_options=options, counters=counters)
    assert re.fullmatch(rf"size {len(DATA)} (ETag \S+|Last-Modified .+)", first), first
    assert [(r.method, r.sent) for r in served.log] == [("HEAD", 0)]
    assert counters.snapshot()["requests"] == 1
    assert remote.version(url, storage_options=options) == first
    rewrite(store, tmp_path, DATA[::-1])
    assert remote.version(url, storage_options=options) not in (first, None)
    assert remote.size(url, storage_options=options) == len(DATA)


def test_a_version_of_a_missing_or_denied_object_is_raised_at_once_naming_the_url(store):
    root, options, served = store
    for url, fault, error in [(f"{root}/no-such.bin", None, FileNotFoundError),
                              (f"{root}/data.bin", "403", PermissionError)]:
        counters = Counters()
        if fault:
            served.fail_next(1, fault)
        with pytest.raises(error) as info:
            remote.version(url, storage_options=options, counters=counters, policy=QUICK)
        assert info.value.filename == url and url in str(info.value), info.value
        assert re.search("404|access denied", str(info.value)), info.value
        assert counters.snapshot()["requests"] == 1


def test_a_version_is_retried_timed_out_and_stopped_as_a_fetch(store):
    """Two 503s retried and counted; a server slower than the timeout named with it; a stop
    ends the HEAD in flight."""
    root, options, served = store
    url, counters = f"{root}/data.bin", Counters()
    served.fail_next(2)
    remote.version(url, storage_options=options, counters=counters, policy=QUICK)
    assert counters.snapshot() | {"wait_s": 0} == {"requests": 3, "bytes": 0, "retries": 2,
                                                   "wait_s": 0}
    served.delay = 30.0  # cut short when the server stops
    with pytest.raises(TimeoutError, match=rf"^{url}: no answer within 0.2 s \(2 attempts in "):
        remote.version(url, storage_options=options,
                       policy=RemotePolicy(attempts=2, timeout=0.2, backoff=0.01))
    raised, took = stopped(lambda stop: remote.version(url, storage_options=options, stop=stop))
    assert isinstance(raised, remote.FetchStopped) and took < 5


NO_LENGTH = b"HTTP/1.1 200 OK\r\nETag: \"e1\"\r\n\r\n"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"


class Headless(RawServer):
    """A ``RawServer`` whose answer to a HEAD (and to a GET, where given) is ``head`` (``get``);
    ``asked`` holds (method, Range header) of each request."""

    def __init__(self, folder, head: bytes, get: bytes | None = None, fault=None) -> None:
        super().__init__(folder, fault)
        self.head, self.get, self.asked = head, get, []

    def answer(self, method, path, headers):
        self.asked.append((method, headers.get("range")))
        canned = self.head if method == "HEAD" else self.get
        return super().answer(method, path, headers) if canned is None else canned


@pytest.mark.parametrize("head, get, fault, said", [
    (b"HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\nContent-Length: 0\r\n\r\n", None, None,
     f"size {len(DATA)}"),
    (NO_LENGTH, None, "whole", f"size {len(DATA)}"),
    (NO_LENGTH, CHUNKED, None, None)], ids=["405, a range", "no length, the whole object",
                                            "no length, no range"])
def test_a_server_without_a_size_for_head_is_asked_for_the_first_byte(tmp_path, head, get, fault,
                                                                      said):
    """A HEAD refused (405) or without Content-Length: a GET of byte 0 says the size, from its
    Content-Range, or from the Content-Length of a whole object (its body not read); where
    neither says it, the error says what is missing, at once."""
    (tmp_path / "data.bin").write_bytes(DATA)
    counters = Counters()
    with serving(lambda _: Headless(tmp_path, head, get, fault)) as served:
        url = f"{served.url}/data.bin"
        if said is None:
            with pytest.raises(OSError, match=rf"^{url}: the server does not say the object's "
                                              r"size: it answered HEAD without Content-Length, "
                                              r"and answered a GET of its first byte with 200"):
                remote.version(url, counters=counters, policy=QUICK)
        else:
            assert remote.version(url, counters=counters, policy=QUICK) == said
    assert served.asked == [("HEAD", None), ("GET", "bytes=0-0")]
    assert counters.snapshot()["requests"] == 2 and counters.snapshot()["retries"] == 0
