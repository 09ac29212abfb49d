"""Reading samples by global id: each sample's bytes at its offset, from local files, by range
requests (``shmseq.remote``), or from a node's cache of whole shards (``ShardFiles``, which
``shmseq.shards.cache.ShardCache`` is); runs of neighbours in one read.
"""
from __future__ import annotations

import collections
import collections.abc
import os
import threading
from typing import Any, IO, Iterator

import numpy as np

from .. import remote
from ..remote import RemotePolicy, is_remote
from .early import EarlyReads, Run, ShardFiles
from .files import UnsafeCacheError
from .index import ShardIndex, open_url
from .tar import ShardError, parse_members


IN_PLACE_NEEDS_RANGE = (  # what to do where a server answers a sample's range with its shard
    "reading shards in place needs Range requests: pass cache=True to read them through the "
    "node's shard cache (it fetches whole shards), or serve them from a server that honours "
    "Range (object stores and common web servers do)")


class ShardReader:
    """Reads samples by global id. Local files are opened on first use and kept, the last
    ``OPEN_FILES`` used in each thread (worker threads share a reader, never a file: a file's
    position is not to be shared). Remote shards are read by range requests (``shmseq.remote``:
    ``policy``'s timeout and retries), counted in ``counters``; or, with a ``cache``
    (``shmseq.shards.cache``), from the node's local copies, fetched whole if they are not there
    yet, and closed after each read: the space of a shard the cache evicts is freed once no
    reader holds it open. A batch's shards the cache lacks are fetched at once, and their
    samples read as soon as their bytes are here (``shmseq.shards.early``)."""

    OPEN_FILES = 8

    def __init__(self, index: ShardIndex, storage_options: dict | None = None, *,
                 policy: RemotePolicy | None = None, cache: ShardFiles | None = None) -> None:
        if policy is not None and not isinstance(policy, RemotePolicy):
            raise TypeError(f"remote must be a shmseq.remote.RemotePolicy or None, got {policy!r}")
        self.index = index
        self.storage_options = storage_options
        self.policy = policy
        self.cache = cache
        self.counters = remote.Counters()
        self._local = threading.local()
        self._every_thread: list[collections.OrderedDict[int, IO[bytes]]] = []
        self._early = EarlyReads(index, cache, storage_options, policy) if cache is not None \
            else None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_local": None, "_every_thread": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local())

    def _files(self) -> collections.OrderedDict[int, IO[bytes]]:
        """This thread's open files, by shard number."""
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = collections.OrderedDict()
            self._every_thread.append(files)
        return files

    def _file(self, number: int) -> IO[bytes]:
        files = self._files()
        file = files.pop(number, None)
        failed = getattr(self._local, "failed", {}).pop(number, None)
        if failed is not None:
            raise failed
        if file is None:
            file = (self.cache.open(number, self.counters) if self.cache is not None else
                    open_url(self.index.shards[number].url, self.storage_options))
            if len(files) >= self.OPEN_FILES:
                files.popitem(last=False)[1].close()
        files[number] = file
        return file

    def read(self, ids: np.ndarray) -> list[dict]:
        """The samples of ``ids``, in that order, each with ``__key__``, ``__url__``,
        ``__offset__`` and its global ``__id__``. Samples next to each other in a shard are
        read in one request."""
        found: list[dict] = [{}] * len(ids)
        for position, sample in self.read_as_ready(ids):
            found[position] = sample
        return found

    def read_as_ready(self, ids: np.ndarray) -> Iterator[tuple[int, dict]]:
        """``read``'s samples with their positions in ``ids``, in the order they can be read:
        those of shards still being fetched as their bytes come (a worker decodes each
        meanwhile), then the others."""
        shards, ordinals = self.index.locate(np.asarray(ids, np.int64))
        pairs = list(zip(shards.tolist(), ordinals.tolist()))
        places = collections.defaultdict(list)
        for position, pair in enumerate(pairs):
            places[pair].append(position)
        runs = [(number, tuple(run)) for number, run in _runs(sorted(set(pairs)))]
        try:
            for samples in self._runs_as_ready(runs, sorted(set(shards.tolist()))):
                for pair, sample in samples:
                    for position in places[pair]:
                        yield position, sample
        finally:
            if self.cache is not None:
                self._close_files(getattr(self._local, "files", {}))

    def _runs_as_ready(self, runs: list[Run], numbers: list[int]
                       ) -> Iterator[Iterator[tuple[tuple[int, int], dict]]]:
        """Each run's samples. With a cache: the batch's shards it lacks fetched at once (a
        cold batch that reads 8 shards waits for about one fetch, not 8), the runs that can be
        read before their shard is whole first, as they come; the other shards waited for,
        what failed them raised where their samples are read."""
        done: set[Run] = set()
        if self._early is not None:
            fetches = self._early.start(numbers, self.counters)
            arrivals = self._early.arrivals([run for run in runs if run[0] in fetches], fetches,
                                            self.counters)
            try:
                for run, data in arrivals:
                    done.add(run)
                    yield self._parsed(*run, data)
            finally:
                arrivals.close()
            for number, fetch in fetches.items():
                if any(run[0] == number and run not in done for run in runs):
                    failure = self._early.settle(fetch)
                    if failure is not None:
                        self._local.__dict__.setdefault("failed", {})[number] = failure
        for run in runs:
            if run not in done:
                yield self._read_run(*run)

    def _read_run(self, number: int, ordinals: tuple[int, ...]) -> Iterator[tuple[tuple[int, int], dict]]:
        return self._parsed(number, ordinals,
                            self._read(number, *self.index.shards[number].run_span(ordinals)))

    def _parsed(self, number: int, ordinals: tuple[int, ...],
                data: bytes) -> Iterator[tuple[tuple[int, int], dict]]:
        """The run's samples from its bytes."""
        shard, view = self.index.shards[number], memoryview(data)
        begin = shard.run_span(ordinals)[0]
        for ordinal in ordinals:
            start, stop = shard.span(ordinal)
            sample = parse_members(view[start - begin:stop - begin], shard.url, start)
            sample.update(__url__=shard.url, __offset__=start,
                          __id__=int(self.index.starts[number]) + ordinal)
            yield (number, ordinal), sample

    def _read(self, number: int, begin: int, end: int) -> bytes:
        """Bytes ``begin`` to ``end`` of shard ``number``; a local file's size is checked first:
        an index that runs past the end would otherwise size the read (and its memory)."""
        url = self.index.shards[number].url
        try:
            read = self._remote_read if is_remote(url) and self.cache is None else self._local_read
            return read(number, begin, end)
        except FileNotFoundError as exc:
            raise ShardError(f"shard {url} is missing ({exc.strerror})") from exc
        except remote.RangeIgnored as exc:
            raise ShardError(f"shard {url}: {exc.answer}: {IN_PLACE_NEEDS_RANGE}") from exc
        except UnsafeCacheError:
            raise  # the cache's folder, not the shard: no sample is to blame, none is skipped
        except OSError as exc:
            getattr(self._local, "files", {}).pop(number, None)
            raise ShardError(f"shard {url}: reading bytes {begin}-{end} failed: "
                             f"{type(exc).__name__}: {remote.reason(exc, url)}") from exc

    def _local_read(self, number: int, begin: int, end: int) -> bytes:
        file = self._file(number)
        size = file.seek(0, os.SEEK_END)
        if end > size:
            raise self._past_the_end(number, begin, end, size)
        file.seek(begin)
        data = file.read(end - begin)
        if len(data) < end - begin:  # the file was cut since it was opened
            raise self._past_the_end(number, begin, end, begin + len(data))
        if self.cache is not None:
            self.cache.counters.add(shard_read_bytes=len(data))
        return data

    def _remote_read(self, number: int, begin: int, end: int) -> bytes:
        """One range request; a shorter answer means the object ends first: its size is asked."""
        url = self.index.shards[number].url
        options: dict[str, Any] = {"storage_options": self.storage_options,
                                   "counters": self.counters, "policy": self.policy}
        data = remote.read_range(url, begin, end, **options)
        if len(data) < end - begin:
            raise self._past_the_end(number, begin, end, remote.size(url, **options))
        return data

    def _past_the_end(self, number: int, begin: int, end: int, size: int) -> ShardError:
        """The error for a read of bytes ``begin`` to ``end`` of a shard of ``size`` bytes,
        naming the first sample of the read that the shard ends in (or before)."""
        return ShardError(f"shard {self.index.shards[number].url} ends at byte {size}, before "
                          f"the sample at byte {self._sample_at(number, max(begin, size))} ends "
                          f"(byte {end}): the shard is truncated, or its index is stale")

    def _sample_at(self, number: int, byte: int) -> int:
        offsets = self.index.shards[number].offsets
        return int(offsets[max(np.searchsorted(offsets, byte, side="right") - 1, 0)])

    def close(self) -> None:
        """Close every thread's files (the workers have stopped), and stop the fetches nobody
        waits for any more; they reopen, and start again, when read."""
        if self._early is not None:
            self._early.close()
        for files in self._every_thread:
            self._close_files(files)
        self._every_thread.clear()
        self._local = threading.local()

    @staticmethod
    def _close_files(files: dict[int, IO[bytes]]) -> None:
        while files:
            files.popitem()[1].close()


def _runs(pairs: list[tuple[int, int]]) -> Iterator[tuple[int, list[int]]]:
    """Sorted (shard, ordinal) pairs as runs of consecutive ordinals within one shard."""
    run: list[int] = []
    shard = -1  # the run's, once it has a first pair
    for number, ordinal in pairs:
        if run and (number != shard or ordinal != run[-1] + 1):
            yield shard, run
            run = []
        shard = number
        run.append(ordinal)
    if run:
        yield shard, run
