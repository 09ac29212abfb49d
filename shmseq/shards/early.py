"""Samples of shards still on their way: a batch whose shards the node's cache lacks does not
wait for them whole. ``EarlyReads`` starts (or joins) their whole fetches in the background and
meanwhile reads each run of the batch's samples as soon as its bytes are here: from the file
the shard's fetch writes into, or by a range request of its own, all of the batch's at once
(in shards of 64 MiB or more: a smaller one comes whole about as soon). Bytes read so are
checked against each sample's digest in the index (version 3) before they reach a batch; what
does not match, or does not come, is read from the whole shard once it is cached and checked.

Who calls what: ``ShardReader.read_as_ready`` (a worker's thread) calls ``start`` with the
batch's shards and ``arrivals`` with its runs in shards not cached; it reads the rest from the
cache after ``settle``. ``close`` (the reader's) stops the fetches nobody waits for.

What it costs: the bytes of the range requests, which the shard's fetch brings again
(``shard_early_bytes``): an eighth of each shard at most, for all the node's readers over the
whole job (``ShardCache.claim_ranges``): the first batches of a cold start, not every batch
where fetching falls behind reading.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Generator, Iterator, Protocol

from .. import remote
from ..remote import RemotePolicy
from .index import ShardIndex, sample_digest


class ShardFiles(Protocol):
    """A node's cache of whole shards, as a reader uses it (``shmseq.shards.cache.ShardCache``)."""

    @property
    def counters(self) -> remote.Counters:
        """Where the reads from cached shards are counted (``shard_read_bytes``)."""

    def open(self, number: int, counters: remote.Counters,
             stop: threading.Event | None = None) -> BinaryIO:
        """Shard ``number`` as a local file, fetched first if need be, by the reader's thread
        (a worker's, or the consumer's with num_workers=0) or one of its fetching threads
        (``stop`` ends that one's wait or fetch); its requests counted in ``counters``."""

    def missing(self, numbers: list[int]) -> list[int]:
        """Of ``numbers``, the shards a reader cannot open at once (a look, maybe stale)."""

    def uncached(self, numbers: list[int]) -> list[int]:
        """Of ``numbers``, the shards the node has no copy of (a look, maybe stale)."""

    def open_fetching(self, number: int) -> BinaryIO | None:
        """The file a shard's fetch is writing, if one is (its bytes unchecked)."""

    def claim_ranges(self, wanted: dict[int, int]) -> set[int]:
        """Of the shards of ``wanted`` (shard -> bytes), those whose bytes the node may fetch by
        range requests beside the whole shard (the bytes then counted)."""


Run = tuple[int, tuple[int, ...]]  # a shard's number, and the ordinals of neighbouring samples


class EarlyReads:
    """A reader's whole-shard fetches under way, and its reads of their samples meanwhile (see
    the module's text). Sent to worker processes with the reader: each starts anew."""

    FETCH_TOGETHER = 8    # whole shards fetched at once by one process's readers
    RANGES_TOGETHER = 16  # range requests at once in one process
    POLL_S = 0.005        # how often a run waits for its bytes in the fetch's file looks again
    RANGE_MIN_BYTES = 64 << 20  # a smaller shard comes whole about as soon as a batch's
    # range requests of it do (a request each run of samples, tens of ms each, at most
    # RANGES_TOGETHER at once, and each a server's work)
    ONE_TRY = 1           # a range request is tried once: the whole fetch is the fallback

    def __init__(self, index: ShardIndex, cache: ShardFiles, storage_options: dict | None,
                 policy: RemotePolicy | None) -> None:
        self.index = index
        self.cache = cache
        self.storage_options = storage_options
        policy = policy or remote.DEFAULT_POLICY
        self.policy = dataclasses.replace(policy, attempts=self.ONE_TRY)
        self._owner = -1  # the process whose pools and fetches these are
        self._lock = threading.Lock()
        self._fetches: dict[int, Future] = {}  # a shard's whole fetch (or the wait for
        # another process's), in this process
        self._stop = threading.Event()
        self._pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._ranges_ignored = False  # a server answered a range with its whole object

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_owner": -1, "_lock": None, "_fetches": {}, "_stop": None,
                "_pools": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _mine(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """This process's pools (a forked or unpickled copy makes its own, once: the threads
        of a thread-worker reader share them)."""
        with self._lock:
            if self._owner != os.getpid() or self._pools is None:
                self._owner, self._fetches, self._stop = os.getpid(), {}, threading.Event()
                self._pools = (ThreadPoolExecutor(self.FETCH_TOGETHER, "shmseq-shard-fetch"),
                               ThreadPoolExecutor(self.RANGES_TOGETHER, "shmseq-shard-range"))
            return self._pools

    def start(self, numbers: list[int], counters: remote.Counters) -> dict[int, Future]:
        """The whole fetches of the shards of ``numbers`` the cache cannot open at once, started
        here unless under way in this process already (``ShardFiles.open``: fetched by this
        process, or waited for where another fetches it)."""
        missing = self.cache.missing(numbers)
        if not missing:
            return {}
        fetching, _ = self._mine()
        with self._lock:
            for number in missing:
                known = self._fetches.get(number)
                if known is None or known.done():
                    whole = fetching.submit(self.cache.open, number, counters, self._stop)
                    whole.add_done_callback(_close_file)
                    self._fetches[number] = whole
            return {number: self._fetches[number] for number in missing}

    def arrivals(self, runs: list[Run], fetches: dict[int, Future],
                 counters: remote.Counters) -> Generator[tuple[Run, bytes], None, None]:
        """Of ``runs`` (in shards of ``fetches``), the bytes of those read before their shard is
        whole, checked, each as soon as it comes (its reader decodes it meanwhile): from the
        fetch's file, or by a range request in a large shard whose bytes fetched twice the node
        can still afford. The others are left for the whole shard (``settle``)."""
        early = self._early(runs)
        ranged = self._claim_ranges(early)
        with _PartFiles(self.cache) as parts:
            waiting: dict[Run, Future | None] = {}  # a run's range request, if it has one
            for run in early:
                data = self._from_part(parts, run)
                if data is not None:
                    yield run, data
                elif run[0] in ranged:
                    waiting[run] = self._mine()[1].submit(self._range, run, counters)
                else:
                    waiting[run] = None
            yield from self._as_they_come(parts, waiting, fetches)

    def _claim_ranges(self, runs: list[Run]) -> set[int]:
        """The shards whose runs this batch reads by range requests: large ones whose bytes
        fetched twice the node can still afford (``ShardFiles.claim_ranges``)."""
        if self._ranges_ignored:
            return set()
        wanted: dict[int, int] = {}
        for number, ordinals in runs:
            if (self.index.shards[number].size or 0) >= self.RANGE_MIN_BYTES:
                begin, end = self.index.shards[number].run_span(ordinals)
                wanted[number] = wanted.get(number, 0) + end - begin
        return self.cache.claim_ranges(wanted) if wanted else set()

    def settle(self, fetch: Future) -> BaseException | None:
        """Wait for a shard's whole fetch: what failed it, if it failed."""
        return fetch.exception()

    def _early(self, runs: list[Run]) -> list[Run]:
        """The runs in shards whose samples have digests and which the node has no copy of
        (a copy not checked yet in this run is checked whole, sooner than a request)."""
        uncached = set(self.cache.uncached(sorted({number for number, _ in runs})))
        return [run for run in runs
                if run[0] in uncached and self.index.shards[run[0]].digests is not None]

    def _as_they_come(self, parts: _PartFiles, waiting: dict[Run, Future | None],
                      fetches: dict[int, Future]) -> Iterator[tuple[Run, bytes]]:
        """Each run's bytes, from its range request or its shard's fetch file, whichever
        brings them checked first, until its shard's fetch ends (a stalled request is not
        waited for beyond it)."""
        while waiting:
            for run, request in list(waiting.items()):
                data = None
                if request is not None and request.done():
                    data, waiting[run] = request.result(), None  # None: the fetch's file may
                if data is None:
                    data = self._from_part(parts, run)
                if data is not None:
                    del waiting[run]
                    yield run, data
                elif fetches[run[0]].done():
                    del waiting[run]
            if waiting:
                time.sleep(self.POLL_S)

    def _from_part(self, parts: _PartFiles, run: Run) -> bytes | None:
        begin, end = self.index.shards[run[0]].run_span(run[1])
        data = parts.read(run[0], begin, end)
        if data is None or not self._checked(run, begin, data):
            return None
        self.cache.counters.add(shard_read_bytes=len(data))
        return data

    def _range(self, run: Run, counters: remote.Counters) -> bytes | None:
        """The run's bytes by one range request, checked; None where it fails or differs."""
        begin, end = self.index.shards[run[0]].run_span(run[1])
        try:
            data = remote.read_range(self.index.shards[run[0]].url, begin, end,
                                     storage_options=self.storage_options, counters=counters,
                                     policy=self.policy, stop=self._stop)
        except remote.RangeIgnored:
            self._ranges_ignored = True  # the server sends whole objects: no range again
            return None
        except (OSError, remote.FetchStopped):
            return None
        self.cache.counters.add(shard_early_bytes=len(data))
        return data if len(data) == end - begin and self._checked(run, begin, data) else None

    def _checked(self, run: Run, begin: int, data: bytes) -> bool:
        """Whether every sample of the run matches its digest (and then counts them)."""
        shard, view = self.index.shards[run[0]], memoryview(data)
        for ordinal in run[1]:
            start, stop = shard.span(ordinal)
            if sample_digest(view[start - begin:stop - begin]) != shard.digest(ordinal):
                return False
        self.cache.counters.add(shard_early_reads=len(run[1]))
        return True

    def close(self) -> None:
        """Stop this process's fetches (a fetch nobody waits for any more) and end its pools."""
        if self._owner != os.getpid() or self._pools is None:
            return
        self._stop.set()
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools, self._fetches = None, {}


class _PartFiles:
    """The files a batch's shards' fetches are writing, each opened once and kept open while
    the batch waits: it grows as bytes come, and after its rename into place it is the whole
    shard (a fetch started again after a failure writes another file, which a later batch
    opens)."""

    def __init__(self, cache: ShardFiles) -> None:
        self.cache = cache
        self.files: dict[int, BinaryIO] = {}

    def __enter__(self) -> _PartFiles:
        return self

    def __exit__(self, *_: object) -> None:
        for file in self.files.values():
            file.close()

    def read(self, number: int, begin: int, end: int) -> bytes | None:
        """Bytes ``begin`` to ``end`` of the shard, if its fetch has written them."""
        file = self.files.get(number)
        if file is None:
            file = self.cache.open_fetching(number)
            if file is None:
                return None
            self.files[number] = file
        if os.fstat(file.fileno()).st_size < end:
            return None
        data = os.pread(file.fileno(), end - begin, begin)
        return data if len(data) == end - begin else None


def _close_file(whole: Future) -> None:
    """A finished fetch's file (``ShardFiles.open`` opens it; readers open the shard anew)."""
    if not whole.cancelled() and whole.exception() is None:
        whole.result().close()
