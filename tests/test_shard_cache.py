"""The node's shard cache (shmseq.shard_cache) over a local HTTP server that counts requests:
each shard fetched whole, once per node per epoch, by local ranks sharing one cache; every
sample once; a budget smaller than the data kept (and one too small for the window refused at
start); a killed run resumed fetches only what is not cached; two jobs keep two caches. And the
shuffle measured in shards keeps the order's guarantees. Nothing leaks (conftest), and every
cache folder a test makes is removed by it."""
import collections
import fcntl
import json
import multiprocessing
import os
import re
import shutil
import signal
import time
import uuid

import numpy as np
import pytest
from hypothesis import given, settings

from shmseq.shard_cache import cache_folder, default_cache_dir, job_name
from shmseq.shards import ShardIndex, ShardPlan, ShardSequence, write_shards
from servers import PlainServer, server, serving, web  # noqa: F401 - the server fixtures
from test_shard_plan import index_of, plans as window_plans, rank_batches

SHARDS, PER_SHARD, PAYLOAD = 12, 24, 14000  # 288 samples, shards of 381 kB (+ up to 11 kB of tar)
COUNT = SHARDS * PER_SHARD


def payload(number: int) -> bytes:
    return bytes([number % 251]) * PAYLOAD


def decode(sample: dict) -> np.ndarray:
    """[number, payload length, payload sum]: ``numbers`` checks them against what was written."""
    data = sample["bin"]
    return np.array([int(sample["id"]), len(data), sum(data[:8])], np.int64)


def numbers(batch) -> list[int]:
    rows = np.asarray(batch).reshape(-1, 3).tolist()
    for number, size, total in rows:
        assert size == PAYLOAD and total == 8 * (number % 251), f"sample {number} is wrong"
    return [number for number, _, _ in rows]


@pytest.fixture
def data(tmp_path) -> str:
    """The shards under the server's folder; the index's URL path."""
    samples = ({"__key__": f"s{i:05d}", "id": str(i), "bin": payload(i)} for i in range(COUNT))
    write_shards(samples, str(tmp_path / "web" / "train-%03d.tar"), samples_per_shard=PER_SHARD)
    return "/web/shards.json"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache root for the test, removed after it: nothing goes to the default one, which is
    the test's own (``TMPDIR``), so that another job writing to the machine's cannot fail it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    default = default_cache_dir()
    root = tmp_path / "cache"
    yield str(root)
    assert not os.path.exists(default), f"a test wrote to the default cache root {default}"
    shutil.rmtree(root, ignore_errors=True)
    assert not root.exists()


def make(url, cache_dir, **options) -> ShardSequence:
    options = {"batch_size": 8, "num_workers": 2, "seed": 5, "out_type": "null", "timeout": 30,
               "start_method": "fork", "cache_dir": cache_dir, **options}
    return ShardSequence(url, decode, **options)


def epoch_of(seq) -> list[list[int]]:
    """The next epoch's batches as lists of sample numbers; no batch is kept."""
    got = []
    for batch in seq:
        got.append(numbers(batch))
        del batch
    return got


def epochs_of(seq, count: int = 2) -> list[list[list[int]]]:
    return [epoch_of(seq) for _ in range(count)]


def tar_gets(server) -> collections.Counter:
    """GET requests per shard number."""
    return collections.Counter(int(request.path[-7:-4]) for request in server.log
                               if request.method == "GET" and request.path.endswith(".tar"))


def tar_bytes(server) -> int:
    """Bytes of the shards the server sent."""
    return sum(request.sent for request in server.log if request.path.endswith(".tar"))


# -- one rank -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers, thread_type", [(2, "proc"), (2, "thread"), (0, "proc")])
def test_every_shard_is_fetched_once_and_every_sample_read_once(server, web, data, cache_dir,
                                                                num_workers, thread_type):
    seq = make(web + data, cache_dir, num_workers=num_workers, thread_type=thread_type)
    assert seq.cache is not None and (seq.shuffle_shards, seq.shuffle_window) == (8, None)
    with seq.start():
        epochs = epochs_of(seq)
    plan = ShardPlan(seq.worker.reader.index, 8, shuffle=True, seed=5, shuffle_shards=8)
    for epoch, batches in enumerate(epochs):
        assert batches == [ids.tolist() for ids in plan.batches(epoch)]  # ids are the numbers
        assert sorted(n for batch in batches for n in batch) == list(range(COUNT))
    assert tar_gets(server) == {shard: 1 for shard in range(SHARDS)}  # the budget holds all
    stats = seq.stats
    index = seq.worker.reader.index
    assert stats.shard_fetches == SHARDS and stats.shard_refetches == 0
    samples_bytes = sum(shard.end for shard in index.shards)
    assert samples_bytes < stats.shard_fetch_bytes == tar_bytes(server) <= 1.05 * samples_bytes
    assert stats.remote_bytes == stats.shard_fetch_bytes
    assert stats.shard_read_bytes >= 2 * samples_bytes  # 2 epochs (and batches built ahead)
    assert stats.read_amplification == stats.shard_fetch_bytes / stats.shard_read_bytes
    assert stats.shard_fetch_requests == stats.remote_requests == SHARDS  # its version: its answer's
    assert stats.cache_peak_bytes <= seq.cache.budget


def test_a_sequence_nobody_references_stops_its_prefetcher(web, data, cache_dir):
    """As any sequence, closed by its finalizer: no thread left (conftest), the rank left the
    board (a new sequence takes rank 0 at once)."""
    seq = make(web + data, cache_dir).start()
    batches = iter(seq)
    numbers(next(batches))
    del seq, batches
    again = make(web + data, cache_dir)
    with again.start():
        assert len(epoch_of(again)) == COUNT // 8


def test_finish_does_not_wait_for_the_fetches_ahead(server, web, data, cache_dir):
    """A server that holds every request for 30 s: ``finish()`` cancels the prefetcher's fetches
    in flight instead of waiting for them (it took 122 s, four fetches of 30 s in turn)."""
    index = ShardIndex.load(web + data)
    server.delay = 30.0  # cut short when the server stops
    seq = make(index, cache_dir, num_workers=0, slot_bytes=4096).start()
    while not any(request.path.endswith(".tar") for request in server.log):
        time.sleep(0.01)
    began = time.monotonic()
    seq.finish()
    assert time.monotonic() - began < 10
    assert not [name for name in os.listdir(seq.cache.folder) if name.endswith(".part")]


def test_local_shards_are_read_where_they_lie_unless_asked(tmp_path, data, cache_dir):
    index = str(tmp_path) + data
    seq = make(index, cache_dir=None)
    assert seq.cache is None and (seq.shuffle_window, seq.shuffle_shards) == (1000, None)
    with pytest.raises(ValueError, match=r"cache_bytes set the shard cache, which is off for "
                                         r"these shards \(local files\): pass cache=True"):
        make(index, cache_dir=None, cache_bytes=10 ** 6)
    with pytest.raises(ValueError, match="give one of them"):
        make(index, cache_dir=None, shuffle_window=10, shuffle_shards=2)
    cached = make(index, cache_dir, cache=True)  # a local path (on NFS, say) cached all the same
    with cached.start():
        assert sorted(n for batch in epoch_of(cached) for n in batch) == list(range(COUNT))
    assert cached.stats.shard_fetches == SHARDS


def test_a_window_of_samples_over_http_reads_by_range_without_the_cache(server, web, data,
                                                                       cache_dir):
    seq = make(web + data, cache_dir=None, shuffle_window=40)
    assert seq.cache is None
    with seq.start():
        assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert sum(tar_gets(server).values()) > SHARDS  # a request per run of samples


BIG_MEMBER = 10 << 20  # 4 of them: a shard larger than one request of a ranged fetch (32 MiB)


def big_decode(sample: dict) -> np.ndarray:
    """[number, payload length, its first and last byte] of a sample of ``BIG_MEMBER`` bytes."""
    data = sample["bin"]
    return np.array([int(sample["id"]), len(data), data[0], data[-1]], np.int64)


def test_a_shard_larger_than_a_fetch_request_is_cached_from_a_server_that_ignores_range(
        tmp_path, cache_dir):
    """``python -m http.server`` answers every request with the whole file: a 40 MiB shard
    (more than the 32 MiB one request of a ranged fetch asks for) is taken from that answer,
    streamed into the cache, checked, and every sample read from it, with one GET (beside it,
    at most one range request of the worker's for its first batch, refused unread)."""
    samples = ({"__key__": f"b{i}", "id": str(i), "bin": bytes([i + 1]) * BIG_MEMBER}
               for i in range(4))
    index = write_shards(samples, str(tmp_path / "web" / "big-%03d.tar"), samples_per_shard=4)
    assert len(index.shards) == 1 and index.shards[0].size > 32 << 20
    with serving(lambda _: PlainServer(tmp_path)) as served:
        seq = ShardSequence(f"{served.url}/web/shards.json", big_decode, batch_size=2,
                            num_workers=1, seed=0, out_type="null", timeout=30,
                            cache_dir=cache_dir)
        with seq.start():
            rows = [row for batch in seq for row in np.asarray(batch).tolist()]
    assert sorted(rows) == [[i, BIG_MEMBER, i + 1, i + 1] for i in range(4)]
    gets = [path for method, path, _ in served.log if method == "GET" and path.endswith(".tar")]
    assert gets in (["/web/big-000.tar"], ["/web/big-000.tar"] * 2)
    assert seq.stats.shard_fetches == 1 and seq.stats.shard_early_bytes == 0


# -- the budget ---------------------------------------------------------------------------------
def least_budget(url, cache_dir, **options) -> int:
    """What a budget too small is refused with, at start: the budget it says to give."""
    seq = make(url, cache_dir, cache_bytes=1, **options)
    with pytest.raises(ValueError) as info:
        seq.start()
    message = str(info.value)
    assert re.match(r"cache_bytes=1 is less than the shard cache needs: [\d,]+ bytes, the \d+ "
                    r"shards \([\d,]+ bytes\) that \d+ batches in a row read at most \(batch_size"
                    r"=8, buffer=2, num_workers=2, shuffle_shards=2\) and one more being fetched",
                    message), message
    return int(re.search(r"Pass cache_bytes >= ([\d,]+)", message)[1].replace(",", ""))


def test_a_budget_smaller_than_the_data_keeps_under_it_and_fetches_once_per_epoch(
        server, web, data, cache_dir):
    options = {"shuffle_shards": 2, "buffer": 2}
    budget = least_budget(web + data, cache_dir, **options)  # nothing started, nothing left
    seq = make(web + data, cache_dir, cache_bytes=budget, **options)
    assert budget <= seq.cache.estimates.sum() / 2  # the data is twice as large
    with seq.start():
        epochs = epochs_of(seq, 3)
    folder = os.path.join(seq.cache.folder, "shards")
    on_disk = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    for batches in epochs:
        assert sorted(n for batch in batches for n in batch) == list(range(COUNT))
    stats = seq.stats
    assert stats.cache_peak_bytes <= budget and on_disk <= budget
    assert stats.shard_refetches == 0  # no shard evicted while an epoch still needed it
    gets = tar_gets(server)
    print(f"budget {budget:,} of {seq.cache.estimates.sum():,} bytes: peak {stats.cache_peak_bytes:,}, "
          f"{stats.shard_fetches} fetches in 3 epochs, GETs per shard {sorted(gets.values())}")
    assert set(gets) == set(range(SHARDS)) and max(gets.values()) <= 4  # 3 epochs, and the next
    assert sum(gets.values()) >= stats.shard_fetches > 2 * SHARDS  # evicted, fetched again


def test_a_budget_larger_than_the_disk_is_refused(web, data, cache_dir):
    seq = make(web + data, cache_dir, cache_bytes=1 << 62)
    with pytest.raises(ValueError, match=r"cache_bytes=4,611,686,018,427,387,904 is more than "
                                         r"the file system of the shard cache .* can give: "):
        seq.start()


# -- ranks, jobs, crashes -------------------------------------------------------------------------
def run_rank(url, cache_dir, rank, epochs, out, options):
    """A local rank in a process of its own: its batches' numbers and stats, as JSON."""
    seq = make(url, cache_dir, rank=rank, world_size=2, **options)
    with seq.start():
        got = epochs_of(seq, epochs)
    with open(out, "w") as file:
        json.dump({"epochs": got, "stats": seq.stats.as_dict()}, file)


def run_ranks(url, cache_dir, tmp_path, epochs, **options) -> list[dict]:
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    ranks = [context.Process(target=run_rank, args=(url, cache_dir, rank, epochs, str(out), options))
             for rank, out in enumerate(outs)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.parametrize("budget", ["all", "least"])
def test_two_local_ranks_share_one_cache_and_fetch_each_shard_once(server, web, data, tmp_path,
                                                                   cache_dir, monkeypatch, budget):
    options = {"shuffle_shards": 2, "buffer": 2}
    if budget == "least":  # with room for little more than one rank's window
        options["cache_bytes"] = least_budget(web + data, cache_dir, **options) + 4 * 200_000
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun says: wait for both
    ranks = run_ranks(web + data, cache_dir, tmp_path, 2, **options)
    for epoch in range(2):
        seen = [n for rank in ranks for batch in rank["epochs"][epoch] for n in batch]
        assert sorted(seen) == list(range(COUNT))  # every sample once over the ranks
    stats = [rank["stats"] for rank in ranks]
    assert sum(s["shard_refetches"] for s in stats) == 0
    gets = tar_gets(server)  # stats miss a worker's fetch for a batch built ahead, never delivered
    assert sum(gets.values()) >= sum(s["shard_fetches"] for s in stats)
    if budget == "all":
        assert gets == {shard: 1 for shard in range(SHARDS)}  # once for the node
        read = sum(s["shard_read_bytes"] for s in stats)
        assert sum(s["shard_fetch_bytes"] for s in stats) / read * 2 <= 1.05
    else:
        assert max(s["cache_peak_bytes"] for s in stats) <= options["cache_bytes"]
        assert max(gets.values()) <= 3  # 2 epochs, and the next one's first shards


def test_two_jobs_on_one_node_keep_two_caches(server, web, data, cache_dir):
    runs = [make(web + data, cache_dir, job="a"), make(web + data, cache_dir, job="b")]
    assert runs[0].cache.folder != runs[1].cache.folder
    for seq in runs:
        with seq.start():
            assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert tar_gets(server) == {shard: 2 for shard in range(SHARDS)}
    again = make(web + data, cache_dir, job="a")  # job a once more: everything is cached
    with again.start():
        assert len(epoch_of(again)) == COUNT // 8
    assert again.stats.shard_fetches == 0 and tar_gets(server) == {shard: 2 for shard in range(SHARDS)}
    first, second = make(web + data, cache_dir), make(web + data, cache_dir)
    with first.start():
        with pytest.raises(ValueError, match=rf"has a rank 0 already, running in pid "
                                             rf"{os.getpid()}: .* give each its own job="):
            second.start()


def test_caches_of_launches_nobody_can_resume_are_removed_at_start(web, data, cache_dir):
    """torchrun --standalone names each launch anew (a random UUID): its cache, once no rank
    uses it and its ledger is old, is removed by the next cache to start under the same root.
    A cache in use (a rank on its board, or its ledger just touched by a job starting) and a
    named job's (which a resume finds again) are kept."""
    made = {}
    for name, job in [("abandoned", str(uuid.uuid4())), ("ranked", str(uuid.uuid4())),
                      ("starting", str(uuid.uuid4())), ("named", "nightly")]:
        seq = make(web + data, cache_dir, job=job, num_workers=0)
        with seq.start():
            epoch_of(seq)
        made[name] = seq.cache.folder
    hour_ago = time.time() - 3600
    for name in ("abandoned", "ranked", "named"):
        os.utime(os.path.join(made[name], "ledger"), (hour_ago, hour_ago))
    rank = os.open(os.path.join(made["ranked"], "ranks", "rank-0"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(rank, fcntl.LOCK_EX)  # a live rank of that job
        with make(web + data, cache_dir, num_workers=0).start():
            pass
    finally:
        os.close(rank)
    assert not os.path.exists(os.path.dirname(made["abandoned"]))
    assert all(os.path.isdir(made[name]) for name in ("ranked", "starting", "named"))


def test_the_job_is_named_by_the_launcher(monkeypatch):
    for variable in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    assert job_name() == "default" and job_name("mine") == "mine"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's when no id was given
    assert job_name() == "default"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3fa85f64")
    assert job_name() == "3fa85f64"
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert job_name() == "123456"
    index = index_of([3, 4])
    assert cache_folder(index, "/scratch", "run/7").startswith(
        f"/scratch/shmseq-cache-{os.getuid()}/run_7/")
    assert cache_folder(index, "/scratch") != cache_folder(index_of([4, 3]), "/scratch")
    with pytest.raises(ValueError, match="job must be a non-empty string"):
        job_name(" ")
    with pytest.raises(TypeError, match=r"job must be a string naming the job, got 7 \(int\)"):
        job_name(7)


def crash_after(url, cache_dir, steps, state_file, budget):
    """Deliver ``steps`` batches, save the state, and die by SIGKILL (fetches in flight)."""
    seq = make(url, cache_dir, shuffle_shards=2, buffer=2, cache_bytes=budget)
    with seq.start():
        batches = iter(seq)
        for _ in range(steps):
            next(batches)
        with open(state_file, "w") as file:
            json.dump(seq.state_dict(), file)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_run_resumed_fetches_only_the_shards_it_needs_that_are_not_cached(
        server, web, data, tmp_path, cache_dir):
    """The killed run's budget holds a few shards; the resumed one's all of them (so that
    each shard it fetches, it fetches once)."""
    state_file = tmp_path / "state.json"
    budget = least_budget(web + data, cache_dir, shuffle_shards=2, buffer=2)
    child = multiprocessing.get_context("fork").Process(
        target=crash_after, args=(web + data, cache_dir, 15, str(state_file), budget))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    state = json.loads(state_file.read_text())
    seq = make(web + data, cache_dir, shuffle_shards=2, buffer=2)
    seq.cache.prepare()  # what the killed run left: kept if whole, the rest removed
    cached = {number for number in range(SHARDS) if os.path.exists(seq.cache.path(number))}
    assert not [name for name in os.listdir(os.path.join(seq.cache.folder, "shards"))
                if name.endswith(".part")]
    before = tar_gets(server)
    assert cached <= set(before) and max(before.values()) == 1
    seq.load_state_dict(state)
    plan = ShardPlan(seq.worker.reader.index, 8, shuffle=True, seed=5, shuffle_shards=2)
    done = [n for ids in plan.batches(0)[:15] for n in ids.tolist()]
    with seq.start():
        rest = [n for batch in epoch_of(seq) for n in batch]
    assert sorted(done + rest) == list(range(COUNT))
    needed = set(seq.worker.reader.index.locate(np.array(rest))[0].tolist())
    assert needed - cached, "the run must die before it fetched all it needs"
    fetched = tar_gets(server) - before
    print(f"killed after 15 of {COUNT // 8} batches with {len(cached)} shards cached; the rest "
          f"of the epoch reads {len(needed)}: {sum(fetched[s] for s in needed)} fetched, "
          f"{len(needed & cached)} read from the cache, {sum(fetched.values())} fetches in all")
    assert {shard: fetched[shard] for shard in needed} == {s: int(s not in cached) for s in needed}
    assert max(fetched.values()) <= 1  # the others: the next epoch's, prefetched
    assert seq.stats.shard_refetches == 0


# -- the order: shuffle_shards ------------------------------------------------------------------
plans = window_plans.map(lambda case: {**case, "shuffle_shards": case["shuffle_window"] % 6 + 1})


@settings(max_examples=200, deadline=None)
@given(plans)
def test_shuffled_by_shards_every_sample_once_as_many_batches_and_the_steps_a_prefix(case):
    index = index_of(case["sizes"])
    total, ranks, size = len(index), case["world_size"], case["batch_size"]
    options = dict(shuffle=True, seed=case["seed"], shuffle_shards=case["shuffle_shards"])
    dealt = rank_batches(index, size, ranks, case["policy"], case["epoch"], **options)
    assert len({tuple(len(b) for b in batches) for batches in dealt}) == 1
    seen = collections.Counter(i for batches in dealt for batch in batches for i in batch)
    first = ShardPlan(index, size, **options).global_order(case["epoch"])
    assert sorted(first.tolist()) == list(range(total))
    if case["policy"] == "keep":
        assert set(seen) == set(range(total))
        steps = max(len(dealt[0]) - 1, 0)
        taken = sorted(i for batches in dealt for batch in batches[:steps] for i in batch)
        assert taken == sorted(np.resize(first, steps * size * ranks).tolist())
    else:
        assert max(seen.values(), default=1) == 1


@settings(max_examples=200, deadline=None)
@given(plans)
def test_the_stream_reads_shuffle_shards_shards_at_once_each_in_one_stretch(case):
    """At every point of the stream at most W shards are open (started, not finished): what
    the cache holds; with W=1, shard after shard."""
    index = index_of(case["sizes"])
    window = case["shuffle_shards"]
    order = ShardPlan(index, 1, shuffle=True, seed=case["seed"],
                      shuffle_shards=window).global_order(case["epoch"])
    shards = index.locate(order)[0]
    first = np.full(len(index.shards), len(order))
    last = np.full(len(index.shards), -1)
    np.minimum.at(first, shards, np.arange(len(order)))
    np.maximum.at(last, shards, np.arange(len(order)))
    read = last >= 0
    change = np.zeros(len(order) + 1, np.int64)
    np.add.at(change, first[read], 1)
    np.add.at(change, last[read] + 1, -1)
    open_shards = np.cumsum(change)[:len(order)]
    assert (open_shards <= window).all()
    if window == 1 and len(order):
        assert (np.diff(shards) != 0).sum() == read.sum() - 1


def test_a_state_says_how_the_shuffle_was_bounded(tmp_path, data, cache_dir):
    index = str(tmp_path) + data
    state = make(index, cache_dir=None, shuffle_shards=3).state_dict()
    assert (state["shuffle_shards"], state["shuffle_window"]) == (3, None)
    with pytest.raises(ValueError, match="state shuffle_window=None does not match this "
                                         "sequence's shuffle_window=1000"):
        make(index, cache_dir=None).load_state_dict(state)


def test_a_ledger_record_moves_only_along_the_caches_moves():
    """Every change of a shard's state goes through Ledger.move, which refuses a move the
    cache never makes (a fetch recorded for a shard nobody reserved, say)."""
    from shmseq.shards.ledger import ABSENT, CACHED, FETCHING, LEDGER_RECORD, MOVES, Ledger
    table = np.zeros(1, LEDGER_RECORD)
    for to in (FETCHING, CACHED, ABSENT, CACHED, ABSENT, FETCHING, ABSENT):
        Ledger.move(table, 0, to, bytes=7)
        assert table["state"][0] == to and table["bytes"][0] == 7
    Ledger.move(table, 0, ABSENT, bytes=0)  # staying is no move
    for start, to in [(ABSENT, ABSENT), (CACHED, FETCHING)]:
        table["state"][0] = start
        if (start, to) in MOVES or start == to:
            continue
        with pytest.raises(RuntimeError, match="cannot move from CACHED to FETCHING"):
            Ledger.move(table, 0, to)
        assert table["state"][0] == start


def test_a_batch_fetches_the_shards_the_cache_lacks_at_once(tmp_path, data, cache_dir):
    """A batch that reads 6 shards not cached fetches them together, not one after another as
    its samples come to them: with 0.3 s a request, their GETs overlap (one at a time before:
    a cold batch of 8 lanes waited for 8 fetches in a row)."""
    from shmseq.shards import ShardCache, ShardReader
    with serving(lambda servers: servers.FileServer(tmp_path, delay=0.3)) as slow:
        index = ShardIndex.load(slow.url + data)
        cache = ShardCache(index, cache_dir, "together")
        cache.prepare()
        reader = ShardReader(index, cache=cache)
        try:
            ids = index.starts[:6] + 3  # the fourth sample of each of 6 shards
            assert [int(row[0]) for row in map(decode, reader.read(ids))] == ids.tolist()
        finally:
            reader.close()
            cache.remove()
    gets = [r for r in slow.log if r.method == "GET" and r.path.endswith(".tar")]
    at_once = max(sum(other.began <= get.began < other.ended for other in gets) for get in gets)
    assert len(gets) == 6 and at_once >= 3, [(g.began, g.ended) for g in gets]
