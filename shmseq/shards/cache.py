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

Its folder, what a run before left in it, its budget, the room in it and eviction are
``shmseq.shards.store``'s (``CacheStore``, which ``ShardCache`` builds on); the names moved
there stay importable from here.

Checked: a shard's bytes reach a batch only once they matched its index's size and SHA-256
(or, read before the shard is whole, each sample's digest):
when fetched, and, for a shard a run before cached, once per run of the node's ranks (its
object's version asked again first: a rewritten object is fetched again, then refused if it no
longer matches its index; a damaged copy is fetched again, once, and said).

Lock protocol: a process that needs a shard not cached takes the shard's lock (workers wait
for it, the prefetcher skips a shard another process holds), looks again (the holder before it
may have fetched it), reserves its bytes in the ledger, and fetches it (``shmseq.remote.fetch``:
in ranges, each retried, into ``part_path`` renamed into place; readers may read what has come
there, checked against the samples' digests: ``shmseq.shards.early``): one download per shard
per node. Locks are ``fcntl.flock`` on files,
released by the kernel when their process dies, so a crashed process leaves no lock behind;
a forked child lets go of its parent's (``os.register_at_fork``).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import time
import warnings
from typing import BinaryIO, Callable

from .. import remote
from .files import file_digest, open_private, open_private_file
from .ledger import ABSENT, CACHED, FETCHING, WAIT_POLL_S, Ledger
from .locks import lock, unlock
from .store import TAR_TAIL, CacheCounters, CacheStore, ShardCacheFull, estimated_bytes

__all__ = ["BUSY", "FULL", "TAR_TAIL", "CacheCounters", "CacheStore", "DamagedShardWarning",
           "ShardCache", "ShardCacheFull", "StaleShardError", "estimated_bytes"]

BUSY, FULL = "busy", "full"  # why a prefetch did not start: another process fetches it; no room


class StaleShardError(ValueError):
    """A shard fetched from its URL does not match its index's size or checksum: the object
    was rewritten (or the index is another data set's); nothing of it reaches a batch."""


class DamagedShardWarning(UserWarning):
    """A cached shard no longer matched its index's checksum (a bit flipped on disk, a file
    changed by hand): it was removed and fetched again."""


def version_number(named: str) -> int:
    """An object's ``remote.version`` as a number for the ledger (never 0: none recorded)."""
    return int.from_bytes(hashlib.sha256(named.encode()).digest()[:8], "little", signed=True) or 1


class ShardCache(CacheStore):
    """The node's cache of one index's shards for one job (see the module's text): ``open`` a
    shard (fetched first by the caller if it is not cached), ``prefetch`` one (the prefetcher's
    way: it never waits). Sent to every worker.

    Every shard is checked against its index's size and SHA-256 before its bytes reach a
    batch: once fetched, and once per run of the node's ranks when a run before cached it
    (``session``); so the index must have them (written by ``write_shards`` or scanned by
    ``ShardIndex.scan``: index version 2)."""

    EARLY_SHARE = 1 / 8  # of a shard, what the node's readers may fetch twice (``claim_ranges``)


    # -- readers ----------------------------------------------------------------------------------
    def open(self, number: int, counters: remote.Counters,
             stop: threading.Event | None = None) -> BinaryIO:
        """Shard ``number`` as a local file, checked against its index. Not cached yet (or
        not checked in this run, or damaged): checked, or fetched, by this caller under the
        shard's lock (or, if another process is fetching it, once that one is done); its
        requests counted in ``counters``. ``stop`` ends the wait or the fetch early
        (``remote.FetchStopped``)."""
        file = self._open_cached(number)
        if file is not None:
            return file
        began, since = time.perf_counter(), time.time_ns()
        fd = self._wait_for_lock(number, stop)
        try:
            self._raise_failure_since(number, since)
            file = self._open_cached(number, repair=True, counters=counters)
            if file is None:
                self._wait_for_room(number)
                try:
                    self._fetch_reserved(number, None, counters, stop)
                except OSError as failure:
                    self._record_failure(number, failure)
                    raise
                file = open_private_file(self.path(number))
        finally:
            unlock(fd)
        self.counters.add(shard_wait_s=time.perf_counter() - began)
        return file

    def missing(self, numbers: list[int]) -> list[int]:
        """Of ``numbers``, the shards not cached and checked in this run (a look at the ledger,
        maybe stale: ``open`` looks again)."""
        table = self.ledger.table()
        return [number for number in numbers if table["state"][number] != CACHED
                or table["checked"][number] != self.session]

    def uncached(self, numbers: list[int]) -> list[int]:
        """Of ``numbers``, the shards the node has no copy of (being fetched, or not yet)."""
        state = self.ledger.table()["state"]
        return [number for number in numbers if state[number] != CACHED]

    def claim_ranges(self, wanted: dict[int, int]) -> set[int]:
        """Of the shards of ``wanted`` (shard -> the bytes a batch would fetch of it by range
        requests before it is whole), those the node may still fetch so many bytes of twice
        (at most ``EARLY_SHARE`` of each shard, for the whole job: a cold start's first batches,
        not every batch of a fetch that falls behind); their bytes counted in the ledger."""
        granted = set()
        with self.ledger.changing() as table:
            for number, size in wanted.items():
                if table["early"][number] + size <= self.EARLY_SHARE * self.estimates[number]:
                    table["early"][number] += size
                    granted.add(number)
        return granted

    def part_path(self, number: int) -> str:
        """Where shard ``number``'s fetch writes until the shard is whole (one fetch at a time
        holds its lock, so one name serves)."""
        folder, name = os.path.split(self.path(number))
        return os.path.join(folder, f".{name}.part")

    def open_fetching(self, number: int) -> BinaryIO | None:
        """The file shard ``number``'s fetch is writing (checked as every file of the cache),
        if one is: it grows as the bytes come, and once renamed into place it is the whole
        shard. Its bytes are not checked: a reader checks them against the samples' digests."""
        try:
            return open_private_file(self.part_path(number))
        except FileNotFoundError:
            return None

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

    def _open_cached(self, number: int, repair: bool = False,
                     counters: remote.Counters | None = None) -> BinaryIO | None:
        """The cached file, if it is there and checked against its index in this run.
        ``repair`` (under the shard's lock): one not checked yet is checked now (its version
        asked, the request counted in ``counters``), and one that does not match is removed,
        said (``DamagedShardWarning``) and counted, to be fetched again."""
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
        recorded, version = int(table["version"][number]), self._version_if_known(number, counters)
        if recorded and version is not None and version != recorded:
            file.close()  # rewritten at its source: fetched again, and checked then
            self._drop(number)
            return None
        size, sha256 = file_digest(file)
        shard = self.index.shards[number]
        if size == shard.size and sha256 == shard.sha256:
            with self.ledger.changing() as table:
                if table["state"][number] == CACHED:
                    table["checked"][number] = self.session
                    if version is not None:
                        table["version"][number] = version
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
            Ledger.move(table, number, ABSENT, bytes=0)

    def _version_if_known(self, number: int, counters: remote.Counters | None) -> int | None:
        """The shard's version, or None where its store cannot be asked (down, stalling): a
        cached copy that matches its index is then used as it is, said once per process, and
        no other shard's version is asked in this process (each ask may take a third of the
        sequence's timeout)."""
        if self._unreachable:
            return None
        try:
            return self._version(number, counters or remote.Counters())
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
        return version_number(remote.version(
            self.index.shards[number].url, storage_options=self.storage_options,
            counters=counters, policy=self.policy, stop=stop))

    def _wait_for_lock(self, number: int, stop: threading.Event | None = None) -> int:
        while (fd := lock(self._lock_path(number), wait=False)) is None:
            if stop is not None and stop.is_set():
                raise remote.FetchStopped(f"{self.index.shards[number].url}: stopped")
            time.sleep(WAIT_POLL_S)  # another process fetches it: polled, so a thread can stop
        return fd

    # -- the prefetcher ---------------------------------------------------------------------------
    def prefetch(self, number: int, epoch: int, counters: remote.Counters,
                 stop: threading.Event, evict: bool = True) -> Callable[[], None] | str:
        """The fetch of shard ``number`` for ``epoch``, ready to run (its lock held, its bytes
        reserved; ``stop`` ends it early, see ``remote.fetch``); or BUSY (another process
        fetches it) or FULL (no room now, without taking a waiting reader's or evicting what a
        rank still needs, or, unless ``evict``, evicting anything)."""
        fd = lock(self._lock_path(number), wait=False)
        if fd is None:
            return BUSY
        try:
            file = self._open_cached(number, repair=True, counters=counters)
            if file is not None:  # fetched meanwhile
                file.close()
                unlock(fd)
                return BUSY
            if not self._reserve(number, epoch, demand=False, evict=evict):
                unlock(fd)
                return FULL
        except BaseException:
            unlock(fd)
            raise
        return functools.partial(self._fetch_holding, fd, number, epoch, counters, stop)

    def _fetch_holding(self, fd: int, number: int, epoch: int, counters: remote.Counters,
                       stop: threading.Event) -> None:
        try:
            self._fetch_reserved(number, epoch, counters, stop)
        finally:
            unlock(fd)

    def _fetch_reserved(self, number: int, epoch: int | None, counters: remote.Counters,
                        stop: threading.Event | None = None) -> None:
        """Fetch shard ``number`` (its lock held, its bytes reserved) and record it cached."""
        these = remote.Counters()  # this fetch's own, then added to the reader's
        try:
            size, named = remote.fetch_versioned(
                self.index.shards[number].url, self.path(number),
                storage_options=self.storage_options, counters=these, policy=self.policy,
                stop=stop, part_path=self.part_path(number))
            self._check_fetched(number)
            version = version_number(named) if named is not None else \
                self._version(number, these, stop)
        except BaseException:
            with self.ledger.changing() as table:
                Ledger.move(table, number, ABSENT, bytes=0)
            raise
        with self.ledger.changing() as table:
            tag = int(table["tag"][number]) if epoch is None else max(int(table["tag"][number]), epoch)
            again = int(table["fetched"][number] >= tag)
            Ledger.move(table, number, CACHED, waiting=0, tag=tag, fetched=tag, bytes=size,
                        stamp=time.time_ns(), checked=self.session, version=version,
                        got=int(table["got"][number]) + size)
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
