"""The shard cache against what other users and unlucky days leave on a shared disk: a folder
made first by someone else, links planted where the cache's files go, a flipped byte in a cached
shard, an object rewritten at its URL, another data set at the same URLs, another endpoint,
budgets of several jobs at once, caches nobody will use again, a cache_dir shared with other
users, a job name that climbs out of its folder (issue 37).

Another user is staged by ownership (``os.chown`` to ``nobody``) where the tests run as root,
and with a same-user link or mode otherwise."""
from __future__ import annotations

import json
import os
import stat
import time
import shutil

import pytest

from shmseq.shards import store
from shmseq.shards import DamagedShardWarning, ShardCache, StaleShardError, UnsafeCacheError
from shmseq.shards.place import cache_folder, user_root
from shmseq.shards import ShardIndex, ShardSequence, write_shards
from servers import server, web  # noqa: F401 - the server fixtures
from test_shard_cache import (COUNT, PER_SHARD, SHARDS, cache_dir, data, epoch_of,  # noqa: F401
                              make, numbers, payload, tar_gets)

NOBODY = 65534
AS_ROOT = os.getuid() == 0


def staged_by_another_user(path: str) -> None:
    """Make ``path`` (and what is under it) another user's, as if they had made it: owned by
    ``nobody`` where the tests run as root; otherwise left this user's, writable by all."""
    for folder, folders, files in os.walk(path):
        for name in [folder, *(os.path.join(folder, entry) for entry in folders + files)]:
            os.chmod(name, 0o777)
            if AS_ROOT:
                os.chown(name, NOBODY, NOBODY)


def write_set(folder, first_id: int = 0) -> None:
    """The test's shards (ids from ``first_id``), at the same paths whatever ``first_id``."""
    samples = ({"__key__": f"s{i:05d}", "id": str(first_id + i), "bin": payload(first_id + i)}
               for i in range(COUNT))
    write_shards(samples, os.path.join(folder, "train-%03d.tar"), samples_per_shard=PER_SHARD)


def rewrite_in_place(tmp_path, number: int) -> None:
    """Shard ``number`` rewritten at its URL with other samples of the same size (the index
    left as it was), a second later than it was written."""
    other = tmp_path / "other"
    write_set(str(other), first_id=1)
    target = tmp_path / "web" / f"train-{number:03d}.tar"
    assert os.path.getsize(other / target.name) == os.path.getsize(target)
    shutil.copyfile(other / target.name, target)
    later = time.time() + 5
    os.utime(target, (later, later))


def shard_of(number: int) -> int:
    return number // PER_SHARD


# -- the folder and its files ---------------------------------------------------------------------
def test_a_cache_folder_another_user_made_first_is_refused(web, data, cache_dir):
    """The probe: another user made this user's predictable folder first (0777) and put a
    forged shard of the right size in it; the old cache adopted it and delivered its samples."""
    seq = make(web + data, cache_dir, num_workers=0)
    forged = os.path.join(seq.cache.folder, "shards")
    os.makedirs(forged)
    with open(seq.cache.path(0), "wb") as file:
        file.write(b"\0" * seq.cache.index.shards[0].size)
    staged_by_another_user(user_root(cache_dir))
    problem = "belongs to uid 65534" if AS_ROOT else "others may write to it"
    with pytest.raises(UnsafeCacheError, match=rf"{user_root(cache_dir)}.*{problem}.* Remove it"):
        seq.start()
    seq.finish()


def test_a_cache_dir_others_may_write_to_without_the_sticky_bit_is_refused(web, data, cache_dir):
    os.makedirs(cache_dir)
    os.chmod(cache_dir, 0o777)
    with pytest.raises(UnsafeCacheError, match="cache_dir is writable by others .* sticky bit"):
        make(web + data, cache_dir, num_workers=0).start()


def test_every_folder_is_made_0700_and_every_file_0600_whatever_the_umask(web, data, cache_dir):
    seq = make(web + data, cache_dir)
    old = os.umask(0)
    try:
        with seq.start():
            epoch_of(seq)
    finally:
        os.umask(old)
    modes = {}
    for folder, folders, files in os.walk(user_root(cache_dir)):
        modes[folder] = stat.S_IMODE(os.lstat(folder).st_mode)
        for name in files:
            modes[os.path.join(folder, name)] = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
    wrong = {path: f"{mode:o}" for path, mode in modes.items()
             if mode != (0o700 if os.path.isdir(path) else 0o600)}
    assert len(modes) > SHARDS and not wrong


@pytest.fixture
def used_once(web, data, cache_dir):
    """A cache that one run made and left (every shard cached), and a victim file outside it
    that a link planted in the cache points to."""
    seq = make(web + data, cache_dir, num_workers=0)
    with seq.start():
        epoch_of(seq)
    victim = os.path.join(os.path.dirname(cache_dir), "victim")
    with open(victim, "w") as file:
        file.write("the user's own file")
    return seq.cache.folder, victim


def test_a_link_in_place_of_the_ledgers_new_file_is_replaced_not_written_through(
        web, data, cache_dir, used_once):
    folder, victim = used_once
    os.unlink(os.path.join(folder, "ledger"))  # so that it is made again, through ledger.new
    os.symlink(victim, os.path.join(folder, "ledger.new"))
    seq = make(web + data, cache_dir, num_workers=0)
    with seq.start():
        assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert open(victim).read() == "the user's own file"
    assert stat.S_ISREG(os.lstat(os.path.join(folder, "ledger")).st_mode)


@pytest.mark.parametrize("planted", ["ranks/rank-0", "locks/000000", "shards/000000-train-000.tar"])
def test_a_link_planted_among_the_caches_files_is_refused_and_never_followed(
        web, data, cache_dir, used_once, planted):
    """A rank file, a lock and a shard replaced by links to the user's own file (the old cache
    truncated and overwrote it), and a lock by a dangling link (the old cache made a file at
    its end, outside the cache)."""
    folder, victim = used_once
    path = os.path.join(folder, planted)
    os.unlink(path)
    os.symlink(victim, path)
    dangling = os.path.join(os.path.dirname(cache_dir), "made-through-a-link")
    os.unlink(os.path.join(folder, "locks", "000001"))
    os.symlink(dangling, os.path.join(folder, "locks", "000001"))
    os.unlink(os.path.join(folder, "shards", "000001-train-001.tar"))  # fetched through its lock
    seq = make(web + data, cache_dir, num_workers=0)
    with pytest.raises(UnsafeCacheError, match=f"{folder}/.*: a symbolic link stands where the "
                                               "cache expects its own"):
        with seq.start():
            read_into(seq, [])
    seq.finish()
    assert open(victim).read() == "the user's own file" and not os.path.lexists(dangling)


# -- what is in a shard ---------------------------------------------------------------------------
def flip(path: str, at: int) -> None:
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["payload", "tar header"])
def test_a_damaged_cached_shard_is_fetched_again_once_and_said(server, web, data, cache_dir,
                                                                 used_once, where):
    """The old cache delivered a wrong sample for a flipped payload byte, and failed every run
    for a flipped header byte (a ShardError naming the URL, until the file was deleted)."""
    folder, _ = used_once
    seq = make(web + data, cache_dir, num_workers=0)
    shard = seq.cache.index.shards[3]
    first = int(shard.offsets[1])  # its members: the id's header and text, the payload's
    flip(seq.cache.path(3), first + (3 * 512 + 2 if where == "payload" else 100))
    before = tar_gets(server)
    with pytest.warns(DamagedShardWarning, match=r"cached copy .*000003-train-003.tar of shard "
                                                 r".*train-003.tar did not match its index"):
        with seq.start():
            assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert tar_gets(server) - before == {3: 1}
    assert seq.stats.shard_repairs == 1
    with seq.start():  # checked in the run before: once is enough, and nothing is fetched
        assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert tar_gets(server) - before == {3: 1}


def test_a_damaged_shard_is_repaired_by_worker_processes_too(server, web, data, cache_dir,
                                                               used_once):
    seq = make(web + data, cache_dir, num_workers=2)
    flip(seq.cache.path(5), int(seq.cache.index.shards[5].offsets[0]) + 600)
    before = tar_gets(server)
    with seq.start():
        assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert tar_gets(server) - before == {5: 1} and seq.stats.shard_repairs == 1


def read_into(seq, delivered: list[int]) -> None:
    """The epoch's sample numbers, as they come, into ``delivered`` (no batch kept, even by a
    traceback: a view of a slot would keep the ring mapped)."""
    for batch in seq:
        delivered += numbers(batch)
        del batch


def test_a_shard_rewritten_at_its_url_is_refused_naming_it(server, web, data, cache_dir, tmp_path,
                                                           used_once):
    """Same size, same index: the old cache served every old sample with no request. Now the
    object's version (its ETag, or here its time of change) says it changed; fetched again, it
    no longer matches its index, and no sample of it reaches a batch."""
    rewrite_in_place(tmp_path, 2)
    seq = make(web + data, cache_dir, num_workers=2)
    delivered: list[int] = []
    with pytest.raises(StaleShardError, match=r"shard .*/web/train-002.tar no longer matches its "
                                              r"index: [\d,]+ bytes with SHA-256 [0-9a-f]{64}, "
                                              r"where the index says .* scan the shards again"):
        with seq.start():
            read_into(seq, delivered)
    seq.finish()
    assert not [n for n in delivered if shard_of(n) == 2]


def test_a_shard_rewritten_mid_run_is_refused_when_fetched_again(server, web, data, cache_dir,
                                                                 tmp_path):
    """A budget that holds a few shards: the second epoch fetches them again; the old cache
    mixed old and new samples in it."""
    seq = make(web + data, cache_dir, shuffle_shards=2, buffer=2, cache_bytes=6 * 400_000,
               num_workers=0)
    with seq.start():
        epoch_of(seq)
        for number in range(SHARDS):
            rewrite_in_place(tmp_path, number)
        with pytest.raises(StaleShardError, match="train-0.*no longer matches its index"):
            read_into(seq, [])


def test_another_data_set_at_the_same_urls_gets_a_cache_of_its_own(server, web, data, cache_dir,
                                                                   tmp_path, used_once):
    """The old cache was named by the shards' URLs and ends: a new data set written at the
    same paths, run under the same job, got every sample of the old one."""
    write_set(str(tmp_path / "web"), first_id=10_000)
    seq = make(web + data, cache_dir, num_workers=0)
    assert seq.cache.folder != used_once[0]
    with seq.start():
        got = sorted(n for batch in epoch_of(seq) for n in batch)
    assert got == list(range(10_000, 10_000 + COUNT))


def test_the_same_keys_behind_another_endpoint_get_a_cache_of_their_own(tmp_path):
    write_set(str(tmp_path))
    index = ShardIndex.load(str(tmp_path / "shards.json"))
    folders = {cache_folder(index, str(tmp_path), "job", options) for options in (
        None, {"endpoint_url": "http://127.0.0.1:9000"}, {"endpoint_url": "http://127.0.0.1:9001"},
        {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9002"}})}
    assert len(folders) == 4


def test_an_index_without_checksums_is_refused_with_what_to_do(tmp_path, cache_dir):
    write_set(str(tmp_path))
    saved = json.loads((tmp_path / "shards.json").read_text())
    saved["version"] = 1
    for entry in saved["shards"]:
        del entry["size"], entry["sha256"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"no size and checksum for 12 shards .*"
                                         r"ShardIndex.scan\(urls\).save"):
        ShardSequence(str(tmp_path / "old.json"), lambda sample: 0, cache=True, cache_dir=cache_dir)
    in_place = ShardSequence(str(tmp_path / "old.json"), lambda sample: 0, batch_size=8,
                             out_type="null")
    assert len(in_place) == COUNT // 8


def test_scan_records_each_shards_size_and_checksum(tmp_path):
    write_set(str(tmp_path))
    written = ShardIndex.load(str(tmp_path / "shards.json"))
    scanned = ShardIndex.scan(sorted(str(path) for path in tmp_path.glob("*.tar")))
    assert [(s.size, s.sha256) for s in scanned.shards] == [(s.size, s.sha256) for s in written.shards]
    assert all(s.size == os.path.getsize(s.url) for s in written.shards)


# -- names -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", "."])
def test_a_job_name_cannot_leave_the_cache_folder(tmp_path, monkeypatch, name):
    write_set(str(tmp_path))
    index = ShardIndex.load(str(tmp_path / "shards.json"))
    with pytest.raises(ValueError, match="would name a folder outside the cache's"):
        cache_folder(index, str(tmp_path), name)
    monkeypatch.setenv("SLURM_JOB_ID", name)
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        cache_folder(index, str(tmp_path))


# -- room on the disk -------------------------------------------------------------------------------
def test_jobs_at_once_cannot_promise_more_than_the_disk_has(tmp_path, cache_dir, monkeypatch):
    """Each job took half of the free space: two at once took all of it, three ran out."""
    write_set(str(tmp_path))
    index = ShardIndex.load(str(tmp_path / "shards.json"))
    free = int(index.shards[0].size * SHARDS * 0.75)  # less than the data set
    monkeypatch.setattr(store, "free_bytes", lambda folder: free)
    caches = [ShardCache(index, cache_dir, f"job{n}") for n in range(3)]
    try:
        for cache in caches:
            cache.prepare()
        budgets = [cache.budget for cache in caches]
        assert sum(budgets) <= free and budgets[0] > budgets[1] > budgets[2] > 0
        with pytest.raises(ValueError, match=r"promised to this user's other caches that are in "
                                             r"use \(.*/job0/[0-9a-f]+: 0 bytes, in use"):
            ShardCache(index, cache_dir, "greedy", free // 2).prepare()
        caches[0].release()
        caches.append(ShardCache(index, cache_dir, "greedy", free // 4))
        caches[-1].prepare()  # job0's room is free again
    finally:
        for cache in caches:
            cache.remove()


def test_caches_of_finished_jobs_are_removed_by_age_whatever_their_name(web, data, cache_dir):
    """Caches named by SLURM_JOB_ID were never removed: each job left its own behind."""
    old = {}
    for job in ("1001", "1002"):
        seq = make(web + data, cache_dir, job=job, num_workers=0)
        with seq.start():
            epoch_of(seq)
        old[job] = seq.cache.folder
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(os.path.join(old["1001"], "ledger"), (two_days_ago, two_days_ago))
    with make(web + data, cache_dir, job="1003", num_workers=0).start():
        pass
    assert not os.path.exists(os.path.dirname(old["1001"])) and os.path.isdir(old["1002"])


def test_a_warm_rerun_counts_what_the_cache_holds(web, data, cache_dir, used_once):
    seq = make(web + data, cache_dir, num_workers=0)
    with seq.start():
        epoch_of(seq)
    held = sum(shard.size for shard in seq.cache.index.shards)
    assert seq.stats.cache_peak_bytes >= held and seq.stats.shard_fetches == 0
    assert seq.cache.held_bytes() == held


# -- a cache_dir shared with other users -----------------------------------------------------------
def test_a_shared_cache_dir_tolerates_other_users_folders_and_leaves_them_alone(web, data,
                                                                                  tmp_path):
    """cache_dir=/dev/shm, as the docs suggest: the old cache listed every folder in it, so
    another user's cache folder (0700) made start() fail with PermissionError, and, run by
    root, it removed another user's cache that looked abandoned. Now a cache looks only in its
    own user's folder."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    theirs = shared / "3fa85f64-5717-4562-b3fc-2c963f66afa6" / "0123456789abcdef"
    (theirs / "ranks").mkdir(parents=True)
    (theirs / "ledger").write_bytes(b"")
    day_ago = time.time() - 24 * 3600
    os.utime(theirs / "ledger", (day_ago, day_ago))
    for path in (theirs.parent, theirs, theirs / "ranks"):
        path.chmod(0o700)
    staged_by_another_user(str(theirs.parent))
    for path in (theirs.parent, theirs, theirs / "ranks"):
        path.chmod(0o700)
    seq = make(web + data, str(shared), num_workers=0)
    with seq.start():
        assert sorted(n for batch in epoch_of(seq) for n in batch) == list(range(COUNT))
    assert (theirs / "ledger").exists()
    assert seq.cache.folder.startswith(f"{shared}/shmseq-cache-{os.getuid()}/")
