"""Samples read before their shard is whole (``shmseq.shards.early``): each sample's digest in
the index (version 3), a batch's runs read from the file a shard's fetch is writing as soon as
their bytes are there, by a range request of their own for a process's first batch during a
large shard's fetch, and never a byte that does not match its digest."""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import io
import json
import os
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmseq.shards import (ShardCache, ShardIndex, ShardPlan, ShardReader, ShardSequence,
                           ShardWorker, StaleShardError, write_shards)
from shmseq.shards.cache import TAR_TAIL
from shmseq.shards.files import open_private
from shmseq.shards import index as index_module
from shmseq.shards.index import SAMPLE_DIGEST_BYTES, sample_digest, shard_digests
from shmseq.shards.tar import ShardError
from shmseq.shards.locks import lock, unlock
from servers import RawServer, serving
from test_shard_cache import cache_dir  # noqa: F401 - the fixture

PER_SHARD, PAYLOAD = 8, 64 << 10


def samples(shards: int, per_shard: int = PER_SHARD, payload: int = PAYLOAD, salt: int = 0):
    for number in range(shards * per_shard):
        yield {"__key__": f"s{number:05d}", "id": str(number),
               "bin": bytes([(number + salt) % 251]) * payload}


def decode(sample: dict) -> np.ndarray:
    return np.array([int(sample["id"]), len(sample["bin"]), sample["bin"][0]], np.int64)


def ids_of(found: list[dict]) -> list[int]:
    return [int(sample["id"]) for sample in found]


# -- the index ------------------------------------------------------------------------------------
def test_the_index_keeps_each_samples_digest_and_reads_older_versions(tmp_path):
    written = write_shards(samples(2), str(tmp_path / "s-%03d.tar"), samples_per_shard=PER_SHARD)
    written.save(tmp_path / "index.json")
    loaded = ShardIndex.load(str(tmp_path / "index.json"))
    scanned = ShardIndex.scan([shard.url for shard in written.shards])
    for shard, again, read in zip(written.shards, loaded.shards, scanned.shards):
        assert len(shard.digests) == SAMPLE_DIGEST_BYTES * len(shard)
        assert again.digests == read.digests == shard.digests
        data = open(shard.url, "rb").read()
        for ordinal in range(len(shard)):
            start, stop = shard.span(ordinal)
            assert shard.digest(ordinal) == sample_digest(data[start:stop])
    saved = json.loads((tmp_path / "index.json").read_text())
    assert saved["version"] == 3
    for entry in saved["shards"]:  # as version 2 wrote it: no samples' digests, none read early
        del entry["sample_sha256"]
    (tmp_path / "v2.json").write_text(json.dumps({**saved, "version": 2}))
    assert all(shard.digests is None for shard in ShardIndex.load(str(tmp_path / "v2.json")).shards)
    saved = json.loads((tmp_path / "index.json").read_text())
    seven = base64.b64decode(saved["shards"][1]["sample_sha256"])[:7 * SAMPLE_DIGEST_BYTES]
    saved["shards"][1]["sample_sha256"] = base64.b64encode(seven).decode()
    (tmp_path / "cut.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"s-001.tar has \d+ bytes of samples' digests for 8 "
                                         r"samples .*the index is damaged"):
        ShardIndex.load(str(tmp_path / "cut.json"))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), head=st.integers(0, 50),
       tail=st.integers(0, 50), chunk=st.integers(1, 97))
def test_each_samples_digest_is_its_own_whatever_the_chunks_read(sizes, head, tail, chunk):
    """``shard_digests`` reads the shard once, in chunks that samples straddle: each digest is
    its sample's bytes' alone, and the whole file's SHA-256 is the file's."""
    data = bytes(range(256)) * ((head + sum(sizes) + tail) // 256 + 1)
    data = data[:head + sum(sizes) + tail]
    offsets = np.array(head + np.cumsum([0] + sizes[:-1]), np.int64)
    end = head + sum(sizes)
    with mock.patch.object(index_module, "DIGEST_CHUNK_BYTES", chunk):
        size, whole, digests = shard_digests(io.BytesIO(data), offsets, end)
    assert (size, whole) == (len(data), hashlib.sha256(data).hexdigest())
    stops = list(offsets[1:]) + [end]
    assert digests == b"".join(sample_digest(data[start:stop])
                               for start, stop in zip(offsets, stops))
    with pytest.raises(ShardError, match="before its sample at byte"):
        shard_digests(io.BytesIO(data[:end - 1]), offsets, end)


# -- from the file a fetch is writing -------------------------------------------------------------
def fetch_under_way(cache: ShardCache, number: int, data: bytes) -> int:
    """Another process's fetch of shard ``number`` as the cache sees it: the shard's lock held
    and ``data`` come so far. The lock's descriptor."""
    held = lock(cache._lock_path(number), wait=False)
    assert held is not None
    fd = open_private(cache.part_path(number), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as part:
        part.write(data)
    return held


def test_a_sample_is_read_from_its_shards_fetch_as_soon_as_its_bytes_are_there(tmp_path, cache_dir):
    """While another process fetches a shard (its lock held), a batch whose samples' bytes
    are in the fetch's file already is read from there; one whose bytes are not yet waits for
    them, and gets them as they come; bytes that do not match a sample's digest (a fetch
    retried over a rewritten object) are never read: the sample waits for the checked shard."""
    index = write_shards(samples(2), str(tmp_path / "s-%03d.tar"), samples_per_shard=PER_SHARD)
    shard = [open(s.url, "rb").read() for s in index.shards]
    cache = ShardCache(index, cache_dir, "early")
    cache.prepare()
    reader = ShardReader(index, cache=cache)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    held = []
    try:
        half = index.shards[0].span(3)[1]
        held.append(fetch_under_way(cache, 0, shard[0][:half]))
        assert ids_of(pool.submit(reader.read, np.array([2, 0, 3])).result(timeout=20)) == [2, 0, 3]
        later = pool.submit(reader.read, np.array([6, 1]))
        time.sleep(0.3)
        assert not later.done()  # sample 6's bytes have not come
        with open(cache.part_path(0), "ab") as part:
            part.write(shard[0][half:])
        assert ids_of(later.result(timeout=20)) == [6, 1]
        assert cache.counters.take()["shard_early_reads"] == 5

        changed = bytearray(shard[1])
        changed[index.shards[1].span(2)[1] - 600] ^= 0xFF  # in sample 10's data
        held.append(fetch_under_way(cache, 1, bytes(changed)))
        waiting = pool.submit(reader.read, np.array([PER_SHARD + 2]))
        time.sleep(0.3)
        assert not waiting.done()
        unlock(held.pop())  # the "other fetcher" gone: the reader fetches the shard itself
        found = waiting.result(timeout=20)  # from its fetch's file, or the whole shard: checked
        assert ids_of(found) == [PER_SHARD + 2] and found[0]["bin"] == bytes([10]) * PAYLOAD
    finally:
        for fd in held:
            unlock(fd)
        reader.close()
        pool.shutdown()
        cache.remove()


def test_a_worker_decodes_the_samples_that_came_while_the_others_are_fetched(tmp_path,
                                                                             cache_dir):
    """A batch whose shard is half fetched: the worker decodes the samples of that half at
    once, while the fetch brings the rest (it decoded nothing before the whole batch was in)."""
    index = write_shards(samples(1), str(tmp_path / "s-%03d.tar"), samples_per_shard=PER_SHARD)
    shard = open(index.shards[0].url, "rb").read()
    cache = ShardCache(index, cache_dir, "decode")
    cache.prepare()
    decoded = []
    worker = ShardWorker(index, lambda sample: decoded.append(int(sample["id"])) or decode(sample),
                         cache=cache)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    half = index.shards[0].span(3)[1]
    held = fetch_under_way(cache, 0, shard[:half])
    try:
        batch = pool.submit(worker.__getitem__, np.array([6, 1, 7, 2]))
        deadline = time.monotonic() + 20
        while sorted(decoded) != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(decoded) == [1, 2] and not batch.done()
        with open(cache.part_path(0), "ab") as part:
            part.write(shard[half:])
        assert batch.result(timeout=20)[:, 0].tolist() == [6, 1, 7, 2]
    finally:
        unlock(held)
        worker.reader.close()
        pool.shutdown()
        cache.remove()


# -- by range requests, over HTTP -----------------------------------------------------------------
BIG = 2 << 20  # 4 samples of it: shards of 8 MiB


@pytest.fixture
def ranged(monkeypatch):
    """Range requests for shards of 8 MiB (64 MiB and more by default), half of each fetched
    twice at most (an eighth by default: a sample here is a quarter), in forked workers too."""
    from shmseq.shards.early import EarlyReads
    monkeypatch.setattr(EarlyReads, "RANGE_MIN_BYTES", 8 << 20)
    monkeypatch.setattr(ShardCache, "EARLY_SHARE", 1 / 2)


def test_the_node_fetches_at_most_an_eighth_of_each_shard_twice(tmp_path, cache_dir):
    """What readers may fetch by range requests before a shard is whole is claimed in the
    node's ledger: an eighth of each shard for the whole job, whichever process asks."""
    index = write_shards(samples(2), str(tmp_path / "s-%03d.tar"), samples_per_shard=PER_SHARD)
    cache = ShardCache(index, cache_dir, "claims")
    cache.prepare()
    try:
        eighth = int(cache.estimates[0]) // 8
        assert cache.claim_ranges({0: eighth - 10, 1: 5}) == {0, 1}
        assert cache.claim_ranges({0: 11, 1: 5}) == {1}  # shard 0's eighth is used up
        assert cache.claim_ranges({0: 10}) == {0}
        assert cache.ledger.table()["early"].tolist() == [eighth, 10]
    finally:
        cache.remove()


def test_the_first_batch_comes_before_its_shards_are_whole(tmp_path, cache_dir, ranged):
    """Over a link of 8 MB/s, the 2 shards of 8 MiB the first batch reads take 2 s or more to
    come whole; the first batch comes before either has, its samples read by range requests
    and checked. Every sample comes once, in the plan's order, and the range requests' bytes
    are at most the node's share of each shard (half, here)."""
    index = write_shards(samples(2, 4, BIG), str(tmp_path / "web" / "b-%03d.tar"),
                         samples_per_shard=4)
    index.save(tmp_path / "web" / "index.json")
    with serving(lambda servers: servers.FileServer(tmp_path, bandwidth=8e6)) as served:
        seq = ShardSequence(f"{served.url}/web/index.json", decode, batch_size=2, num_workers=1,
                            seed=3, out_type="null", timeout=60, cache_dir=cache_dir,
                            start_method="fork")
        order = [ids.tolist() for ids in
                 ShardPlan(index, 2, shuffle=True, seed=3, shuffle_shards=8).batches(0)]
        with seq.start():
            got = []
            for batch in seq:
                got.append(np.asarray(batch)[:, 0].tolist())
                if len(got) == 1:
                    first = time.monotonic()
            stats = seq.stats
    assert got == order and sorted(sum(got, [])) == list(range(8))
    wholes = [r for r in served.log if r.method == "GET" and r.path.endswith(".tar")
              and r.sent > 4 * BIG]
    assert len(wholes) == 2 and first < min(r.ended for r in wholes), (first, wholes)
    assert stats.shard_early_reads >= 2
    assert 0 < stats.shard_early_bytes <= sum(ShardCache.EARLY_SHARE * (shard.end + TAR_TAIL)
                                              for shard in index.shards)


def test_a_rewritten_object_never_reaches_a_batch_through_an_early_read(tmp_path, cache_dir,
                                                                       ranged):
    """The objects rewritten after the index was made, with samples of the same sizes: the
    range requests of the first batch bring other bytes than the digests say, so no sample of
    them is used, and the shard's fetch refuses the object as stale."""
    index = write_shards(samples(2, 4, BIG), str(tmp_path / "web" / "b-%03d.tar"),
                         samples_per_shard=4)
    index.save(tmp_path / "web" / "index.json")
    write_shards(samples(2, 4, BIG, salt=7), str(tmp_path / "web" / "b-%03d.tar"),
                 samples_per_shard=4)
    with serving(lambda servers: servers.FileServer(tmp_path, bandwidth=8e6)) as served:
        seq = ShardSequence(f"{served.url}/web/index.json", decode, batch_size=2, num_workers=1,
                            seed=3, out_type="null", timeout=60, cache_dir=cache_dir,
                            start_method="fork")
        with seq.start():
            with pytest.raises(StaleShardError, match="no longer matches its index"):
                next(iter(seq))
            stats = seq.stats
    ranges = [r for r in served.log if r.method == "GET" and r.path.endswith(".tar")
              and r.sent <= 2 * (BIG + 1024)]
    assert ranges and stats.shard_early_reads == 0


def test_a_stalled_range_request_holds_the_batch_no_longer_than_its_shard(tmp_path, cache_dir,
                                                                           ranged):
    """A server that never answers a range request inside a shard (its whole fetches
    answered): the first batch comes with the whole shards, not after the request's timeout
    (20 s: a third of the sequence's), and finish() stops the stalled requests."""
    write_shards(samples(2, 4, BIG), str(tmp_path / "web" / "b-%03d.tar"), samples_per_shard=4)
    with serving(lambda _: RawServer(tmp_path, "stall-ranges", only=".tar")) as served:
        seq = ShardSequence(f"{served.url}/web/shards.json", decode, batch_size=2, num_workers=1,
                            seed=3, out_type="null", timeout=60, cache_dir=cache_dir,
                            start_method="fork")
        began = time.monotonic()
        with seq.start():
            got = [int(row[0]) for batch in seq for row in np.asarray(batch)]
        took = time.monotonic() - began
    assert sorted(got) == list(range(8))
    assert took < 10, took


def test_finish_does_not_wait_for_a_workers_fetches(tmp_path, cache_dir):
    """A shard of 32 MiB over a link of 8 MB/s: the first batch reads its first 2 MiB, and
    finish() comes while the worker's whole fetch of it has seconds to go. The worker stops
    that fetch as it leaves (``ShardWorker.worker_exit``): before, its exit waited for the
    fetch until the pool killed it (``JOIN_SECONDS``, 3 s, later)."""
    from shmseq.engine.trainer.worker_handle import JOIN_SECONDS
    write_shards(samples(1, 32, 1 << 20), str(tmp_path / "web" / "b-%03d.tar"),
                 samples_per_shard=32)
    with serving(lambda servers: servers.FileServer(tmp_path, bandwidth=8e6)) as served:
        seq = ShardSequence(f"{served.url}/web/shards.json", decode, batch_size=2, num_workers=1,
                            shuffle=False, out_type="null", timeout=60, cache_dir=cache_dir,
                            start_method="fork")
        seq.start()
        try:
            assert np.asarray(next(iter(seq)))[:, 0].tolist() == [0, 1]
        finally:
            began = time.monotonic()
            seq.finish()
            took = time.monotonic() - began
    assert took < JOIN_SECONDS - 1, took
