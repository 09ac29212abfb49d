"""ShardSequence end to end: tar shards written by write_shards, read by member offset, every
sample once per epoch, exact resume (without reading consumed samples again), worker restarts,
damaged shards raised or skipped, and shards served over HTTP. Nothing leaks (conftest)."""
import collections
import json
import os
import random
import re
import shutil
import tarfile

import numpy as np
import pytest

import shard_data as sd
from servers import server, web  # noqa: F401 - fixtures
import shmseq
import shmseq.shards
from shmseq import WorkerError
from shmseq.remote import RemotePolicy
from shmseq.shards import Shard, ShardError, ShardIndex, ShardPlan, ShardReader, ShardSequence

COUNT, PER_SHARD = 131, 23  # six shards: 5 x 23 and 16


def make(shards, decode=sd.decode, **options):
    options = {"batch_size": 8, "num_workers": 2, "seed": 3, "shuffle_window": 5, "out_type": "null",
               "timeout": 60, **options}
    return ShardSequence(shards, decode, **options)


def take(seq, count=None) -> list:
    """The next epoch's batches (its first ``count`` only) as lists of sample numbers, each
    sample checked against what was written. No batch is kept."""
    got = []
    for batch in seq:
        got.append(sd.consistent(batch))
        del batch
        if len(got) == count:
            break
    return got


def flat(batches) -> list:
    return [number for batch in batches for number in batch]


@pytest.fixture
def folder(tmp_path):
    sd.write(tmp_path / "shards", COUNT, PER_SHARD)
    return tmp_path / "shards"


@pytest.fixture
def index_file(folder):
    return str(folder / "shards.json")


def reference(index_file, epochs=2, **options) -> list:
    """Batches of ``epochs`` epochs, built in the calling thread."""
    with make(index_file, num_workers=0, **options).start() as seq:
        return [take(seq) for _ in range(epochs)]


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_once_per_epoch_decoded_and_in_the_plans_order(index_file, num_workers):
    with make(index_file, num_workers=num_workers).start() as seq:
        epochs = [take(seq) for _ in range(2)]
    for epoch, batches in enumerate(epochs):
        assert sorted(flat(batches)) == list(range(COUNT))
        assert [len(batch) for batch in batches] == [8] * 16 + [3]
        plan = ShardPlan(seq.worker.reader.index, 8, shuffle=True, seed=3, shuffle_window=5)
        assert batches == [ids.tolist() for ids in plan.batches(epoch)]  # ids are the numbers
    assert epochs[0] != epochs[1]
    assert flat(epochs[0]) != list(range(COUNT))
    assert epochs == reference(index_file)  # the same seed, the same stream, with any workers
    with make(index_file, num_workers=0, seed=4).start() as other:
        assert take(other) != epochs[0]


def test_shards_come_in_order_without_shuffle(index_file):
    with make(index_file, shuffle=False).start() as seq:
        epochs = [flat(take(seq)) for _ in range(2)]
    assert epochs == [list(range(COUNT))] * 2


def test_a_window_of_one_keeps_each_shard_whole_and_in_order(index_file):
    with make(index_file, num_workers=0, shuffle_window=1).start() as seq:
        order = flat(take(seq))
    shards = [number // PER_SHARD for number in order]
    runs = [shard for at, shard in enumerate(shards) if at == 0 or shards[at - 1] != shard]
    assert sorted(runs) == list(range(6)) and runs != list(range(6))  # whole shards, shuffled
    assert all(order[at] < order[at + 1] for at in range(COUNT - 1) if shards[at] == shards[at + 1])


def same_index(got: ShardIndex, expected: ShardIndex, urls=None) -> None:
    assert [shard.url for shard in got.shards] == (urls or [shard.url for shard in expected.shards])
    assert [shard.offsets.tolist() for shard in got.shards] == \
        [shard.offsets.tolist() for shard in expected.shards]
    assert [shard.end for shard in got.shards] == [shard.end for shard in expected.shards]
    assert got.starts.tolist() == expected.starts.tolist()


def test_scanning_the_written_shards_gives_the_written_index(tmp_path):
    written = sd.write(tmp_path / "a", COUNT, PER_SHARD)
    assert [len(shard) for shard in written.shards] == [23] * 5 + [16]
    scanned = ShardIndex.scan([shard.url for shard in written.shards])
    same_index(scanned, written)
    assert all(shard.end < os.path.getsize(shard.url) for shard in written.shards)  # tar's padding
    loaded = ShardIndex.load(str(tmp_path / "a" / "shards.json"))
    same_index(loaded, written)
    shard, ordinal = loaded.locate(np.array([0, 22, 23, 130]))
    assert shard.tolist() == [0, 0, 1, 5] and ordinal.tolist() == [0, 22, 0, 15]


def test_a_sequence_of_samples_is_written_by_several_processes_into_the_same_shards(tmp_path):
    serial = sd.write(tmp_path / "serial", COUNT, PER_SHARD)
    parallel = shmseq.shards.write_shards(sd.Samples(COUNT), str(tmp_path / "parallel" / "train-%03d.tar"),
                                          samples_per_shard=PER_SHARD, processes=3)
    same_index(parallel, serial, [shard.url.replace("serial", "parallel") for shard in serial.shards])
    for written, expected in zip(parallel.shards, serial.shards):
        with open(written.url, "rb") as got, open(expected.url, "rb") as wanted:
            assert got.read() == wanted.read()


def test_writing_and_scanning_show_progress_when_asked_and_not_otherwise(tmp_path, capsys):
    pytest.importorskip("tqdm")
    written = shmseq.shards.write_shards(sd.samples(COUNT), str(tmp_path / "a" / "t-%03d.tar"),
                                         samples_per_shard=PER_SHARD, progress=True)
    ShardIndex.scan([shard.url for shard in written.shards], progress=True)
    shown = capsys.readouterr().err
    assert f"{COUNT}/?" in shown or f"{COUNT}samples" in shown.replace(" ", "")
    assert "6/6" in shown  # the scan's shards
    shmseq.shards.write_shards(sd.Samples(COUNT), str(tmp_path / "b" / "t-%03d.tar"),
                               samples_per_shard=PER_SHARD)  # stderr is no terminal here
    ShardIndex.scan([shard.url for shard in written.shards])
    assert capsys.readouterr().err == ""


def test_a_saved_index_keeps_relative_paths_and_follows_its_folder(tmp_path, monkeypatch):
    written = sd.write(tmp_path / "a", COUNT, PER_SHARD)
    with open(tmp_path / "a" / "shards.json") as file:
        saved = json.load(file)
    assert [entry["url"] for entry in saved["shards"]] == [f"train-{n:03d}.tar" for n in range(6)]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.rename(tmp_path / "a", tmp_path / "moved")
    names = [f"train-{n:03d}.tar" for n in range(6)]
    for where in ("b", "moved"):
        loaded = ShardIndex.load(str(tmp_path / where / "shards.json"))
        same_index(loaded, written, [str(tmp_path / where / name) for name in names])
    monkeypatch.chdir(tmp_path)  # a relative index path: its shards relative to the same folder
    loaded = ShardIndex.load("b/shards.json")
    same_index(loaded, written, [os.path.join("b", name) for name in names])
    with make("b/shards.json", num_workers=2).start() as seq:
        assert sorted(flat(take(seq))) == list(range(COUNT))
    (tmp_path / "other").mkdir()
    loaded.save(tmp_path / "other" / "shards.json")  # shards outside its folder: absolute paths
    with open(tmp_path / "other" / "shards.json") as file:
        assert [entry["url"] for entry in json.load(file)["shards"]] == \
            [str(tmp_path / "b" / name) for name in names]
    same_index(ShardIndex.load("other/shards.json"), written, [str(tmp_path / "b" / name) for name in names])


# -- resume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("resumed_workers", [0, 1, 3])
def test_a_run_resumed_anywhere_continues_the_uninterrupted_stream(index_file, resumed_workers):
    expected = [batch for epoch in reference(index_file) for batch in epoch]  # 2 x 17 batches
    stops = random.Random(resumed_workers).sample(range(1, len(expected)), 3)
    for stop in sorted(stops) + [17]:  # and exactly between the epochs
        delivered = []
        with make(index_file, num_workers=2).start() as first:
            while len(delivered) < stop:
                delivered += take(first, stop - len(delivered))
            state = first.state_dict()
        # at the epoch's last batch, inside the loop: that epoch's end (its rest is empty)
        assert (state["epoch"], state["position"]) == ((0, 17) if stop == 17 else divmod(stop, 17))
        resumed = make(index_file, num_workers=resumed_workers)
        resumed.load_state_dict(state)
        with resumed.start():
            while len(delivered) < len(expected):
                delivered += take(resumed)
        assert delivered == expected, f"resumed after {stop} batches"


class RecordedFile:
    """A shard file that notes the bytes read from it in ``log``: (path, first, past the last)."""

    def __init__(self, file, url: str, log: list):
        self.file, self.url, self.log = file, url, log

    def seek(self, *args) -> int:
        return self.file.seek(*args)

    def read(self, size: int = -1) -> bytes:
        at = self.file.tell()
        data = self.file.read(size)
        self.log.append((self.url, at, at + len(data)))
        return data

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def test_a_resumed_run_reads_no_byte_of_the_samples_it_had_delivered(index_file, monkeypatch):
    reads = []
    opened = shmseq.shards.reader.open_url  # what the reader opens local shards with
    monkeypatch.setattr(shmseq.shards.reader, "open_url",
                        lambda url, options=None: RecordedFile(opened(url, options), url, reads))
    with make(index_file, num_workers=0).start() as first:
        delivered = flat(take(first, 5))  # 40 samples: a shard and part of another
        state = first.state_dict()
    resumed = make(index_file, num_workers=0)
    resumed.load_state_dict(state)
    del reads[:]
    with resumed.start():
        rest = flat(take(resumed))
    assert sorted(delivered + rest) == list(range(COUNT))
    index = resumed.worker.reader.index
    urls = [shard.url for shard in index.shards]
    spans = {int(index.starts[shard]) + ordinal: (shard, *index.shards[shard].span(ordinal))
             for shard in range(len(urls)) for ordinal in range(len(index.shards[shard]))}
    read_bytes = collections.Counter()
    for url, begin, end in reads:  # every byte read, by shard
        read_bytes.update((urls.index(url), byte) for byte in range(begin, end))
    rest_bytes = collections.Counter((spans[number][0], byte) for number in rest
                                     for byte in range(*spans[number][1:]))
    assert read_bytes == rest_bytes  # each byte of each sample left read once; nothing else
    partly = {number // PER_SHARD for number in delivered} & {number // PER_SHARD for number in rest}
    assert partly, "the run must stop inside a shard"
    for shard in partly:  # read from its first sample left, not from its start
        first_left = min(number for number in rest if number // PER_SHARD == shard)
        assert min(begin for url, begin, _ in reads if url == urls[shard]) == spans[first_left][1] > 0


# -- restarts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_killed_while_decoding_is_replaced_and_the_stream_is_unchanged(
        index_file, tmp_path, method):
    seq = make(index_file, sd.KillsOnce(tmp_path, 50), worker_restarts=1, start_method=method)
    with pytest.warns(RuntimeWarning, match="killed by signal SIGKILL .*a new worker takes its place"):
        with seq.start():
            got = [take(seq) for _ in range(2)]
    assert got == reference(index_file)
    assert seq.stats.restarts == 1 and os.path.exists(tmp_path / "killed-at-50")


# -- damaged shards -----------------------------------------------------------------------------
BAD_COUNT, BAD_PER_SHARD, BAD_BATCH = 66, 12, 11  # 5 x 12 and 6: no batch of 11 lies in 6 samples


def damage(kind: str, index: ShardIndex):
    """Damage the shards as ``kind`` says: (the decode to use, the sample numbers lost, the
    damaged shard's path, what a ShardError about it says: its key where known, the bytes)."""
    def header_of(number):
        shard = index.shards[number // BAD_PER_SHARD]
        return shard.url, int(shard.offsets[number % BAD_PER_SHARD])

    if kind == "truncated":  # cut inside the data of sample 31's second member
        url, at = header_of(31)
        assert len(sd.payload(31)) == 6
        os.truncate(url, at + 3 * 512 + 3)  # header, cls data, header, then 3 of bin's 6 bytes
        cut = [f"ends at byte {at + 3 * 512 + 3}, before the sample at byte "]
        return sd.decode, set(range(31, 36)), url, cut  # the sample: the first of 31-35 read
    if kind == "header":  # sample 41's first header: its key is unknown
        url, at = header_of(41)
        said = [f"the sample at byte {at}: no valid tar header at byte {at} "]
    elif kind == "member header":  # sample 41's second member's header
        url, at = header_of(41)
        said = [f"sample {sd.key(41)} at byte {at}: no valid tar header at byte {at + 1024} "]
        at += 1024
    if kind in ("header", "member header"):
        with open(url, "r+b") as file:
            file.seek(at + 100)
            file.write(b"#" * 56)  # mode, ids, size, mtime, checksum: no valid header
        return sd.decode, {41}, url, said
    if kind == "member size":  # sample 41's second header says its data runs past the sample
        url, at = header_of(41)
        with open(url, "r+b") as file:
            file.seek(at + 1024)
            info = tarfile.TarInfo.frombuf(file.read(512), "utf-8", "surrogateescape")
            info.size += 1024
            file.seek(at + 1024)
            file.write(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        return sd.decode, {41}, url, [f"member {sd.key(41)}.bin at byte {at + 1024} runs past "]
    if kind == "missing":  # the last shard's file, after indexing
        url = index.shards[5].url
        os.remove(url)
        return sd.decode, set(range(60, 66)), url, [f"shard {url} is missing"]
    assert kind == "undecodable"
    url, at = header_of(20)
    said = [f"sample {sd.key(20)} at byte {at} (members: cls, bin) does not decode: ValueError: "
            f"cannot decode {sd.key(20)} (on purpose)"]
    return sd.FailsOn({20}), {20}, url, said


KINDS = ["truncated", "header", "member header", "member size", "missing", "undecodable"]


@pytest.fixture
def bad_shards(tmp_path):
    index = sd.write(tmp_path / "bad", BAD_COUNT, BAD_PER_SHARD)
    return str(tmp_path / "bad" / "shards.json"), index


def damaged(kind, bad_shards, **options):
    index_file, index = bad_shards
    decode, lost, url, said = damage(kind, index)
    options = {"batch_size": BAD_BATCH, **options}
    return make(index_file, decode, **options), lost, url, said


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_shard_raises_a_shard_error_naming_the_shard_sample_and_offset(
        kind, num_workers, bad_shards):
    seq, lost, url, said = damaged(kind, bad_shards, num_workers=num_workers)
    delivered = []
    with pytest.raises(ShardError) as info:
        with seq.start():
            for _ in range(2):
                delivered += flat(take(seq))
    error = info.value
    assert type(error) is ShardError  # as raised in the worker, not a WorkerError
    message = str(error)
    assert message.startswith(f"shard {url}") and all(part in message for part in said), message
    if num_workers:  # raised in a worker process: rebuilt in the consumer, its record the cause
        assert isinstance(error.__cause__, WorkerError)
        assert error.__cause__.exc_type == "shmseq.shards.ShardError"
        assert "Worker traceback" in str(error.__cause__)
    elif kind == "undecodable":
        assert isinstance(error.__cause__, ValueError)  # the decode's own error
    elif kind == "missing":
        assert isinstance(error.__cause__, FileNotFoundError)
    assert not lost & set(delivered)
    assert len(delivered) == len(set(delivered))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_with_skip_a_damaged_sample_is_left_out_counted_and_warned(
        kind, num_workers, bad_shards):
    seq, lost, url, _ = damaged(kind, bad_shards, num_workers=num_workers, on_error="skip")
    with pytest.warns(shmseq.SkippedSamplesWarning) as caught:
        with seq.start():
            epochs = [take(seq) for _ in range(2)]
    for batches in epochs:
        counts = collections.Counter(flat(batches))
        assert set(counts) == set(range(BAD_COUNT)) - lost and set(counts.values()) == {1}
        assert len(batches) == BAD_COUNT // BAD_BATCH  # smaller batches, none dropped
    warned = [str(warning.message) for warning in caught]
    assert all(url in text for text in warned)  # each names the first sample's shard
    plan = ShardPlan(seq.worker.reader.index, BAD_BATCH, shuffle=True, seed=3, shuffle_window=5)
    told = collections.Counter()
    for text in warned:
        count, position, epoch = map(int, re.match(
            r"(\d+) sample\(s\) left out of .*?batch (\d+) of epoch (\d+): ", text).groups())
        assert count == len(lost & set(plan.batches(epoch)[position].tolist())), text
        told[epoch] += count
    assert told[0] == told[1] == len(lost)
    # Counted as batches are delivered, not as workers build them (ahead, into the next epoch).
    assert set(told) == {0, 1}
    assert seq.stats.skipped_samples == 2 * len(lost)


def test_a_truncated_shard_is_named_with_its_real_end_whichever_sample_is_read(bad_shards):
    _, index = bad_shards
    _, lost, url, _ = damage("truncated", index)
    shard = index.shards[2]
    cut, first_lost = os.path.getsize(url), int(shard.offsets[31 - 24])
    reader = ShardReader(index)
    try:
        assert [sample["__key__"] for sample in reader.read(np.arange(24, 31))] == \
            [sd.key(number) for number in range(24, 31)]
        for ids, named in (([29, 30, 31, 32], first_lost), ([33], int(shard.offsets[33 - 24]))):
            with pytest.raises(ShardError) as info:  # the read starts before the cut, or after
                reader.read(np.array(ids))
            assert str(info.value) == (
                f"shard {url} ends at byte {cut}, before the sample at byte {named} ends (byte "
                f"{shard.span(ids[-1] - 24)[1]}): the shard is truncated, or its index is stale")
    finally:
        reader.close()


def test_an_index_whose_sample_runs_past_the_shard_is_named_before_reading(bad_shards):
    """An index that says the last sample ends at byte 10**12 (stale, or corrupt): the read is
    checked against the shard's size, not allocated."""
    _, index = bad_shards
    shard = index.shards[1]
    stretched = ShardIndex([index.shards[0], Shard(shard.url, shard.offsets, 10 ** 12),
                            *index.shards[2:]])
    reader = ShardReader(stretched)
    try:
        with pytest.raises(ShardError) as info:
            reader.read(np.array([2 * BAD_PER_SHARD - 2, 2 * BAD_PER_SHARD - 1]))
    finally:
        reader.close()
    assert str(info.value) == (
        f"shard {shard.url} ends at byte {os.path.getsize(shard.url)}, before the sample at byte "
        f"{shard.offsets[-1]} ends (byte {10 ** 12}): the shard is truncated, or its index is "
        "stale")


def test_with_skip_a_batch_of_nothing_but_damaged_samples_still_fails(bad_shards):
    seq, lost, url, _ = damaged("missing", bad_shards, num_workers=0, on_error="skip",
                                batch_size=3, shuffle=False)
    delivered = []
    with pytest.raises(ShardError, match="every sample of the batch was left out") as info:
        with seq.start():
            for batch in seq:
                delivered += sd.consistent(batch)
                del batch
    assert f"shard {url} is missing" in str(info.value)
    assert delivered == list(range(60))


def test_on_error_must_be_raise_or_skip(index_file):
    with pytest.raises(ValueError, match="on_error must be one of 'raise', 'skip', got 'ignore'"):
        make(index_file, on_error="ignore")


# -- HTTP ---------------------------------------------------------------------------------------
def tar_gets(server) -> list:
    """(shard number, first byte asked) of each GET of a shard: asserts it asked for a range."""
    gets = []
    for request in server.log:
        if request.method == "GET" and request.path.endswith(".tar"):
            assert request.range is not None, f"{request.path} was fetched whole"
            gets.append((int(request.path[-7:-4]),
                         int(re.fullmatch(r"bytes=(\d+)-\d*", request.range)[1])))
    return gets


@pytest.mark.parametrize("method, num_workers", [("fork", 2), ("spawn", 2), (None, 0)])
def test_shards_over_http_are_read_by_range_every_sample_once(server, tmp_path, method,
                                                              num_workers):
    web = server.url
    sd.write(tmp_path / "web", COUNT, PER_SHARD)
    index = ShardIndex.load(f"{web}/web/shards.json")
    assert [shard.url for shard in index.shards] == [f"{web}/web/train-{n:03d}.tar" for n in range(6)]
    with make(index, num_workers=num_workers, start_method=method).start() as seq:
        epochs = [take(seq) for _ in range(2)]
    assert epochs == reference(str(tmp_path / "web" / "shards.json"))
    assert {shard for shard, _ in tar_gets(server)} == set(range(6))


def test_a_run_resumed_over_http_asks_for_no_byte_before_the_samples_left(server, tmp_path):
    """In the calling thread, nothing is read ahead: the requests are the epoch's rest's."""
    web = server.url
    local = sd.write(tmp_path / "web", COUNT, PER_SHARD)
    with make(str(tmp_path / "web" / "shards.json"), num_workers=0).start() as first:
        delivered = flat(take(first, 5))  # 40 samples: a shard and part of another
        state = first.state_dict()
    resumed = make(f"{web}/web/shards.json", num_workers=0)
    resumed.load_state_dict(state)
    with resumed.start():
        rest = flat(take(resumed))
    assert sorted(delivered + rest) == list(range(COUNT))
    gets = tar_gets(server)
    assert {shard for shard, _ in gets} == {number // PER_SHARD for number in rest}
    partly = {number // PER_SHARD for number in delivered} & {number // PER_SHARD for number in rest}
    assert partly, "the run must stop inside a shard"
    for shard in partly:  # read from its first sample left, not from its start
        first_left = min(number for number in rest if number // PER_SHARD == shard) % PER_SHARD
        assert min(begin for number, begin in gets if number == shard) == \
            local.shards[shard].offsets[first_left] > 0


def read_first_sample_of_shard(index: ShardIndex, number: int) -> ShardError:
    """The error that reading shard ``number``'s first sample raises (a failure that is retried
    is tried twice, 10 ms apart)."""
    reader = ShardReader(index, policy=RemotePolicy(attempts=2, backoff=0.01))
    try:
        with pytest.raises(ShardError) as info:
            reader.read(index.starts[number:number + 1])
    finally:
        reader.close()
    return info.value


def test_a_server_that_cannot_be_reached_is_named_with_its_url_and_the_cause(server, tmp_path):
    sd.write(tmp_path / "web", COUNT, PER_SHARD)
    index = ShardIndex.load(f"{server.url}/web/shards.json")
    server.stop()
    message = str(read_first_sample_of_shard(index, 1))
    assert message.startswith(f"shard {index.shards[1].url}: ") and "missing" not in message
    assert "the server could not be reached" in message, message
    assert message.count(index.shards[1].url) == 1, message  # named once
    assert "ConnectionRefusedError" in message, message


def test_a_shard_the_server_does_not_have_is_missing(web, tmp_path):
    sd.write(tmp_path / "web", COUNT, PER_SHARD)
    index = ShardIndex.load(f"{web}/web/shards.json")
    os.remove(tmp_path / "web" / "train-001.tar")
    assert str(read_first_sample_of_shard(index, 1)).startswith(
        f"shard {index.shards[1].url} is missing")


def test_an_index_over_http_is_fetched_without_starting_a_client_library(tmp_path, web):
    """A remote index is fetched as a shard is (one streamed GET), in a fresh process: no
    fsspec imported, whose HTTP client took 0.25-0.3 s to start before a loader's first batch."""
    import subprocess
    import sys
    sd.write(tmp_path / "shards", 20, 5)
    script = ("import sys\nfrom shmseq.shards import ShardIndex\n"
              f"index = ShardIndex.load({web + '/shards/shards.json'!r})\n"
              "print(len(index), 'fsspec' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["20", "False"], done.stderr
