"""The node's shard cache as it lies on disk: its folder, what a run before left in it, its
budget and the room in it (``CacheStore``, which ``shmseq.shards.cache.ShardCache`` builds on to
open, fetch and check shards). Apart from the shards' traffic: this is the part every process
shares through the ledger, whatever it reads.

Its folder, ``<cache_dir>/shmseq-cache-<uid>/<job>/<digest of the data>/``, this user's alone
(made 0700, its files 0600, nothing followed through a link, nothing of another user's
trusted: ``shmseq.shards.files``)::

    ledger     one record per shard: absent, being fetched (its bytes reserved) or cached, the
               epoch it was fetched for, its bytes, the run that checked it and the version of
               its object; changed only under the file's flock
    shards/    the cached shards: ``<number>-<file name>``, renamed into place once whole
    locks/     a lock file per shard: whoever holds its flock is fetching that shard
    ranks/     a progress file per local rank, flocked by the rank for as long as it runs
    budget     the cache's budget, read by other caches of the user's; each sequence using
               the cache holds its shared flock
    session    the node's run: a shard checked against its index in it is not checked again

Eviction: only to make room, and only of a shard that no local rank's batches in flight read
(the plan says which batches read which shard; each rank publishes, for every shard, the batch
of this epoch or the next that reads it next, and how far its batches in flight reach). Of
those, the one the node reads latest goes first (one it reads in neither epoch before all): the
plan knows the future, so the cache keeps what comes soonest, the next epoch's first shards
among them, and gives up the room of what comes latest (Belady's rule), a shard read later in
this epoch included (kept for the whole epoch, such shards held the room the next batch
needed, which then waited for it forever). A prefetch takes only the room of shards read after
its own, and nothing is evicted for room that would still fall short. A rank whose progress
file nobody holds (finished, or dead) counts for nothing; with torchrun's ``LOCAL_WORLD_SIZE``
set, nothing is evicted until that many ranks are there. Prefetches leave room for a worker
waiting for one; a worker that finds no room waits for the ranks to move on, and says why after
half the sequence's timeout.

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
import os
import re
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np

from .. import remote
from ..remote import RemotePolicy
from .files import file_digest, open_private, open_private_file, private_folder, user_folder
from .ledger import (ABSENT, CACHED, FETCHING, WAIT_POLL_S, Ledger, RankBoard, evictable,
                     node_reads, read_epoch)
from .locks import is_held, lock, locked, unlock
from .place import cache_folder, caches_in_use, free_bytes, holders, in_use, remove_abandoned

if TYPE_CHECKING:
    from .index import ShardIndex


TAR_TAIL = 11 * 1024        # what a tar writer adds after the last member: 2 zero blocks, padding


class ShardCacheFull(OSError):
    """A shard found no room in the cache for longer than the wait allows: the message says
    what holds the room and what to do."""


class CacheCounters(remote.Counters):
    """What a process's cache calls did, until taken (``take``): shards fetched, their bytes
    and requests, shards fetched again for an epoch they had been fetched for already (evicted
    while still needed: 0 by design, counted as a check), bytes of samples read from cached
    shards, seconds readers waited for a shard, samples read before their shard was whole and
    the bytes of the range requests that read them (which the shard's fetch brings again), and
    the most the node's cache held (reserved bytes included). A copy sent to another process
    starts at zero: each counts its own, and the worker loop hands a worker's to the consumer
    with its batches."""

    FIELDS = ("shard_fetches", "shard_fetch_bytes", "shard_fetch_requests", "shard_refetches",
              "shard_repairs", "shard_read_bytes", "shard_wait_s", "shard_early_reads",
              "shard_early_bytes", "cache_peak_bytes")

    def __reduce__(self) -> tuple:
        return CacheCounters, ()

    def peak(self, cache_bytes: int) -> None:
        with self._lock:
            self._counts["cache_peak_bytes"] = max(self._counts["cache_peak_bytes"], cache_bytes)


class CacheStore:
    """The folder of the node's cache of one index's shards for one job (see the module's
    text): ``prepare`` it (what an earlier run left reconciled, the budget settled), reserve a
    shard's room (evicting what no rank needs), wait for room, and ``release`` it. Its
    shards are opened, fetched and checked by ``ShardCache``."""

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
        """Make the folders (this user's, 0700, checked: ``shmseq.shards.files``), keep what an
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
        with locked(os.path.join(self.root, "budgets.lock")):
            remove_abandoned(self.root, keep=self.folder)
            self._settle_budget(cached)
        return cached

    def held_bytes(self) -> int:
        """What the cache holds now (its shards, and the bytes reserved for those being fetched)."""
        return self.ledger.usage(self.ledger.table())

    def fetched_bytes(self) -> int:
        """The bytes the node fetched into the cache since it was made (every rank's and
        worker's fetches: the job's, where one job keeps one cache)."""
        return int(self.ledger.table()["got"].sum())

    def count_held(self) -> None:
        """Count what the cache holds now in ``cache_peak_bytes`` (a warm run fetches nothing,
        yet holds the data set): after a start, whose stats begin anew."""
        self.counters.peak(self.held_bytes())

    def _join_session(self) -> int:
        """The node's run, which marks a shard checked in it (under the ledger's lock): the
        first sequence to use the cache draws it, those that join while it is in use read it,
        and from here this one is in use too (its budget file's shared lock, to ``release()``)."""
        first = not in_use(self.folder)
        self.release()
        self._holding = lock(os.path.join(self.folder, "budget"), exclusive=False)
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
        others = [(folder, budget - used) for folder, budget, used in
                  caches_in_use(self.root, besides=self.folder)]
        promised = sum(max(left, 0) for _, left in others)
        available = max(free - promised, 0) + cached
        if self.budget is None or not self.budget_given:  # drawn (anew at each start)
            self.budget = int(min(self.estimates.sum(), available // 2))
        elif self.budget > available:
            raise ValueError(
                f"cache_bytes={self.budget:,} is more than the file system of the shard cache "
                f"{self.folder} can give: {free:,} bytes free, {cached:,} cached here already, and "
                f"{promised:,} promised to this user's other caches that are in use "
                f"({holders(self.root)}). Free space there, lower cache_bytes, or choose another "
                "cache_dir")
        fd = open_private(os.path.join(self.folder, "budget"), os.O_RDWR | os.O_CREAT)
        with os.fdopen(fd, "r+b") as file:
            file.write(np.int64(self.budget).tobytes())
            file.truncate()

    def release(self) -> None:
        """This sequence no longer uses the cache: its budget stops counting against others'."""
        if self._holding is not None:
            unlock(self._holding)
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
                if state[number] != CACHED:  # adopted, wanted for no epoch in particular
                    size = self.index.shards[number].size or 0  # one: checked in __init__
                    Ledger.move(table, number, CACHED, waiting=0, tag=-1, fetched=-1, bytes=size,
                                stamp=time.time_ns(), checked=self.session, version=0)
            else:
                Ledger.move(table, number, ABSENT, bytes=0)
                if number in found:
                    os.unlink(self.path(number))
        for number, path in parts:
            if not is_held(self._lock_path(number)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _whole(self, number: int) -> bool:
        """The cached file is this user's, not a link, and of its index's size."""
        with open_private_file(self.path(number)) as file:
            return os.fstat(file.fileno()).st_size == self.index.shards[number].size

    def _verified(self, number: int) -> bool:
        """The cached file's checksum is its index's."""
        with open_private_file(self.path(number)) as file:
            return file_digest(file)[1] == self.index.shards[number].sha256

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
        epochs = collections.Counter(table["tag"][cached].tolist())
        ranks = "; ".join(f"epoch {epoch}, done with {int((read_epoch(reads) > epoch).sum())} "
                          "shards of it" for epoch, _, reads in self.board.live())
        return (f"no room in the shard cache {self.folder} for shard "
                f"{self.index.shards[number].url} ({self.estimates[number]:,} bytes) for "
                f"{self.timeout / 2:g} s: its budget of {self.budget:,} bytes holds "
                f"{int(cached.sum())} shards ({self.ledger.usage(table):,} bytes with those being "
                f"fetched) wanted for epochs {dict(sorted(epochs.items()))}, which the node's ranks "
                f"({ranks or 'none'}) still need. Ranks far apart need more room: raise "
                "cache_bytes, or lower shuffle_shards")

    # -- room ---------------------------------------------------------------------------------------
    def _reserve(self, number: int, epoch: int | None, demand: bool, evict: bool = True) -> bool:
        """Reserve shard ``number``'s bytes, evicting what no rank needs if that makes room
        (unless not ``evict``). A prefetch also leaves room for the readers waiting and for one
        more shard; a reader that finds none is marked waiting. ``epoch`` None (a reader's: it
        does not know the epoch of its batch): the latest epoch any rank's batches in flight
        may reach."""
        size = int(self.estimates[number])
        assert self.budget is not None  # settled by prepare()
        with self.ledger.changing() as table:
            live = self.board.live()
            need = size
            if not demand and self.budget < self.estimates.sum():  # else all of it fits anyway
                others = table["waiting"].astype(bool)
                others[number] = False
                need += int(self.estimates[others].sum()) + int(self.estimates.max())
            if self.ledger.usage(table) + need > self.budget and evict:
                self._forget_the_dead(table)
                self._evict(table, live, self.ledger.usage(table) + need - self.budget,
                            keeping=None if demand else number)
            if self.ledger.usage(table) + need > self.budget:
                table["waiting"][number] = demand
                return False
            tag = epoch if epoch is not None else \
                max((int(read_epoch(reach)) for _, reach, _ in live), default=0)
            Ledger.move(table, number, FETCHING, waiting=0, tag=tag, bytes=size)
            self.counters.peak(self.ledger.usage(table))
        return True

    def _evict(self, table: np.ndarray, live: list, wanted: int, keeping: int | None = None) -> None:
        """Remove shards no rank's batches in flight read, those the node reads latest first
        (those it reads no more first of all: the plan tells the future), until ``wanted``
        bytes are free; none where they would not free as much. For a prefetch of shard
        ``keeping``: only those the node reads after it, since taking the room of a shard read
        sooner would fetch that one again before this one is read."""
        reads = node_reads(live, len(table))
        free = np.flatnonzero(evictable(table, live, self.board.expected()))
        if keeping is not None:
            free = free[reads[free] > reads[keeping]]
        order = free[np.lexsort((table["stamp"][free], -reads[free]))]
        enough = int(np.searchsorted(np.cumsum(table["bytes"][order]), wanted))
        if enough == len(order):
            return  # not room enough even so: nothing is lost for nothing
        for number in order[:enough + 1]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(number))  # a reader that has it open reads on
            Ledger.move(table, number, ABSENT, bytes=0)

    def _forget_the_dead(self, table: np.ndarray) -> None:
        """Reservations and waits of processes that died (their shard's lock is free)."""
        for number in np.flatnonzero((table["state"] == FETCHING) | (table["waiting"] != 0)):
            if not is_held(self._lock_path(number)):
                table["waiting"][number] = 0
                if table["state"][number] == FETCHING:
                    Ledger.move(table, number, ABSENT, bytes=0)

    def states(self) -> np.ndarray:
        """Every shard's state, as the ledger has them now (the prefetcher's look)."""
        return self.ledger.table()["state"].copy()

    def remove(self) -> None:
        """Delete the cache's folder (no rank of the job may be running on it)."""
        self.release()
        shutil.rmtree(self.folder, ignore_errors=True)


def estimated_bytes(index: ShardIndex) -> np.ndarray:
    """The most each shard of ``index`` takes in a cache: its samples and a tar writer's tail."""
    return np.array([shard.end + TAR_TAIL for shard in index.shards], np.int64)
