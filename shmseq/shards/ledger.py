"""What a node's shard cache holds (``Ledger``: a record per shard in a file every process maps)
and where its local ranks are (``RankBoard``: a progress file each), which eviction waits for.
"""
from __future__ import annotations

import contextlib
import enum
import os
import time
from typing import Iterator

import numpy as np

from .files import open_private, open_private_file
from .locks import is_held, lock, locked, unlock


class ShardState(enum.IntEnum):
    """Where a shard stands in a node's cache. Its record moves only along ``MOVES``
    (``Ledger.move``), under the ledger's lock."""
    ABSENT = 0    # not on disk, no bytes counted
    FETCHING = 1  # a process holding the shard's lock fetches it: its bytes reserved
    CACHED = 2    # on disk, whole (checked against the index before a reader trusts it)


ABSENT, FETCHING, CACHED = ShardState
MOVES = {(ABSENT, FETCHING): "its bytes reserved for a fetch",
         (FETCHING, CACHED): "fetched, and checked against its index",
         (FETCHING, ABSENT): "its fetch failed, or its fetcher died",
         (CACHED, ABSENT): "evicted, or found damaged or rewritten",
         (ABSENT, CACHED): "found whole on disk at start, and checked (adopted)"}

LEDGER_RECORD = np.dtype([("state", "i1"), ("waiting", "i1"), ("tag", "<i4"), ("fetched", "<i4"),
                          ("bytes", "<i8"), ("stamp", "<i8"), ("checked", "<i8"),
                          ("version", "<i8"), ("got", "<i8"), ("early", "<i8")])

WAIT_POLL_S = 0.01          # how often a worker waiting for a shard or for room looks again
_RANK_HEADER = 24           # a progress file: the consumer's epoch, its owner's pid, where its
# batches in flight may reach (a ``next_read``); then, of every shard, when the rank reads it next
NEVER = np.iinfo(np.int64).max  # a shard the rank reads neither in this epoch nor in the next


def next_read(epoch: int | np.ndarray, position: int | np.ndarray) -> np.ndarray:
    """When a rank reads a shard next, as one number that orders (epoch, batch position)."""
    return (np.asarray(epoch, np.int64) << 32) + np.asarray(position, np.int64)


def read_epoch(reads: np.ndarray | int) -> np.ndarray:
    """The epoch of each ``next_read`` (never read again: past any epoch)."""
    return np.asarray(reads, np.int64) >> 32


class Ledger:
    """One ``LEDGER_RECORD`` per shard in a file every process maps: ``state`` (ABSENT,
    FETCHING, CACHED), ``waiting`` (a reader waits for room for it), ``tag`` (the epoch it is
    wanted for), ``fetched`` (the epoch it was last fetched for: one fetched again for the same
    epoch is counted), ``bytes`` (cached, or reserved
    while fetching), ``stamp`` (when it came), ``got`` (the bytes fetched for it since the
    ledger was made: the node's fetches, for its report), ``early`` (the bytes of it readers
    fetched by range requests before it was whole, since the ledger was made). Read
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
        empty["tag"] = empty["fetched"] = -1  # wanted for, fetched for: none yet
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
        return locked(self.path + ".lock")

    @staticmethod
    def move(table: np.ndarray, number: int | np.integer, to: ShardState, **fields: int) -> None:
        """The one way a shard's record changes state (its ledger lock held): to ``to``, with
        ``fields`` (``bytes=0``, ...) set; a move not in ``MOVES`` is a bug, raised."""
        now = ShardState(int(table["state"][number]))
        if now != to and (now, to) not in MOVES:
            raise RuntimeError(f"shard {number} of the cache's ledger cannot move from "
                               f"{now.name} to {to.name}: only {sorted((a.name, b.name) for a, b in MOVES)}")
        table["state"][number] = to
        for field, value in fields.items():
            table[field][number] = value

    def usage(self, table: np.ndarray) -> int:
        """Bytes the cache holds or has reserved."""
        return int(table["bytes"][table["state"] != ABSENT].sum())


class RankBoard:
    """Each local rank's progress, one file each: the epoch its consumer is in and, of every
    shard, when its batches read it next (``next_read``: in this epoch, or else in the next).
    Eviction waits for every live rank and evicts what the node reads latest; a rank holds its
    file's flock while it runs, so a file nobody holds is a finished or dead rank's and counts
    for nothing."""

    def __init__(self, folder: str, count: int) -> None:
        self.folder = folder
        self.count = count

    def path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}")

    def join(self, rank: int, epoch: int, reach: int, reads: np.ndarray) -> "RankProgress":
        """This process's place on the board as ``rank``, published at once; raises if a live
        process (another job's, or another sequence of this one's) holds that rank already."""
        deadline = time.monotonic() + 2.0  # a board reader holds a file for a moment only
        while (fd := lock(self.path(rank), wait=False)) is None:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"the shard cache {os.path.dirname(self.folder)} has a rank {rank} already, "
                    f"running in pid {self._owner(rank)}: two jobs, or two sequences of one job "
                    "over the same shards, need caches of their own: give each its own job= "
                    "(or cache_dir=)")
            time.sleep(WAIT_POLL_S)
        progress = RankProgress(fd, self.count)
        progress.publish_reach(reach)
        progress.publish(epoch, reads)
        return progress

    def _owner(self, rank: int) -> int | str:
        with contextlib.suppress(OSError), open_private_file(self.path(rank)) as file:
            return int(np.frombuffer(file.read(_RANK_HEADER), np.int64)[1])
        return "unknown"

    def live(self) -> list[tuple[int, int, np.ndarray]]:
        """(epoch, reach of the batches in flight, next reads) of every live rank."""
        found = []
        size = _RANK_HEADER + 8 * self.count
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.folder):
                path = os.path.join(self.folder, name)
                if not is_held(path):
                    continue
                with open_private_file(path) as file:
                    data = file.read(size)
                    if len(data) == size:
                        epoch, _, reach = np.frombuffer(data[:_RANK_HEADER], np.int64).tolist()
                        found.append((epoch, reach,
                                      np.frombuffer(data, np.int64, offset=_RANK_HEADER)))
        return found

    def expected(self) -> int:
        """How many local ranks the launcher started (torchrun's LOCAL_WORLD_SIZE), else 0."""
        value = os.environ.get("LOCAL_WORLD_SIZE", "")
        return int(value) if value.isdigit() else 0


class RankProgress:
    """A rank's own progress file, written in place: the shards' next reads, then the
    consumer's epoch, so that a reader who catches it half-written sees more kept, never less
    (a read not yet moved on is sooner); and, on the consumer's thread before the batches it
    covers are dispatched, how far they may reach (``publish_reach``)."""

    def __init__(self, fd: int, count: int, fresh: bool = True) -> None:
        self.fd = fd
        self.count = count
        self._published: tuple | None = None
        self._reach: int | None = None
        if fresh:  # else the rank's file as its consumer's process made it, handed on
            os.ftruncate(fd, _RANK_HEADER + 8 * count)
            os.pwrite(fd, np.array([-1, os.getpid(), -1], np.int64).tobytes(), 0)

    def publish(self, epoch: int, reads: np.ndarray) -> None:
        if self._published is not None and self._published[0] == epoch and \
                np.array_equal(reads, self._published[1]):
            return
        os.pwrite(self.fd, reads.astype(np.int64).tobytes(), _RANK_HEADER)
        os.pwrite(self.fd, np.int64(epoch).tobytes(), 0)
        self._published = epoch, reads.copy()

    def publish_reach(self, reach: int) -> None:
        if reach != self._reach:
            os.pwrite(self.fd, np.int64(reach).tobytes(), 16)
            self._reach = reach

    def leave(self) -> None:
        if self.fd >= 0:
            unlock(self.fd)
            self.fd = -1


def evictable(table: np.ndarray, live: list[tuple[int, int, np.ndarray]], expected: int = 0) -> np.ndarray:
    """The cached shards no live rank's batches in flight read (they reach into the next epoch
    near an epoch's end). A shard read later in the epoch may go, to make room for one read
    sooner: pinned for the whole epoch, the shards of its end held the room its next batch
    needed, and that batch waited for room that never came (``ShardCacheFull``, with 6 of 6
    shards kept for later in the epoch)."""
    free = table["state"] == CACHED
    if len(live) < expected:  # ranks the launcher started are not on the board yet
        return np.zeros_like(free)
    for _, reach, reads in live:
        free &= reads > reach
    return free


def node_reads(live: list[tuple[int, int, np.ndarray]], count: int) -> np.ndarray:
    """When the node reads each shard next: the soonest of its live ranks' next reads."""
    soonest = np.full(count, NEVER, np.int64)
    for _, _, reads in live:
        np.minimum(soonest, reads, out=soonest)
    return soonest
