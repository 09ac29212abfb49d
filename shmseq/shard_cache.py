"""The node's cache of remote shards: each shard fetched whole, once per node, into a folder on
local disk that every worker and every local rank of the job reads by offset.

Read where it lies, a remote sample costs a request, and a shuffled batch jumps between shards:
16.6x read amplification and 191 images/s over HTTP with 30 ms per request, against 43,730 from
local disk (issue #29). So a ``ShardSequence`` over remote shards fetches them whole, ahead of
need, in the order its plan reads them, and its workers read the local copies as they read local
files. Who does what:

* ``ShardCache``, in every process that reads (workers, and the consumer's prefetcher):
  ``open(number)`` is the cached shard as a local file; one that is not cached yet is fetched
  by the caller itself, under the shard's lock, so that nothing waits on the prefetcher's pace.
* ``Prefetcher``, a thread (and ``FETCH_THREADS`` fetching threads) in each rank's consumer
  process: it follows the consumer (``ShardPlan.on_release``), fetches the shards the rank's
  next batches read in the order they first read them, and publishes the rank's progress.
* ``RankBoard``: each local rank's progress, which eviction waits for.
* ``Ledger``: what the cache holds, in a file every process maps.

Its folder, ``<cache_dir>/shmseq-cache-<uid>/<job>/<digest of the data>/``, this user's alone
(made 0700, its files 0600, nothing followed through a link, nothing of another user's
trusted: ``shmseq.cache_files``)::

    ledger     one record per shard: absent, being fetched (its bytes reserved) or cached, the
               epoch it is kept for, its bytes, the run that checked it and the version of
               its object; changed only under the file's flock
    shards/    the cached shards: ``<number>-<file name>``, renamed into place once whole
    locks/     a lock file per shard: whoever holds its flock is fetching that shard
    ranks/     a progress file per local rank, flocked by the rank for as long as it runs
    budget     the cache's budget, read by other caches of the user's; each sequence using
               the cache holds its shared flock
    session    the node's run: a shard checked against its index in it is not checked again

Checked: a shard's bytes reach a batch only once they matched its index's size and SHA-256:
when fetched, and, for a shard a run before cached, once per run of the node's ranks (its
object's version asked again first: a rewritten object is fetched again, then refused if it no
longer matches its index; a damaged copy is fetched again, once, and said).

Lock protocol: a process that needs a shard not cached takes the shard's lock (workers wait
for it, the prefetcher skips a shard another process holds), looks again (the holder before it
may have fetched it), reserves its bytes in the ledger, and fetches it (``shmseq.remote.fetch``:
in ranges, each retried, under a temporary name renamed into place): one download per shard
per node. Locks are ``fcntl.flock`` on files,
released by the kernel when their process dies, so a crashed process leaves no lock behind;
a forked child lets go of its parent's (``os.register_at_fork``).

Eviction: only to make room, and only of a shard that no local rank needs any more in the
epoch it was fetched or claimed for (the ledger's ``tag``): every rank's consumer is past that
epoch, or in it and past the last batch that reads the shard (the plan says which batches read
which shard; each rank publishes, for its epoch, the shards its remaining batches no longer
read). A rank whose progress file nobody holds (finished, or dead) counts for nothing; with
torchrun's ``LOCAL_WORLD_SIZE`` set, nothing is evicted until that many ranks are there. A
shard cached from an earlier epoch is claimed for the next one as the prefetcher reaches it,
in order and only as far as it could fetch, so that what is kept is always what the ranks read
next. Prefetches leave room for a worker waiting for one; a worker that finds no room waits for
the ranks to move on, and says why after half the sequence's timeout.

The job: ``job=``, else ``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (set by torchrun; not
its "none"), else ``"default"``: two jobs on a node keep two caches, and a job resumed after a
crash finds its shards again. ``torchrun --standalone`` draws a new random id (a UUID) at every
launch, so its caches are never found again: a cache starting removes this user's caches that
nothing uses and whose ledger nobody changed for ``ABANDONED_AFTER_S`` (drawn ids) or
``FINISHED_AFTER_S`` (any other name): without it, every launch would leave up to half the disk
behind. Budgets add up: a default one is drawn from the free space less what this user's other
caches in use may still fill.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator

import numpy as np

from . import remote
from .cache_files import (check_folder, file_digest, inside, open_private, open_private_file,
                          private_folder, user_folder)
from .remote import RemotePolicy

if TYPE_CHECKING:
    from .shards import ShardIndex, ShardPlan

FETCH_THREADS = 4           # concurrent whole-shard fetches of one rank's prefetcher
TAR_TAIL = 11 * 1024        # what a tar writer adds after the last member: 2 zero blocks, padding
WAIT_POLL_S = 0.01          # how often a worker waiting for a shard or for room looks again
PREFETCH_POLL_S = 0.05      # how often the prefetcher looks again at what it could not start
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
DRAWN_JOB = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
ABANDONED_AFTER_S = 600     # a drawn job's cache with no live rank, its ledger untouched this long
FINISHED_AFTER_S = 24 * 3600  # any other job's: kept a day for a resume, then removed
ABSENT, FETCHING, CACHED = 0, 1, 2
BUSY, FULL = "busy", "full"  # why a prefetch did not start: another process fetches it; no room
LEDGER_RECORD = np.dtype([("state", "i1"), ("waiting", "i1"), ("tag", "<i4"), ("fetched", "<i4"),
                          ("bytes", "<i8"), ("stamp", "<i8"), ("checked", "<i8"),
                          ("version", "<i8")])
_RANK_HEADER = 24           # a progress file: the consumer's epoch, its owner's pid, the epoch its
                            # batches in flight may reach (int64 each), then one byte per shard:
                            # 1 where the rank's batches left in its epoch no longer read it


class ShardCacheFull(OSError):
    """A shard found no room in the cache for longer than the wait allows: the message says
    what holds the room and what to do."""


class StaleShardError(ValueError):
    """A shard fetched from its URL does not match its index's size or checksum: the object
    was rewritten (or the index is another data set's); nothing of it reaches a batch."""


class DamagedShardWarning(UserWarning):
    """A cached shard no longer matched its index's checksum (a bit flipped on disk, a file
    changed by hand): it was removed and fetched again."""


# -- locks ----------------------------------------------------------------------------------------
_held: set[int] = set()  # this process's lock descriptors, which a forked child must not keep


def _let_go_after_fork() -> None:
    """In a forked child: close the parent's lock descriptors, whose copies would otherwise
    keep the parent's locks held for as long as the child lives."""
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_let_go_after_fork)


def _lock(path: str, *, exclusive: bool = True, wait: bool = True) -> int | None:
    """A descriptor of ``path`` holding its flock; None if ``wait`` is False and it is held."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    _held.add(fd)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) |
                    (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        _unlock(fd)
        return None
    except BaseException:
        _unlock(fd)
        raise
    return fd


def _unlock(fd: int) -> None:
    _held.discard(fd)
    os.close(fd)  # the lock goes with the last descriptor of its open file


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """``path``'s flock, held for the block."""
    fd = _lock(path)
    assert fd is not None  # waited for
    try:
        yield
    finally:
        _unlock(fd)


def _is_held(path: str, *, shared: bool = False) -> bool:
    """Whether a live process holds ``path``'s lock (a dead one's is released by the kernel);
    ``shared``: a shared hold counts too."""
    fd = _lock(path, exclusive=shared, wait=False)
    if fd is not None:
        _unlock(fd)
    return fd is None


# -- where a cache lives --------------------------------------------------------------------------
def job_name(job: str | None = None) -> str:
    """The job a cache belongs to: ``job``, else the launcher's id of the run, else "default"."""
    if job is not None:
        if not isinstance(job, str):
            raise TypeError(f"job must be a string naming the job, got {job!r} "
                            f"({type(job).__name__})")
        if not job.strip():
            raise ValueError(f"job must be a non-empty string naming the job, got {job!r}")
        return job
    for variable in JOB_VARIABLES:
        value = os.environ.get(variable, "")
        if value and value != "none":  # torchrun's run id when none was given
            return value
    return "default"


def remove_abandoned(root: str, keep: str | None = None) -> list[str]:
    """Remove the caches in this user's folder ``root`` that nobody uses (no live rank, no
    live sequence) and whose ledger nobody changed for ``ABANDONED_AFTER_S`` (a job named by a
    drawn id, which no launch finds again) or ``FINISHED_AFTER_S`` (any other: time enough for
    a resume); never ``keep``. The folders removed. Only real folders are looked into: a link
    or a file in ``root`` is left alone."""
    removed = []
    for job in _folders(root):
        for folder in _folders(job.path):
            if folder.path != keep and _abandoned(folder.path, DRAWN_JOB.fullmatch(job.name)):
                shutil.rmtree(folder.path, ignore_errors=True)
                removed.append(folder.path)
        with contextlib.suppress(OSError):
            os.rmdir(job.path)  # if nothing is left in it
    return removed


def _folders(path: str) -> list[os.DirEntry]:
    """The folders in ``path``, links not followed (none where ``path`` is gone)."""
    try:
        with os.scandir(path) as entries:
            return [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _abandoned(folder: str, drawn: object) -> bool:
    """Unused, and its ledger older than a drawn job's or another job's age limit: a job
    starting, not on the board yet, has just touched it (``prepare``)."""
    try:
        changed = os.lstat(os.path.join(folder, "ledger")).st_mtime
    except FileNotFoundError:
        return False
    age = ABANDONED_AFTER_S if drawn else FINISHED_AFTER_S
    return time.time() - changed > age and not _in_use(folder)


def _in_use(folder: str) -> bool:
    """A live sequence holds the cache (its budget file), or a live rank its progress file."""
    ranks = os.path.join(folder, "ranks")
    try:
        names = [os.path.join(ranks, name) for name in os.listdir(ranks)]
    except FileNotFoundError:
        names = []
    paths = [os.path.join(folder, "budget"), *names]
    return any(os.path.lexists(path) and _is_held(path, shared=True) for path in paths)


def _bytes_in(folder: str) -> int:
    """What a cache's shards take on disk."""
    try:
        with os.scandir(os.path.join(folder, "shards")) as entries:
            return sum(entry.stat(follow_symlinks=False).st_size for entry in entries)
    except FileNotFoundError:
        return 0


def free_bytes(folder: str) -> int:
    """What the file system of ``folder`` has free for this user."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def default_cache_dir() -> str:
    """``$TMPDIR`` (a scheduler's node-local scratch) or else /var/tmp (on disk, where /tmp may
    be memory): the caches go into this user's folder in it (``shmseq.cache_files``)."""
    return os.environ.get("TMPDIR") or "/var/tmp"


def user_root(cache_dir: str | os.PathLike | None = None) -> str:
    """This user's folder of caches under ``cache_dir`` (the path only: ``prepare`` makes it)."""
    return os.path.join(os.path.abspath(os.fspath(cache_dir or default_cache_dir())),
                        f"shmseq-cache-{os.getuid()}")


def cache_folder(index: ShardIndex, cache_dir: str | os.PathLike | None = None,
                 job: str | None = None, storage_options: dict | None = None) -> str:
    """The folder of ``index``'s cache for ``job``: one per job and per data set, the data set
    named by what its bytes are (each shard's URL, size and checksum) and where they come from
    (an ``endpoint_url`` in ``storage_options``): another data set at the same URLs, or the
    same keys behind another endpoint, gets a cache of its own."""
    described = [_endpoint(storage_options)] + [
        f"{shard.url} {shard.end} {shard.size} {shard.sha256}" for shard in index.shards]
    digest = hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job_name(job))
    if name in (".", ".."):
        raise ValueError(f"the job name {job_name(job)!r} (from job=, SLURM_JOB_ID or "
                         "TORCHELASTIC_RUN_ID) would name a folder outside the cache's: pass "
                         "job= with a name of letters, digits, '.', '_' or '-'")
    return inside(inside(user_root(cache_dir), name), digest)


def _endpoint(storage_options: dict | None) -> str:
    """The endpoint the shards' URLs are resolved against, where the options name one."""
    options = storage_options or {}
    client = options.get("client_kwargs") or {}
    return f"endpoint {options.get('endpoint_url') or client.get('endpoint_url') or ''}"


# -- counts -------------------------------------------------------------------------------------
class CacheCounters(remote.Counters):
    """What a process's cache calls did, until taken (``take``): shards fetched, their bytes
    and requests, shards fetched again for an epoch they had been fetched for already (evicted
    while still needed: 0 by design, counted as a check), bytes of samples read from cached
    shards, seconds readers waited for a shard, and the most the node's cache held (reserved
    bytes included). A copy sent to another process starts at zero: each counts its own, and
    the worker loop hands a worker's to the consumer with its batches."""

    FIELDS = ("shard_fetches", "shard_fetch_bytes", "shard_fetch_requests", "shard_refetches",
              "shard_repairs", "shard_read_bytes", "shard_wait_s", "cache_peak_bytes")

    def __reduce__(self) -> tuple:
        return CacheCounters, ()

    def peak(self, cache_bytes: int) -> None:
        with self._lock:
            self._counts["cache_peak_bytes"] = max(self._counts["cache_peak_bytes"], cache_bytes)


# -- the record of what is cached -----------------------------------------------------------------
class Ledger:
    """One ``LEDGER_RECORD`` per shard in a file every process maps: ``state`` (ABSENT,
    FETCHING, CACHED), ``waiting`` (a reader waits for room for it), ``tag`` (the epoch it is
    kept for), ``fetched`` (the epoch it was last fetched for), ``bytes`` (cached, or reserved
    while fetching), ``stamp`` (when it came). Read
    freely (a look that may be stale, checked again under the lock); changed only in
    ``changing()``, under the file's flock."""

    def __init__(self, path: str, count: int) -> None:
        self.path = path
        self.count = count
        self._table: np.ndarray | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None, "_pid": None}

    def table(self) -> np.ndarray:
        """This process's mapping of the records (made on first use; a forked child's anew)."""
        if self._table is None or self._pid != os.getpid():
            if self._size() != self.nbytes:
                with self._locked():  # the first process here makes it; a wrong size is remade
                    if self._size() != self.nbytes:
                        self._make()
            with open_private_file(self.path, "r+b") as file:
                self._table = np.memmap(file, LEDGER_RECORD, "r+", shape=(self.count,))
            self._pid = os.getpid()
        return self._table

    def _size(self) -> int | None:
        try:
            return os.lstat(self.path).st_size
        except FileNotFoundError:
            return None

    def _make(self) -> None:
        """An empty ledger, written under a new name and renamed into place (what stands at
        the new name, a dead process's file or a link, is removed, never written through)."""
        empty = np.zeros(self.count, LEDGER_RECORD)
        empty["tag"] = empty["fetched"] = -1  # kept for, fetched for: none yet
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path + ".new")
        fd = open_private(self.path + ".new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as file:
            file.write(empty.tobytes())
        os.replace(self.path + ".new", self.path)

    @property
    def nbytes(self) -> int:
        return self.count * LEDGER_RECORD.itemsize

    @contextlib.contextmanager
    def changing(self) -> Iterator[np.ndarray]:
        """The records, to change: under the ledger's flock (held briefly, never while fetching)."""
        table = self.table()
        with self._locked():
            yield table

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return _locked(self.path + ".lock")

    def usage(self, table: np.ndarray) -> int:
        """Bytes the cache holds or has reserved."""
        return int(table["bytes"][table["state"] != ABSENT].sum())


# -- the local ranks' progress ---------------------------------------------------------------------
class RankBoard:
    """Each local rank's progress, one file each: the epoch its consumer is in and, of every
    shard, whether its batches left in that epoch read it no more. Eviction waits for every live
    rank; a rank holds its file's flock while it runs, so a file nobody holds is a finished or
    dead rank's and counts for nothing."""

    def __init__(self, folder: str, count: int) -> None:
        self.folder = folder
        self.count = count

    def path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}")

    def join(self, rank: int, epoch: int, ahead: int, done: np.ndarray) -> "RankProgress":
        """This process's place on the board as ``rank``, published at once; raises if a live
        process (another job's, or another sequence of this one's) holds that rank already."""
        deadline = time.monotonic() + 2.0  # a board reader holds a file for a moment only
        while (fd := _lock(self.path(rank), wait=False)) is None:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"the shard cache {os.path.dirname(self.folder)} has a rank {rank} already, "
                    f"running in pid {self._owner(rank)}: two jobs, or two sequences of one job "
                    "over the same shards, need caches of their own: give each its own job= "
                    "(or cache_dir=)")
            time.sleep(WAIT_POLL_S)
        progress = RankProgress(fd, self.count)
        progress.publish_ahead(ahead)
        progress.publish(epoch, done)
        return progress

    def _owner(self, rank: int) -> int | str:
        with contextlib.suppress(OSError), open_private_file(self.path(rank)) as file:
            return int(np.frombuffer(file.read(_RANK_HEADER), np.int64)[1])
        return "unknown"

    def live(self) -> list[tuple[int, int, np.ndarray]]:
        """(epoch, ahead, done) of every live rank."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.folder):
                path = os.path.join(self.folder, name)
                if not _is_held(path):
                    continue
                with open_private_file(path) as file:
                    data = file.read(_RANK_HEADER + self.count)
                    if len(data) == _RANK_HEADER + self.count:
                        epoch, _, ahead = np.frombuffer(data[:_RANK_HEADER], np.int64).tolist()
                        found.append((epoch, ahead,
                                      np.frombuffer(data, np.uint8, offset=_RANK_HEADER)))
        return found

    def expected(self) -> int:
        """How many local ranks the launcher started (torchrun's LOCAL_WORLD_SIZE), else 0."""
        value = os.environ.get("LOCAL_WORLD_SIZE", "")
        return int(value) if value.isdigit() else 0


class RankProgress:
    """A rank's own progress file, written in place: the shards' bytes, then the consumer's
    epoch, so that a reader who catches it half-written sees more kept, never less; and, on the
    consumer's thread before the batches it covers are dispatched, the epoch they may reach."""

    def __init__(self, fd: int, count: int) -> None:
        self.fd = fd
        self.count = count
        self._published: tuple | None = None
        self._ahead: int | None = None
        os.ftruncate(fd, _RANK_HEADER + count)
        os.pwrite(fd, np.array([-1, os.getpid(), -1], np.int64).tobytes(), 0)

    def publish(self, epoch: int, done: np.ndarray) -> None:
        if self._published is not None and self._published[0] == epoch and \
                np.array_equal(done, self._published[1]):
            return
        os.pwrite(self.fd, done.astype(np.uint8).tobytes(), _RANK_HEADER)
        os.pwrite(self.fd, np.int64(epoch).tobytes(), 0)
        self._published = epoch, done.copy()

    def publish_ahead(self, ahead: int) -> None:
        if ahead != self._ahead:
            os.pwrite(self.fd, np.int64(ahead).tobytes(), 16)
            self._ahead = ahead

    def leave(self) -> None:
        if self.fd >= 0:
            _unlock(self.fd)
            self.fd = -1


def evictable(table: np.ndarray, live: list[tuple[int, int, np.ndarray]], expected: int = 0) -> np.ndarray:
    """The cached shards no live rank needs any more in the epoch each is kept for."""
    tags = table["tag"]
    free = table["state"] == CACHED
    if len(live) < expected:  # ranks the launcher started are not on the board yet
        return np.zeros_like(free)
    for epoch, _, done in live:
        free &= (epoch > tags) | ((epoch == tags) & (done != 0))
    return free


# -- the cache ----------------------------------------------------------------------------------
class ShardCache:
    """The node's cache of one index's shards for one job (see the module's text): ``open`` a
    shard (fetched first by the caller if it is not cached), ``prefetch`` one (the prefetcher's
    way: it never waits), ``claim`` cached ones for a later epoch. Sent to every worker.

    Every shard is checked against its index's size and SHA-256 before its bytes reach a
    batch: once fetched, and once per run of the node's ranks when a run before cached it
    (``session``); so the index must have them (written by ``write_shards`` or scanned by
    ``ShardIndex.scan``: index version 2)."""

    def __init__(self, index: ShardIndex, cache_dir: str | os.PathLike | None = None,
                 job: str | None = None, budget: int | None = None, *,
                 storage_options: dict | None = None, policy: RemotePolicy | None = None,
                 timeout: float | None = None) -> None:
        unchecked = [shard.url for shard in index.shards if shard.sha256 is None or shard.size is None]
        if unchecked:
            raise ValueError(
                f"the shard index has no size and checksum for {len(unchecked)} shards (the first: "
                f"{unchecked[0]}), and the shard cache checks every shard against them: scan the "
                "shards again (ShardIndex.scan(urls).save('shards.json'), which reads each once), "
                "or read them in place with cache=False")
        self.index = index
        self.folder = cache_folder(index, cache_dir, job, storage_options)
        self.root = os.path.dirname(os.path.dirname(self.folder))
        self.budget = budget
        self.budget_given = budget is not None
        self.storage_options = storage_options
        self.policy = policy
        self.timeout = timeout  # a reader waits for room half of it, then says why
        self.counters = CacheCounters()
        self.ledger = Ledger(os.path.join(self.folder, "ledger"), len(index.shards))
        self.board = RankBoard(os.path.join(self.folder, "ranks"), len(index.shards))
        self.estimates = estimated_bytes(index)
        self.session = 0  # the node's run: a cached shard checked in it is not checked again
        self._holding: int | None = None  # the budget file's shared lock, while prepared
        self._unreachable = False  # a version could not be asked: none is asked again here

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_holding": None}

    def path(self, number: int) -> str:
        name = os.path.basename(self.index.shards[number].url.rstrip("/")) or "shard"
        return os.path.join(self.folder, "shards", f"{number:06d}-{re.sub(r'[^A-Za-z0-9._-]', '_', name)}")

    def _lock_path(self, number: int | np.integer) -> str:
        return os.path.join(self.folder, "locks", f"{number:06d}")

    # -- start: the folder, what a run before left, the budget ----------------------------------
    def prepare(self) -> int:
        """Make the folders (this user's, 0700, checked: ``shmseq.cache_files``), keep what an
        earlier run of the job cached (each shard checked against its index once in this run),
        drop what it left half-done, remove the caches nobody uses any more, and settle the
        budget (default: the whole data set, at most half of what the file system has free
        beside what this user's other live caches may still take); raises if it cannot hold
        it. The bytes cached. ``release()`` ends it."""
        user_folder(os.path.dirname(self.root))  # cache_dir checked, this user's folder made
        private_folder(os.path.dirname(self.folder))  # the job's
        for folder in (self.folder, *(os.path.join(self.folder, part) for part in
                                      ("shards", "locks", "ranks"))):
            private_folder(folder)
        with self.ledger.changing() as table:
            self.session = self._join_session()
            self._reconcile(table)
            cached = self.ledger.usage(table)
        os.utime(self.ledger.path, follow_symlinks=False)  # in use: see remove_abandoned
        with _locked(os.path.join(self.root, "budgets.lock")):
            remove_abandoned(self.root, keep=self.folder)
            self._settle_budget(cached)
        return cached

    def held_bytes(self) -> int:
        """What the cache holds now (its shards, and the bytes reserved for those being fetched)."""
        return self.ledger.usage(self.ledger.table())

    def count_held(self) -> None:
        """Count what the cache holds now in ``cache_peak_bytes`` (a warm run fetches nothing,
        yet holds the data set): after a start, whose stats begin anew."""
        self.counters.peak(self.held_bytes())

    def _join_session(self) -> int:
        """The node's run, which marks a shard checked in it (under the ledger's lock): the
        first sequence to use the cache draws it, those that join while it is in use read it,
        and from here this one is in use too (its budget file's shared lock, to ``release()``)."""
        first = not _in_use(self.folder)
        self.release()
        self._holding = _lock(os.path.join(self.folder, "budget"), exclusive=False)
        fd = open_private(os.path.join(self.folder, "session"), os.O_RDWR | os.O_CREAT)
        with os.fdopen(fd, "r+b") as file:
            known = file.read(8)
            if not first and len(known) == 8:
                return int(np.frombuffer(known, np.int64)[0])
            session = time.time_ns()
            file.seek(0)
            file.write(np.int64(session).tobytes())
            file.truncate()
        return session

    def _settle_budget(self, cached: int) -> None:
        """The budget, given or drawn from the free space less what this user's other live
        caches on the file system may still fill, written where those others read it."""
        free = free_bytes(self.folder)
        others = [(folder, budget - used) for folder, budget, used in self._other_caches()]
        promised = sum(max(left, 0) for _, left in others)
        available = max(free - promised, 0) + cached
        if self.budget is None or not self.budget_given:
            self.budget = int(min(self.estimates.sum(), available // 2))
        elif self.budget > available:
            raise ValueError(
                f"cache_bytes={self.budget:,} is more than the file system of the shard cache "
                f"{self.folder} can give: {free:,} bytes free, {cached:,} cached here already, and "
                f"{promised:,} promised to this user's other caches that are in use "
                f"({self.holders()}). Free space there, lower cache_bytes, or choose another "
                "cache_dir")
        fd = open_private(os.path.join(self.folder, "budget"), os.O_RDWR | os.O_CREAT)
        with os.fdopen(fd, "r+b") as file:
            file.write(np.int64(self.budget).tobytes())
            file.truncate()

    def _other_caches(self) -> list[tuple[str, int, int]]:
        """(folder, budget, bytes held) of this user's other caches in use on this file system."""
        found = []
        for job in _folders(self.root):
            for folder in _folders(job.path):
                if folder.path == self.folder or not _in_use(folder.path):
                    continue
                with contextlib.suppress(OSError, ValueError), \
                        open_private_file(os.path.join(folder.path, "budget")) as file:
                    budget = int(np.frombuffer(file.read(8), np.int64)[0])
                    found.append((folder.path, budget, _bytes_in(folder.path)))
        return found

    def holders(self) -> str:
        """What this user's caches on the file system hold, the largest first, for messages."""
        held = []
        for job in _folders(self.root):
            for folder in _folders(job.path):
                age = time.time() - os.lstat(folder.path).st_mtime
                state = "in use" if _in_use(folder.path) else f"unused for {age / 3600:.1f} h"
                held.append((_bytes_in(folder.path), f"{folder.path}: {_bytes_in(folder.path):,} "
                                                     f"bytes, {state}"))
        return "; ".join(text for _, text in sorted(held, reverse=True)) or "none"

    def release(self) -> None:
        """This sequence no longer uses the cache: its budget stops counting against others'."""
        if self._holding is not None:
            _unlock(self._holding)
            self._holding = None

    def _reconcile(self, table: np.ndarray) -> None:
        """The ledger made true to the files: a cached shard whose file is gone or of another
        size than its index says is dropped; a file the ledger does not know (its fetcher died
        between the rename and the record) is kept only if its checksum is the index's; what
        dead fetchers left (reservations, waits, partial files) goes. A link or a file of
        another user's among the shards is refused (``UnsafeCacheError``)."""
        folder = os.path.join(self.folder, "shards")
        found, parts = set(), []
        for name in os.listdir(folder):
            numbered = re.match(r"\.?(\d{6})-", name)
            path = os.path.join(folder, name)
            if numbered is None or int(numbered[1]) >= len(self.index.shards):
                continue
            if name.endswith(".part"):
                parts.append((int(numbered[1]), path))
            elif path == self.path(int(numbered[1])):
                found.add(int(numbered[1]))
        self._forget_the_dead(table)
        state = table["state"]
        for number in found | set(np.flatnonzero(state == CACHED).tolist()):
            if state[number] == FETCHING:
                continue  # its fetcher is alive: the file is an old one it will replace
            if number in found and self._whole(number) and (
                    state[number] == CACHED or self._verified(number)):
                if state[number] != CACHED:  # adopted, kept for no epoch in particular
                    table[number] = (CACHED, 0, -1, -1, self.index.shards[number].size,
                                     time.time_ns(), 0, 0)
            else:
                state[number], table["bytes"][number] = ABSENT, 0
                if number in found:
                    os.unlink(self.path(number))
        for number, path in parts:
            if not _is_held(self._lock_path(number)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _whole(self, number: int) -> bool:
        """The cached file is this user's, unlinked, and of its index's size."""
        with open_private_file(self.path(number)) as file:
            return os.fstat(file.fileno()).st_size == self.index.shards[number].size

    def _verified(self, number: int) -> bool:
        """The cached file's checksum is its index's."""
        with open_private_file(self.path(number)) as file:
            return file_digest(file)[1] == self.index.shards[number].sha256

    # -- readers ----------------------------------------------------------------------------------
    def open(self, number: int, counters: remote.Counters) -> BinaryIO:
        """Shard ``number`` as a local file, checked against its index. Not cached yet (or
        not checked in this run, or damaged): checked, or fetched, by this caller under the
        shard's lock (or, if another process is fetching it, once that one is done); its
        requests counted in ``counters``."""
        file = self._open_cached(number)
        if file is not None:
            return file
        began, since = time.perf_counter(), time.time_ns()
        fd = self._wait_for_lock(number)
        try:
            self._raise_failure_since(number, since)
            file = self._open_cached(number, repair=True)
            if file is None:
                self._wait_for_room(number)
                try:
                    self._fetch_reserved(number, None, counters)
                except OSError as failure:
                    self._record_failure(number, failure)
                    raise
                file = open_private_file(self.path(number))
        finally:
            _unlock(fd)
        self.counters.add(shard_wait_s=time.perf_counter() - began)
        return file

    def _failure_path(self, number: int) -> str:
        return os.path.join(self.folder, "locks", f"{number:06d}.failed")

    def _raise_failure_since(self, number: int, since: int) -> None:
        """Raise what failed another reader's fetch of the shard while this one waited for
        it (its lock held): each waiter trying again in turn would wait as long again, and a
        stalling server would outlast the batch's timeout before anyone said why. (A failed
        prefetch is not recorded: the reader who needs the shard tries it once itself.)"""
        try:
            with open_private_file(self._failure_path(number)) as file:
                if os.fstat(file.fileno()).st_mtime_ns >= since:
                    raise OSError(f"{file.read().decode(errors='replace')} (another reader's "
                                  "fetch of it, which this one waited for)")
        except FileNotFoundError:
            pass

    def _record_failure(self, number: int, failure: OSError) -> None:
        """What failed a reader's fetch, for those waiting for its lock (``_raise_failure_since``)."""
        fd = open_private(self._failure_path(number), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as file:
            file.write(remote.reason(failure, self.index.shards[number].url).encode())

    def _open_cached(self, number: int, repair: bool = False) -> BinaryIO | None:
        """The cached file, if it is there and checked against its index in this run.
        ``repair`` (under the shard's lock): one not checked yet is checked now, and one that
        does not match is removed, said (``DamagedShardWarning``) and counted, to be fetched
        again."""
        try:
            file = open_private_file(self.path(number))
        except FileNotFoundError:
            return None
        table = self.ledger.table()
        if table["state"][number] == CACHED and table["checked"][number] == self.session and \
                os.fstat(file.fileno()).st_size == self.index.shards[number].size:
            return file
        if not repair or table["state"][number] == FETCHING:
            file.close()
            return None
        version = self._version_if_known(number)
        if table["version"][number] not in (0, version or table["version"][number]):
            file.close()  # rewritten at its source: fetched again, and checked then
            self._drop(number)
            return None
        size, sha256 = file_digest(file)
        shard = self.index.shards[number]
        if size == shard.size and sha256 == shard.sha256:
            with self.ledger.changing() as table:
                if table["state"][number] == CACHED:
                    table["checked"][number] = self.session
                    table["version"][number] = version or table["version"][number]
            return file
        file.close()
        self._drop(number)
        self.counters.add(shard_repairs=1)
        warnings.warn(DamagedShardWarning(
            f"the cached copy {self.path(number)} of shard {shard.url} did not match its index "
            f"({size:,} bytes, SHA-256 {sha256[:16]}..., where the index says {shard.size:,} "
            f"bytes, {shard.sha256}): removed, and the shard is fetched again"), stacklevel=2)
        return None

    def _drop(self, number: int) -> None:
        """Remove a cached shard that cannot be trusted (its shard's lock held)."""
        with self.ledger.changing() as table:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(number))
            table["state"][number], table["bytes"][number] = ABSENT, 0

    def _version_if_known(self, number: int) -> int | None:
        """The shard's version, or None where its store cannot be asked (down, stalling): a
        cached copy that matches its index is then used as it is, said once per process, and
        no other shard's version is asked in this process (each ask may take a third of the
        sequence's timeout)."""
        if self._unreachable:
            return None
        try:
            return self._version(number, remote.Counters())
        except OSError as exc:
            self._unreachable = True
            warnings.warn(f"could not ask whether shard {self.index.shards[number].url} changed "
                          f"since it was cached ({exc}): cached shards that match their index "
                          "are used as they are", RuntimeWarning, stacklevel=3)
            return None

    def _version(self, number: int, counters: remote.Counters,
                 stop: threading.Event | None = None) -> int:
        """The shard's object as its store names this content of it (``remote.version``: its
        ETag, say), as a number for the ledger (never 0, which stands for none recorded)."""
        named = remote.version(self.index.shards[number].url, storage_options=self.storage_options,
                               counters=counters, policy=self.policy, stop=stop)
        return int.from_bytes(hashlib.sha256(named.encode()).digest()[:8], "little", signed=True) or 1

    def _wait_for_lock(self, number: int) -> int:
        while (fd := _lock(self._lock_path(number), wait=False)) is None:
            time.sleep(WAIT_POLL_S)  # another process fetches it: polled, so a thread can stop
        return fd

    def _wait_for_room(self, number: int) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout / 2
        while not self._reserve(number, None, demand=True):
            if deadline is not None and time.monotonic() > deadline:
                with self.ledger.changing() as table:
                    table["waiting"][number] = 0
                raise ShardCacheFull(self._no_room(number))
            time.sleep(WAIT_POLL_S * 5)

    def _no_room(self, number: int) -> str:
        assert self.timeout is not None and self.budget is not None  # waited for: prepared
        table = self.ledger.table()
        cached = table["state"] == CACHED
        kept = collections.Counter(table["tag"][cached].tolist())
        ranks = "; ".join(f"epoch {epoch}, done with {int((done != 0).sum())} shards of it"
                          for epoch, _, done in self.board.live())
        return (f"no room in the shard cache {self.folder} for shard "
                f"{self.index.shards[number].url} ({self.estimates[number]:,} bytes) for "
                f"{self.timeout / 2:g} s: its budget of {self.budget:,} bytes holds "
                f"{int(cached.sum())} shards ({self.ledger.usage(table):,} bytes with those being "
                f"fetched) kept for epochs {dict(sorted(kept.items()))}, which the node's ranks "
                f"({ranks or 'none'}) still need. Ranks far apart need more room: raise "
                "cache_bytes, or lower shuffle_shards")

    # -- the prefetcher ---------------------------------------------------------------------------
    def prefetch(self, number: int, epoch: int, counters: remote.Counters,
                 stop: threading.Event) -> Callable[[], None] | str:
        """The fetch of shard ``number`` for ``epoch``, ready to run (its lock held, its bytes
        reserved; ``stop`` ends it early, see ``remote.fetch``); or BUSY (another process
        fetches it) or FULL (no room now, without taking a waiting reader's or evicting what a
        rank still needs)."""
        fd = _lock(self._lock_path(number), wait=False)
        if fd is None:
            return BUSY
        try:
            file = self._open_cached(number, repair=True)
            if file is not None:  # fetched meanwhile
                file.close()
                self.claim(np.array([number]), np.array([epoch]))
                _unlock(fd)
                return BUSY
            if not self._reserve(number, epoch, demand=False):
                _unlock(fd)
                return FULL
        except BaseException:
            _unlock(fd)
            raise
        return functools.partial(self._fetch_holding, fd, number, epoch, counters, stop)

    def _fetch_holding(self, fd: int, number: int, epoch: int, counters: remote.Counters,
                       stop: threading.Event) -> None:
        try:
            self._fetch_reserved(number, epoch, counters, stop)
        finally:
            _unlock(fd)

    def claim(self, numbers: np.ndarray, epochs: np.ndarray) -> None:
        """Keep these cached shards for these epochs (a shard kept for an earlier one)."""
        if not len(numbers):
            return
        with self.ledger.changing() as table:
            cached = table["state"][numbers] == CACHED
            table["tag"][numbers[cached]] = np.maximum(table["tag"][numbers[cached]], epochs[cached])

    # -- room ---------------------------------------------------------------------------------------
    def _reserve(self, number: int, epoch: int | None, demand: bool) -> bool:
        """Reserve shard ``number``'s bytes, evicting what no rank needs if that makes room. A
        prefetch also leaves room for the readers waiting and for one more shard; a reader that
        finds none is marked waiting. ``epoch`` None (a reader's: it does not know the epoch of
        its batch): the latest epoch any rank's batches in flight may reach."""
        size = int(self.estimates[number])
        assert self.budget is not None  # settled by prepare()
        with self.ledger.changing() as table:
            live = self.board.live()
            need = size
            if not demand and self.budget < self.estimates.sum():  # else all of it fits anyway
                others = table["waiting"].astype(bool)
                others[number] = False
                need += int(self.estimates[others].sum()) + int(self.estimates.max())
            if self.ledger.usage(table) + need > self.budget:
                self._forget_the_dead(table)
                self._evict(table, live, self.ledger.usage(table) + need - self.budget)
            if self.ledger.usage(table) + need > self.budget:
                table["waiting"][number] = demand
                return False
            tag = epoch if epoch is not None else max((ahead for _, ahead, _ in live), default=0)
            table["state"][number], table["waiting"][number] = FETCHING, 0
            table["tag"][number], table["bytes"][number] = tag, size
            self.counters.peak(self.ledger.usage(table))
        return True

    def _evict(self, table: np.ndarray, live: list, wanted: int) -> None:
        """Remove shards no rank needs, those kept for the oldest epoch and fetched first
        first, until ``wanted`` bytes are free."""
        free = np.flatnonzero(evictable(table, live, self.board.expected()))
        for number in free[np.lexsort((table["stamp"][free], table["tag"][free]))]:
            if wanted <= 0:
                break
            wanted -= int(table["bytes"][number])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(number))  # a reader that has it open reads on
            table["state"][number], table["bytes"][number] = ABSENT, 0

    def _forget_the_dead(self, table: np.ndarray) -> None:
        """Reservations and waits of processes that died (their shard's lock is free)."""
        for number in np.flatnonzero((table["state"] == FETCHING) | (table["waiting"] != 0)):
            if not _is_held(self._lock_path(number)):
                table["waiting"][number] = 0
                if table["state"][number] == FETCHING:
                    table["state"][number], table["bytes"][number] = ABSENT, 0

    def _fetch_reserved(self, number: int, epoch: int | None, counters: remote.Counters,
                        stop: threading.Event | None = None) -> None:
        """Fetch shard ``number`` (its lock held, its bytes reserved) and record it cached."""
        these = remote.Counters()  # this fetch's own, then added to the reader's
        try:
            version = self._version(number, these, stop)  # asked first: a change while fetching shows
            size = remote.fetch(self.index.shards[number].url, self.path(number),
                                storage_options=self.storage_options, counters=these,
                                policy=self.policy, stop=stop)
            self._check_fetched(number)
        except BaseException:
            with self.ledger.changing() as table:
                table["state"][number], table["bytes"][number] = ABSENT, 0
            raise
        with self.ledger.changing() as table:
            tag = int(table["tag"][number]) if epoch is None else max(int(table["tag"][number]), epoch)
            again = int(table["fetched"][number] >= tag)
            table[number] = (CACHED, 0, tag, tag, size, time.time_ns(), self.session, version)
            self.counters.peak(self.ledger.usage(table))  # more than reserved, if the estimate was short
        took = these.take()
        counters.add(**took)
        self.counters.add(shard_fetches=1, shard_fetch_bytes=size,
                          shard_fetch_requests=took["requests"], shard_refetches=again)

    def _check_fetched(self, number: int) -> None:
        """Refuse a fetched shard that is not what its index says (removed: no reader sees it,
        since none trusts a shard the ledger does not record as checked)."""
        shard = self.index.shards[number]
        with open_private_file(self.path(number)) as file:
            size, sha256 = file_digest(file)
        if size != shard.size or sha256 != shard.sha256:
            os.unlink(self.path(number))
            raise StaleShardError(
                f"shard {shard.url} no longer matches its index: {size:,} bytes with SHA-256 "
                f"{sha256}, where the index says {shard.size:,} bytes, {shard.sha256}. The object "
                "was rewritten since the index was made: scan the shards again "
                "(ShardIndex.scan(urls).save(...)) and start from the new index")

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(state, tag) of every shard, as the ledger has them now (the prefetcher's look)."""
        table = self.ledger.table()
        return table["state"].copy(), table["tag"].copy()

    def remove(self) -> None:
        """Delete the cache's folder (no rank of the job may be running on it)."""
        self.release()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- which batches read which shard ---------------------------------------------------------------
class ShardUses:
    """For a rank's epoch, the first and last batch position that reads each shard (a shard
    not read: first past the end, last -1), from the plan; the last two epochs asked are kept."""

    def __init__(self, plan: ShardPlan, index: ShardIndex) -> None:
        self.plan = plan
        self.index = index
        self._known: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        key = (self.plan.version, self.plan.rank, self.plan.world_size, epoch)
        if key not in self._known:
            if len(self._known) >= 2:
                del self._known[next(iter(self._known))]
            batches = self.plan.batches(epoch)  # pure: safe beside the dispatcher's plan.batch
            count = len(self.index.shards)
            first, last = np.full(count, len(batches), np.int64), np.full(count, -1, np.int64)
            if batches:
                ids = np.concatenate(batches)
                positions = np.repeat(np.arange(len(batches)), [len(b) for b in batches])
                shards = self.index.locate(ids)[0]
                np.minimum.at(first, shards, positions)
                np.maximum.at(last, shards, positions)
            self._known[key] = first, last
        return self._known[key]

    def done(self, epoch: int, position: int) -> np.ndarray:
        """1 for every shard the batches from ``position`` on no longer read."""
        return (self.of(epoch)[1] < position).astype(np.uint8)

    def upcoming(self, epoch: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard, epoch) pairs the batches from ``position`` on read, in the order they first
        read them: the shards being read first, then this epoch's next, then the next epoch's."""
        first, last = self.of(epoch)
        left = np.flatnonzero(last >= position)
        now = left[np.argsort(np.maximum(first[left], position), kind="stable")]
        first, last = self.of(epoch + 1)
        used = np.flatnonzero(last >= 0)
        then = used[np.argsort(first[used], kind="stable")]
        return (np.concatenate([now, then]),
                np.concatenate([np.full(len(now), epoch), np.full(len(then), epoch + 1)]))

    def most_held(self, epoch: int, position: int, depth: int, sizes: np.ndarray) -> tuple[int, int]:
        """(bytes, shards) the cache must hold at once at most, from ``position`` of ``epoch``
        through the next epoch: a shard is held from ``depth`` batches before its first read
        (the batches in flight read it) to its last, once per epoch (in one stretch where its
        last read in this epoch and its first in the next are less than ``depth`` apart)."""
        length = self.plan.length(epoch) - position
        horizon = length + self.plan.length(epoch + 1)
        (first, last), (then_first, then_last) = self.of(epoch), self.of(epoch + 1)
        now, then = last >= position, then_last >= 0
        begin, end = np.maximum(first - position, 0), last - position
        then_begin, then_end = then_first + length, then_last + length
        joined = now & then & (then_begin - end <= depth)
        change = np.zeros(horizon + 1, np.int64)
        count = np.zeros(horizon + 1, np.int64)
        for held, start, stop in ((now, begin, np.where(joined, then_end, end)),
                                  (then & ~joined, then_begin, then_end)):
            low = np.clip(start[held] - depth + 1, 0, horizon)
            high = np.clip(stop[held] + 1, 0, horizon)
            for total, amount in ((change, sizes[held]), (count, np.ones(int(held.sum()), np.int64))):
                np.add.at(total, low, amount)
                np.add.at(total, high, -amount)
        if not horizon:
            return 0, 0
        held_bytes = np.cumsum(change)[:horizon]
        at = int(np.argmax(held_bytes))
        return int(held_bytes[at]), int(np.cumsum(count)[at])


def estimated_bytes(index: ShardIndex) -> np.ndarray:
    """The most each shard of ``index`` takes in a cache: its samples and a tar writer's tail."""
    return np.array([shard.end + TAR_TAIL for shard in index.shards], np.int64)


def room_needed(index: ShardIndex, plan: ShardPlan, epoch: int, position: int,
                depth: int) -> tuple[int, int, int]:
    """(need, held, shards): the bytes a cache of ``index``'s shards needs from ``position`` of
    ``epoch`` through the next epoch with ``depth`` batches in flight: the ``shards`` (``held``
    bytes) that ``depth`` batches in a row read at most, and one more being fetched; or the
    whole data set, where that is less."""
    sizes = estimated_bytes(index)
    held, shards = ShardUses(plan, index).most_held(epoch, position, depth, sizes)
    return min(held + int(sizes.max()), int(sizes.sum())), held, shards


def check_room(cache: ShardCache, plan: ShardPlan, epoch: int, position: int, depth: int,
               arguments: str) -> None:
    """Refuse a budget that cannot hold what ``depth`` batches in a row read, plus one shard
    being fetched: the ranks would wait for room forever."""
    assert cache.budget is not None  # settled by prepare()
    need, held, shards = room_needed(cache.index, plan, epoch, position, depth)
    if cache.budget < need:
        given = "" if cache.budget_given else " (the default: half the free space there)"
        raise ValueError(
            f"cache_bytes={cache.budget:,}{given} is less than the shard cache needs: {need:,} bytes, "
            f"the {shards} shards ({held:,} bytes) that {depth} batches in a row read at most "
            f"({arguments}) and one more being fetched ({int(cache.estimates.max()):,} bytes). "
            f"Pass cache_bytes >= {need:,}, or read fewer shards at once: a smaller "
            "shuffle_shards, batch_size or buffer")


# -- the prefetcher -----------------------------------------------------------------------------
class Prefetcher:
    """In a rank's consumer process: follows the consumer (``ShardPlan.on_release``), publishes
    the rank's progress, and fetches the shards its next batches read, in the order they first
    read them, ``FETCH_THREADS`` at a time, as far as the budget allows: the shards of this
    epoch first, then the next one's. A shard another process is fetching is skipped; one whose
    fetch failed is left to the workers for the rest of the run (they say why, and a stalling
    server is not waited for again on their behalf).

    Made before the workers start (it joins the rank board: their first fetches are then
    kept for the right epoch), ``start()`` after; ``close()`` stops the fetches started (their
    requests cancelled: a slow or failing server does not hold up ``finish()``).
    ``depth``: how many batches past the consumer's may be in flight (built by the workers);
    ``counters``: where its fetches' remote requests are counted."""

    def __init__(self, cache: ShardCache, plan: ShardPlan, epoch: int, position: int, depth: int,
                 counters: remote.Counters) -> None:
        self.cache = cache
        self.counters = counters
        self.uses = ShardUses(plan, cache.index)
        self._plan = plan
        self._owner = os.getpid()
        self._place = (epoch, position)
        self._moved = threading.Condition()
        self._news = True         # the consumer moved, or a fetch ended: look again
        self._stopping = False
        self._stop = threading.Event()  # set by close(): the fetches in flight end early
        self._fetching: dict[tuple[int, int], Future] = {}  # (shard, epoch) -> its fetch
        self._failed: set[int] = set()  # shards whose fetch failed: the workers' from then on
        self._depth = depth
        plan.refresh()
        self._progress = cache.board.join(plan.rank, epoch, self._ahead(epoch, position),
                                          self.uses.done(epoch, position))
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shmseq-fetch")
        self._thread = threading.Thread(target=self._run, name="shmseq-prefetch", daemon=True)

    def start(self) -> "Prefetcher":
        self._plan.on_release = self.moved
        self._thread.start()
        return self

    def moved(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position`` (on its thread: the
        epoch the batches to dispatch next may reach is published here, before they are)."""
        self._progress.publish_ahead(self._ahead(epoch, position))
        self._tell(place=(epoch, position))

    def _fetch_ended(self, _: Future) -> None:
        self._tell()

    def _tell(self, place: tuple[int, int] | None = None) -> None:
        with self._moved:
            self._place = place or self._place
            self._news = True
            self._moved.notify()

    def _run(self) -> None:
        waiting = False
        while True:
            with self._moved:
                while not (self._news or self._stopping):
                    if not self._moved.wait(PREFETCH_POLL_S if waiting else None):
                        break  # time to look again at what others were doing
                if self._stopping:
                    return
                self._news, place = False, self._place
            self._progress.publish(place[0], self.uses.done(*place))
            waiting = self._fetch_ahead(*place)

    def _ahead(self, epoch: int, position: int) -> int:
        """The epoch the batches in flight may reach: ``depth`` batches past the consumer."""
        return epoch + int(position + self._depth > self._plan.length(epoch))

    def _fetch_ahead(self, epoch: int, position: int) -> bool:
        """Start what can start, claim the cached shards before the first that cannot (no room
        for it, or another process waits for room for it): what is kept is always what is read
        next. True while something is left for others to finish (a fetch, room)."""
        for key, future in list(self._fetching.items()):
            if future.done():
                del self._fetching[key]
                if future.exception() is not None:
                    self._failed.add(key[0])
        shards, epochs = self.uses.upcoming(epoch, position)
        state, tags = self.cache.snapshot()
        cached = state[shards] == CACHED
        stop: int | np.integer
        stop, waiting = len(shards), False
        fetching = {number for number, _ in self._fetching}
        for at in np.flatnonzero(~cached):
            key = number, wanted = int(shards[at]), int(epochs[at])
            if number in fetching or number in self._failed:
                continue
            if len(self._fetching) >= FETCH_THREADS:
                stop = at
                break
            try:
                started = self.cache.prefetch(number, wanted, self.counters, self._stop)
            except Exception:  # noqa: BLE001 - left to the workers, whose batch says why
                self._failed.add(number)
                continue
            if started is BUSY and state[number] == FETCHING:  # its room is reserved
                waiting = True
                continue
            if started is not BUSY and started is not FULL:
                assert callable(started)  # a fetch, not one of the two words
                self._fetching[key] = self._pool.submit(started)
                self._fetching[key].add_done_callback(self._fetch_ended)
                fetching.add(number)
                continue
            # no room, or its fetcher waits for room: what comes after it must not take the room
            stop, waiting = at, True
            break
        claim = cached[:stop] & (tags[shards[:stop]] < epochs[:stop])
        self.cache.claim(shards[:stop][claim], epochs[:stop][claim])
        return waiting

    def close(self) -> None:
        """Stop the fetches in flight and leave the board."""
        if os.getpid() != self._owner:
            return  # a forked child's copy: the thread and the board are the parent's
        self._stop.set()
        with self._moved:
            self._stopping = True
            self._moved.notify()
        if self._thread.ident is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)
        if self._plan.on_release == self.moved:
            self._plan.on_release = None
        self._progress.leave()
