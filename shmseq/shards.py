"""Streaming shards: WebDataset-layout tar files read member by member, by byte offset.

A shard is a tar file whose members are grouped into samples by key (``n01/img7.jpg`` and
``n01/img7.cls`` are the sample ``n01/img7``, WebDataset's convention). An index lists each
shard's URL and the byte offset where each of its samples begins; with it every sample has a
global id (shard after shard), and the rest of shmseq treats a stream of shards as it treats
any dataset:

* ``ShardPlan`` (an ``EpochPlan``) orders the ids of an epoch: the shards in an order drawn
  from ``seed + epoch``, each sample moved at most ``shuffle_window`` places (a bounded
  shuffle, like WebDataset's buffer, but a pure function of the seed), then dealt to the ranks
  batch by batch, padded or cut so that every rank gets as many batches. The order does not
  depend on the number of workers, so a run resumes with any number of them.
* ``ShardWorker`` builds a batch from its ids: it reads each sample's bytes at its offset (no
  shard is read from its start to reach a member), hands the sample to the user's ``decode``,
  and stacks the results. A replacement worker rebuilds a dead one's batch from the same ids.
* ``ShardSequence`` is a ``ShmSequence`` over an index with that plan and worker. Remote
  shards are read from the node's shard cache (``shmseq.shard_cache``): each fetched whole,
  once per node, ahead of need, and read by offset from local disk; their shuffle is then
  bounded in shards (``shuffle_shards``), the cache's unit.

Reading is ``tarfile``'s header format parsed in place, and ``shmseq.remote`` for URLs with a
protocol: range requests through ``fsspec``, each under a timeout, transient failures retried
(local paths need neither fsspec nor a copy through it). ``webdataset``'s reader streams a
shard from its first byte and cannot start at a member, which exact resume needs; nor is it
faster. Every sample of 12 local shards (3,000 samples of 150 kB) read once, samples/s,
median (min-max) of 3 interleaved runs of ``bench/tar_readers.py`` on a shared 2-core machine:
webdataset 1.0.2 10,200 (9,900-12,200); by offset in shard order 15,100 (8,200-15,400); by
offset with a 1,000-sample shuffle window 7,300 (5,400-9,400): members out of order are read
one request each.
"""
from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import contextlib
import importlib.util
import io
import json
import os
import posixpath
import sys
import tarfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, cast

import numpy as np

from . import remote
from .cache_files import UnsafeCacheError, file_digest
from .checks import check_bool, check_int
from .engine.common.ragged import Ragged
from .engine.trainer.plan import EpochPlan
from .engine.trainer.stats import LoaderStats
from .remote import RemotePolicy, fit_to_timeout, is_remote
from .sequence import ShmSequence
from .shard_cache import Prefetcher, ShardCache, check_room

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from typing_extensions import Self

    from .engine.common.layout import SlotAllocator

INDEX_VERSION = 2     # written; 1 (no shard sizes or checksums) is read too
READ_VERSIONS = (1, 2)
_BLOCK = 512
ON_ERROR = ("raise", "skip")
SHUFFLE_WINDOW = 1000  # samples: the default of local shards, read where their samples lie
SHUFFLE_SHARDS = 8     # shards: the default of remote ones, read from the node's shard cache
POSTFIX_S = 0.1        # how often a scan's bar shows the samples found in a remote shard


class ShardError(ValueError):
    """A shard that cannot be read as its index says (missing, truncated, corrupt), or a sample
    in it that does not decode: the message names the shard's URL, the sample and its offset."""


def _key_and_field(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name: the key up to the first dot of the base name."""
    folder, base = posixpath.split(name)
    stem, dot, field = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, field if dot else ""


def open_url(url: str, storage_options: dict | None = None) -> IO[bytes]:
    """A binary file object for a local path or any fsspec URL (see ``shmseq.remote``)."""
    return remote.open_file(url, storage_options)


@dataclass(frozen=True)
class Shard:
    """One tar file: where each of its samples begins, where the last one ends, and, in an
    index written or scanned since version 2, the whole file's size and SHA-256 (a shard cache
    checks every copy against them)."""
    url: str
    offsets: np.ndarray  # int64: the byte offset of each sample's first member header
    end: int             # the byte offset just past the last sample's last member
    size: int | None = None    # the whole file's bytes (a tar writer's tail included)
    sha256: str | None = None  # the whole file's, in hex

    def __len__(self) -> int:
        return len(self.offsets)

    def span(self, ordinal: int) -> tuple[int, int]:
        """The bytes of sample ``ordinal``: its members' headers and data."""
        stop = self.offsets[ordinal + 1] if ordinal + 1 < len(self.offsets) else self.end
        return int(self.offsets[ordinal]), int(stop)


class ShardIndex:
    """The shards of a dataset and their samples' offsets; a sample's global id counts the
    samples of the shards before its own."""

    def __init__(self, shards: Iterable[Shard]) -> None:
        self.shards = tuple(shards)
        counts = [len(shard) for shard in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, ordinal in that shard) of each global id."""
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        return shard, ids - self.starts[shard]

    def name_of(self, sample_id: int) -> str:
        """Where a sample is, for messages (a ``DecodeStage``'s ``names``)."""
        shard, ordinal = (int(part[0]) for part in self.locate(np.array([sample_id], np.int64)))
        return f"shard {self.shards[shard].url}, sample at byte {self.shards[shard].span(ordinal)[0]}"

    @classmethod
    def scan(cls, urls: Iterable[str], storage_options: dict | None = None,
             progress: bool | None = None) -> "ShardIndex":
        """Read the member headers of each shard (its data is skipped where the file seeks),
        then the whole shard once, for its size and SHA-256 (which a shard cache checks every
        copy against). ``progress``: a bar on stderr, shard by shard, and beside it the samples found so far
        in a remote shard (a request for each header) (None: where stderr is a terminal and
        tqdm is installed)."""
        shards = []
        with _progress(progress, _length(urls), "shards", "scanning shards") as bar:
            for url in urls:
                shards.append(_scan_shard(url, storage_options, _samples_found(bar, url)))
                bar.update(1)
        return cls(shards)

    @classmethod
    def load(cls, url: str, storage_options: dict | None = None) -> "ShardIndex":
        """An index saved by ``save``; shard URLs in it that are relative are taken relative
        to the index's own location."""
        with open_url(url, storage_options) as file:
            saved = json.load(file)
        if saved.get("version") not in READ_VERSIONS:
            raise ValueError(f"{url} is not a shard index of version {INDEX_VERSION} "
                             f"(it says version {saved.get('version')!r}): scan the shards again")
        if is_remote(url):
            _refuse_local_entries(url, saved["shards"])
        base = url.rsplit("/", 1)[0] if "/" in url else "."
        return cls(Shard(_joined(base, entry["url"]), np.asarray(entry["offsets"], np.int64),
                         int(entry["end"]), entry.get("size"), entry.get("sha256"))
                   for entry in saved["shards"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the index as JSON; shard paths under its folder are kept relative to it."""
        folder = os.path.dirname(os.path.abspath(path))
        entries = [{"url": _relative(shard.url, folder), "offsets": shard.offsets.tolist(),
                    "end": shard.end, "size": shard.size, "sha256": shard.sha256}
                   for shard in self.shards]
        with open(path, "w") as file:
            json.dump({"version": INDEX_VERSION, "shards": entries}, file)


def _refuse_local_entries(url: str, entries: list[dict]) -> None:
    """An index read from a server names its shards by URL, or relative to itself: one naming
    local files would have the reader read this machine's files, and copy them into the shard
    cache, on a server's say-so."""
    for number, entry in enumerate(entries):
        shard = str(entry["url"])
        if shard.lower().startswith("file:") or os.path.isabs(shard):
            raise ValueError(
                f"the index {url} names a local file for shard {number}: {shard!r}; an index "
                "read from a server may name shards by URL or by a path relative to itself, "
                "not on this machine's disk: fix the index, or keep it beside local shards and "
                "load it from there")


def _joined(base: str, url: str) -> str:
    if "://" in url or os.path.isabs(url):
        return url
    return f"{base}/{url}" if is_remote(base) else os.path.join(base, url)


def _relative(url: str, folder: str) -> str:
    if is_remote(url):
        return url
    path = os.path.abspath(url)
    return os.path.relpath(path, folder) if path.startswith(folder + os.sep) else path


def _scan_shard(url: str, storage_options: dict | None,
                found: Callable[[int], None] | None = None) -> Shard:
    """The shard's index entry, from its member headers; ``found(count)`` hears of each sample."""
    offsets, key, end = [], None, 0
    try:
        with open_url(url, storage_options) as file, tarfile.open(fileobj=file, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                member_key, _ = _key_and_field(member.name)
                if member_key != key:
                    offsets.append(member.offset)
                    key = member_key
                    if found is not None:
                        found(len(offsets))
                end = member.offset_data + -(-member.size // _BLOCK) * _BLOCK
            size, sha256 = file_digest(file)
    except (OSError, tarfile.TarError) as exc:
        raise ShardError(f"cannot index shard {url}: {type(exc).__name__}: "
                         f"{remote.reason(exc, url)}") from exc
    return Shard(url, np.asarray(offsets, np.int64), end, size, sha256)


def write_shards(samples: Iterable[dict], pattern: str, *, samples_per_shard: int = 1000,
                 index: str | None = None, processes: int | None = None,
                 progress: bool | None = None) -> ShardIndex:
    """Pack samples into tar shards (``pattern % shard_number``, e.g. ``"out/train-%05d.tar"``)
    and write their index (``index``; default ``shards.json`` beside the first shard).

    A sample is a dict: ``"__key__"`` (a unique name, no dot in its last part) and one entry
    per field, ``bytes`` (``"jpg"``: the encoded file) or ``str``/``int`` (stored as text).

    ``samples`` may be any iterable of them, written in one process; or a sequence (``len`` and
    ``samples[i]``, as ``image_folder_samples`` gives), whose shards are then written by
    ``processes`` processes at once, each making its own shards' samples (reading the files of
    a large folder in parallel): the shards are the same either way. ``processes`` None: the
    usable cores, for a sequence of more than one shard. ``progress``: a progress bar on
    stderr (tqdm); None: where stderr is a terminal and tqdm is installed."""
    check_int("samples_per_shard", samples_per_shard, 1)
    check_int("processes", processes, 1, optional=True)
    parallel = (_parallel(processes, len(samples), samples_per_shard)
                if isinstance(samples, collections.abc.Sequence) else 1)
    with _progress(progress, _length(samples), "samples", "writing shards") as bar:
        if parallel > 1:
            assert isinstance(samples, collections.abc.Sequence)  # parallel: a sequence
            shards = _write_in_processes(samples, pattern, samples_per_shard, parallel, bar)
        else:
            shards = _write_in_turn(samples, pattern, samples_per_shard, bar)
    written = ShardIndex(shards)
    written.save(index or os.path.join(os.path.dirname(pattern % 0) or ".", "shards.json"))
    return written


def _length(samples: object) -> int | None:
    return len(samples) if isinstance(samples, collections.abc.Sized) else None


def _parallel(processes: int | None, count: int, samples_per_shard: int) -> int:
    """How many processes write the shards of ``count`` samples."""
    shards = max(-(-count // samples_per_shard), 1)
    wanted = len(os.sched_getaffinity(0)) if processes is None else processes
    return min(wanted, shards)


def _write_in_turn(samples: Iterable[dict], pattern: str, samples_per_shard: int,
                   bar: _Bar) -> list[Shard]:
    shards: list[Shard] = []
    batch: list[dict] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == samples_per_shard:
            shards.append(_write_shard(pattern % len(shards), batch))
            bar.update(len(batch))
            batch = []
    if batch or not shards:
        shards.append(_write_shard(pattern % len(shards), batch))
        bar.update(len(batch))
    return shards


_samples_here: collections.abc.Sequence = ()  # a writing process's samples (set once, at its start)


def _keep_samples(samples: collections.abc.Sequence) -> None:
    global _samples_here
    _samples_here = samples


def _write_shard_number(number: int, pattern: str, samples_per_shard: int) -> Shard:
    first = number * samples_per_shard
    batch = [_samples_here[at] for at in range(first, min(first + samples_per_shard,
                                                          len(_samples_here)))]
    return _write_shard(pattern % number, batch)


def _write_in_processes(samples: collections.abc.Sequence, pattern: str, samples_per_shard: int,
                        processes: int, bar: _Bar) -> list[Shard]:
    """Each shard written by one of ``processes`` processes, which were given the sequence
    once (not with every shard)."""
    count = max(-(-len(samples) // samples_per_shard), 1)
    with concurrent.futures.ProcessPoolExecutor(processes, initializer=_keep_samples,
                                                initargs=(samples,)) as pool:
        futures = [pool.submit(_write_shard_number, number, pattern, samples_per_shard)
                   for number in range(count)]
        for done in concurrent.futures.as_completed(futures):
            bar.update(len(done.result()))
        return [future.result() for future in futures]


class _Bar(Protocol):
    """A progress bar, as tqdm's: ``update(count)`` more done, and a word beside it."""

    def update(self, count: int, /) -> object:
        """``count`` more done."""

    def set_postfix_str(self, text: str, /) -> object:
        """``text`` shown after the bar, at once."""


class _NoBar:
    def update(self, count: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def _samples_found(bar: _Bar, url: str) -> Callable[[int], None] | None:
    """What shows the samples found so far in a remote shard beside the bar, at most every
    ``POSTFIX_S``: its headers are a request each, so a shard can take minutes, which a bar
    counting whole shards would show as nothing. None where that is not wanted (local shards
    are scanned in a blink; no bar)."""
    if isinstance(bar, _NoBar) or not is_remote(url):
        return None
    name, shown = posixpath.basename(url), [0.0]

    def found(count: int) -> None:
        if time.monotonic() - shown[0] >= POSTFIX_S:
            bar.set_postfix_str(f"{name}: {count} samples")
            shown[0] = time.monotonic()
    return found


@contextlib.contextmanager
def _progress(wanted: bool | None, total: int | None, unit: str, label: str) -> Iterator[_Bar]:
    """A tqdm bar on stderr, ``label`` before it (``wanted`` None: where stderr is a terminal
    and tqdm is there)."""
    if wanted is None:
        wanted = sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
    if not wanted:
        yield _NoBar()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError("progress=True shows a bar with tqdm: pip install tqdm, or pass "
                          "progress=False") from None
    with tqdm(total=total, unit=unit, desc=label, file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar


def _write_shard(path: str, samples: list[dict]) -> Shard:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    offsets = []
    with open(path, "wb") as file, tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            offsets.append(tar.offset)
            key = sample["__key__"]
            for field, value in sample.items():
                if field.startswith("__"):
                    continue
                data = value if isinstance(value, bytes) else str(value).encode()
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mode, info.mtime = len(data), 0o444, 0
                tar.addfile(info, io.BytesIO(data))
        end = tar.offset
    with open(path, "rb") as written:
        size, sha256 = file_digest(written)
    return Shard(path, np.asarray(offsets, np.int64), end, size, sha256)


class image_folder_samples(collections.abc.Sequence):
    """An image folder (``root/<class>/<image>``, as ``ImageFolderWorker`` reads it) as
    samples for ``write_shards``: the encoded file under its extension and the label as
    ``cls``, in the folder's order. A sequence: ``write_shards`` reads its files in as many
    processes as it writes shards with."""

    def __init__(self, root: str | os.PathLike) -> None:
        from .vision import ImageFolder
        folder = ImageFolder.scan(root)
        self.files, self.labels = list(folder.files), [int(label) for label in folder.labels]

    def __len__(self) -> int:
        return len(self.files)

    # the type ignored: read by index only, not sliced (write_shards takes any sequence)
    def __getitem__(self, number: int) -> dict:  # type: ignore[override]
        path = self.files[number]
        with open(path, "rb") as file:
            data = file.read()
        field = os.path.splitext(path)[1].lstrip(".").lower()
        return {"__key__": f"{number:08d}", field: data, "cls": self.labels[number]}


def _parse_members(data: memoryview, url: str, at: int) -> dict:
    """The members of one sample's bytes (ustar headers, parsed in place; pax and GNU headers
    through tarfile): field -> bytes, plus ``__key__``."""
    sample: dict = {}
    position = 0
    while position < len(data):
        header = bytes(data[position:position + _BLOCK])
        if len(header) < _BLOCK or header[156:157] in (b"x", b"g", b"L", b"K"):
            return _parse_with_tarfile(data, url, at)
        try:
            name, size, regular = _ustar_header(header)
        except ValueError as exc:
            sample_key = f"sample {sample['__key__']}" if sample else "the sample"
            raise ShardError(f"shard {url}: {sample_key} at byte {at}: no valid tar header at byte "
                             f"{at + position} ({exc}): the shard is corrupt, or its index is "
                             "stale") from exc
        begin = position + _BLOCK
        if begin + size > len(data):
            raise ShardError(f"shard {url}: member {name} at byte {at + position} runs past "
                             "its sample's end: the shard is truncated, or its index is stale")
        if regular:
            _add_member(sample, name, data[begin:begin + size], url, at + position)
        position = begin + -(-size // _BLOCK) * _BLOCK
    return sample


def _ustar_header(header: bytes) -> tuple[str, int, bool]:
    """(name, size, is a regular file) of a ustar header, read as tarfile reads it (checksum
    included) at a tenth of the cost of ``TarInfo.frombuf``, which decodes every field."""
    if not any(header):
        raise ValueError("an empty block, as at the archive's end")
    stored = int(header[148:156].rstrip(b"\0 ") or b"-1", 8)
    if stored != sum(header) - sum(header[148:156]) + 8 * 32:
        raise ValueError("bad checksum")
    if header[124] & 0x80:
        raise ValueError("a base-256 size: only pax sizes are read")
    size = int(header[124:136].strip(b"\0 ") or b"0", 8)
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar" and header[345] != 0:
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, header[156:157] in (b"0", b"\0", b"7")


def _parse_with_tarfile(data: memoryview, url: str, at: int) -> dict:
    sample: dict = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    file = tar.extractfile(member)
                    assert file is not None  # a regular file's
                    _add_member(sample, member.name, file.read(), url, at + member.offset)
    except tarfile.TarError as exc:
        raise ShardError(f"shard {url}: the sample at byte {at} is not valid tar ({exc}): the "
                         "shard is corrupt, or its index is stale") from exc
    return sample


def _add_member(sample: dict, name: str, data: bytes | memoryview, url: str, at: int) -> None:
    key, field = _key_and_field(name)
    if sample.setdefault("__key__", key) != key:
        raise ShardError(f"shard {url}: member {name} at byte {at} belongs to sample {key}, not "
                         f"{sample['__key__']}: the index does not match the shard; scan it again")
    sample[field] = bytes(data)


class ShardReader:
    """Reads samples by global id. Local files are opened on first use and kept, the last
    ``OPEN_FILES`` used in each thread (worker threads share a reader, never a file: a file's
    position is not to be shared). Remote shards are read by range requests (``shmseq.remote``:
    ``policy``'s timeout and retries), counted in ``counters``; or, with a ``cache``
    (``shmseq.shard_cache``), from the node's local copies, fetched whole if they are not there
    yet, and closed after each read: the space of a shard the cache evicts is freed once no
    reader holds it open."""

    OPEN_FILES = 8

    def __init__(self, index: ShardIndex, storage_options: dict | None = None, *,
                 policy: RemotePolicy | None = None, cache: ShardCache | None = None) -> None:
        if policy is not None and not isinstance(policy, RemotePolicy):
            raise TypeError(f"remote must be a shmseq.remote.RemotePolicy or None, got {policy!r}")
        self.index = index
        self.storage_options = storage_options
        self.policy = policy
        self.cache = cache
        self.counters = remote.Counters()
        self._local = threading.local()
        self._every_thread: list[collections.OrderedDict[int, IO[bytes]]] = []

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_local": None, "_every_thread": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local())

    def _file(self, number: int) -> IO[bytes]:
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = collections.OrderedDict()
            self._every_thread.append(files)
        file = files.pop(number, None)
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
        shards, ordinals = self.index.locate(np.asarray(ids, np.int64))
        found: dict[tuple[int, int], dict] = {}
        try:
            for shard, run in _runs(sorted(set(zip(shards.tolist(), ordinals.tolist())))):
                found.update(self._read_run(shard, run))
        finally:
            if self.cache is not None:
                self._close_files(getattr(self._local, "files", {}))
        return [found[pair] for pair in zip(shards.tolist(), ordinals.tolist())]

    def _read_run(self, number: int, ordinals: list[int]) -> Iterator[tuple[tuple[int, int], dict]]:
        shard = self.index.shards[number]
        begin, end = shard.span(ordinals[0])[0], shard.span(ordinals[-1])[1]
        data = memoryview(self._read(number, begin, end))
        for ordinal in ordinals:
            start, stop = shard.span(ordinal)
            sample = _parse_members(data[start - begin:stop - begin], shard.url, start)
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
        """Close every thread's files (the workers have stopped); they reopen when read."""
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


def stack(samples: list, empty: Callable = np.empty) -> object:
    """Decoded samples as one batch: arrays stacked into ``empty(shape, dtype)`` (a slot's
    allocator, in a worker), ``bytes`` gathered into a ``Ragged`` leaf, tuples and dicts field
    by field."""
    first = samples[0]
    if isinstance(first, tuple):
        return tuple(stack([sample[i] for sample in samples], empty) for i in range(len(first)))
    if isinstance(first, dict):
        return {field: stack([sample[field] for sample in samples], empty) for field in first}
    if isinstance(first, bytes):
        return Ragged.from_items(samples)  # encoded images, say: each written once into the slot
    arrays = [np.asarray(sample) for sample in samples]
    if any(array.shape != arrays[0].shape for array in arrays):
        raise ValueError(f"decoded samples of shapes {sorted({a.shape for a in arrays})} cannot be "
                         "stacked into a batch: decode to one shape (crop or pad)")
    return np.stack(arrays, out=empty((len(arrays), *arrays[0].shape), arrays[0].dtype))


class ShardWorker:
    """``worker[ids]``: the samples of ``ids`` read from their shards, decoded by
    ``decode(sample) -> array or tuple/dict of arrays`` and stacked.

    ``on_error='raise'`` (default): a sample that cannot be read or decoded fails its batch
    with a ``ShardError`` naming the shard, the sample and its offset. ``'skip'``: the sample is
    left out of its batch (which is then smaller), and the consumer is told with a warning and
    ``stats.skipped_samples``; a batch left with no sample still fails.

    ``remote``: the timeout and retries of remote reads (``shmseq.remote``); what they did is
    counted and handed to the consumer's ``stats`` by ``pop_counts()``."""

    def __init__(self, shards: ShardIndex, decode: Callable[[dict], object], *,
                 on_error: str = "raise", storage_options: dict | None = None,
                 remote: RemotePolicy | None = None, cache: ShardCache | None = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, "
                             f"got {on_error!r}")
        self.reader = ShardReader(shards, storage_options, policy=remote, cache=cache)
        self.decode = decode
        self.on_error = on_error
        self._skipped: list[str] = []

    def __len__(self) -> int:
        return len(self.reader.index)

    def __getitem__(self, ids: np.ndarray) -> object:
        return self._batch(ids, np.empty)

    def fill_batch(self, ids: np.ndarray, out: SlotAllocator) -> object:
        """The batch stacked straight into the slot (``out``: its ``SlotAllocator``)."""
        return self._batch(ids, out.empty)

    def _batch(self, ids: np.ndarray, empty: Callable) -> object:
        ids = np.asarray(ids, np.int64)
        if self.on_error == "raise":
            return stack([self._decoded(sample) for sample in self.reader.read(ids)], empty)
        decoded = []
        for sample in self._readable(ids):
            try:
                decoded.append(self._decoded(sample))
            except ShardError as exc:
                self._skipped.append(str(exc))
        if not decoded:
            raise ShardError(f"every sample of the batch was left out: {'; '.join(self._skipped)}")
        return stack(decoded, empty)

    def _readable(self, ids: np.ndarray) -> list[dict]:
        """The samples of ``ids`` that can be read; when some cannot, the others are read one
        by one and each failure is noted as skipped."""
        try:
            return self.reader.read(ids)
        except ShardError:
            samples = []
            for sample_id in ids:
                try:
                    samples += self.reader.read(sample_id[None])
                except ShardError as exc:
                    self._skipped.append(str(exc))
            return samples

    def _decoded(self, sample: dict) -> object:
        try:
            return self.decode(sample)
        except Exception as exc:  # noqa: BLE001 - named with its shard and offset
            fields = ", ".join(field for field in sample if not field.startswith("__"))
            raise ShardError(f"shard {sample['__url__']}: sample {sample['__key__']} at byte "
                             f"{sample['__offset__']} (members: {fields}) does not decode: "
                             f"{type(exc).__name__}: {exc}") from exc

    def pop_skipped(self) -> list[str]:
        """What was left out since the last call (the worker loop reports it with the batch)."""
        skipped, self._skipped = self._skipped, []
        return skipped

    def pop_counts(self) -> dict:
        """The remote reads and the shard cache's counts since the last call, as ``LoaderStats``
        fields to add to (the worker loop sends them with each batch)."""
        counts = {f"remote_{name}": value for name, value in self.reader.counters.take().items()
                  if value}
        if self.reader.cache is not None:
            counts.update((name, value) for name, value in self.reader.cache.counters.take().items()
                          if value)
        return counts


class ShardPlan(EpochPlan):
    """The epoch's ids: shards in an order drawn from (seed, epoch), samples moved within
    ``shuffle_window`` places, dealt to the ranks batch by batch (rank r takes batches r,
    r + world_size, ...), so that the batches all ranks have taken after n steps are the first
    n * world_size of the epoch, whatever the number of workers. That prefix is what lets a run
    resume on another world size: the rest of the epoch is dealt anew (``resume_after``).

    With ``shuffle_shards`` (W) instead, the window is measured in shards: the shards, in the
    epoch's order, are dealt to W lanes in turn, each shard's samples shuffled within, and the
    lanes are read in a uniformly random interleaving. Every point of the stream, its first and
    last batches too, draws from W shards (one per lane: what a shard cache holds), and each
    shard is read in one stretch. ``on_release`` hears where the consumer is (a shard cache's
    prefetcher follows it)."""

    def __init__(self, index: ShardIndex, batch_size: int, *, shuffle_window: int = 1000,
                 shuffle_shards: int | None = None, **options: Any) -> None:
        super().__init__(np.arange(len(index), dtype=np.int64), batch_size, **options)
        self.shard_index = index
        self.shuffle_window = shuffle_window
        self.shuffle_shards = shuffle_shards
        self._consumed: dict[int, int] = {}  # epoch -> its first samples taken before a resume
        self.on_release: Callable[[int, int], None] | None = None

    def global_order(self, epoch: int) -> np.ndarray:
        """Every id of the epoch once, before dealing to ranks."""
        if not self.shuffle or not len(self.indices):
            return self.indices
        index = self.shard_index
        rng = np.random.default_rng([self.seed, epoch])
        shards = rng.permutation(len(index.shards))
        ids = np.concatenate([np.arange(index.starts[s], index.starts[s + 1]) for s in shards])
        if self.shuffle_shards is not None:
            places = np.repeat(np.arange(len(shards)), np.diff(index.starts)[shards])
            lanes = places % self.shuffle_shards
            in_lanes = ids[np.lexsort((rng.random(len(ids)), places, lanes))]  # shuffled within
            interleaved = np.argsort(rng.permutation(lanes), kind="stable")  # each lane's places
            ids = np.empty_like(ids)
            ids[interleaved] = in_lanes
        elif self.shuffle_window > 1:
            ids = ids[np.argsort(np.arange(len(ids)) + rng.uniform(0, self.shuffle_window, len(ids)),
                                 kind="stable")]
        return ids

    def release(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position``: told to ``on_release``."""
        if self.on_release is not None:
            self.on_release(epoch, position)

    def consumed(self, epoch: int) -> int:
        """How many of ``epoch``'s first samples (of its global order) a run before took."""
        return self._consumed.get(epoch, 0)

    def resume_after(self, epoch: int, consumed: int) -> None:
        """Deal only what follows the first ``consumed`` samples of ``epoch`` (every rank of
        the run that stopped had taken those), over this plan's ranks."""
        if consumed and self.last_batch == "rollover":
            raise ValueError("last_batch='rollover' carries samples across epochs: a stream "
                             "resumes on another world size with 'keep' or 'discard' only")
        self._consumed = {epoch: consumed} if consumed else {}
        self.version += 1

    def _per_rank(self, epoch: int) -> int:
        total = len(self.indices) - self.consumed(epoch)
        return total // self.world_size if self.last_batch == "discard" else -(-total // self.world_size)

    def length(self, epoch: int) -> int:
        if not self.consumed(epoch):
            return super().length(epoch)
        samples = self._per_rank(epoch)
        return samples // self.batch_size if self.last_batch == "discard" else -(-samples // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        ids = self.global_order(epoch)[self.consumed(epoch):]
        if self.world_size == 1 or not len(ids):
            return ids
        per_rank, size = self._per_rank(epoch), self.batch_size
        dealt = np.resize(ids, per_rank * self.world_size)  # wraps (pads), or cuts
        full = per_rank // size * size  # each rank's samples in whole batches
        rounds = dealt[:full * self.world_size].reshape(-1, self.world_size, size)
        tail = dealt[full * self.world_size:].reshape(self.world_size, -1)
        return np.concatenate([rounds[:, self.rank].reshape(-1), tail[self.rank]])


def as_shard_index(shards: ShardIndex | str | os.PathLike | Iterable[str | os.PathLike],
                   storage_options: dict | None = None) -> ShardIndex:
    """A ``ShardIndex``; an index file's path or URL (``.json``); or shard URLs, scanned."""
    if isinstance(shards, ShardIndex):
        return shards
    if isinstance(shards, (str, os.PathLike)):
        url = os.fspath(shards)
        if url.endswith(".json"):
            return ShardIndex.load(url, storage_options)
        shards = [url]
    return ShardIndex.scan([os.fspath(url) for url in shards], storage_options)


CACHED_RING_SLOTS = 10  # a cached sequence's ring without a buffer given: the cache's room is
# checked for what so many slots may be reading, which a ring counted as it runs would not bound


def batches_in_flight(buffer: int, num_workers: int) -> int:
    """How many batches in a row a sequence's workers may be reading at once (``buffer`` slots,
    one being built by each worker, and one more): what its shard cache must hold room for."""
    return (buffer + num_workers if num_workers else 0) + 1


class ShardSequence(ShmSequence):
    """A ``ShmSequence`` over tar shards: ``decode(sample)`` turns each sample (a dict of its
    members' bytes by field, e.g. ``sample["jpg"]``, plus ``__key__``, ``__url__`` and
    ``__offset__``, ``__id__``) into an array or a tuple/dict of arrays (or ``bytes``), stacked
    into the batch (``bytes`` as one ragged leaf, see ``shmseq.engine.common.ragged``).

    Args:
        shards: an index file (``shards.json`` from ``write_shards`` or ``ShardIndex.save``),
            shard paths or URLs (scanned when the sequence is made), or a ``ShardIndex``.
        decode: called in the workers, once per sample.
        shuffle_window: how many places a sample may move from its shard's order (with
            ``shuffle``); 1 keeps the shard's order. The default for local shards (1000).
        shuffle_shards: instead, over how many shards a shard's samples are spread (see
            ``ShardPlan``): the default for remote shards (8), whose cache holds that many.
        cache: read the shards from the node's shard cache (``shmseq.shard_cache``), each
            fetched whole once per node; None: for remote shards, unless ``shuffle_window``
            is given (a window of samples reads them where they lie).
        cache_dir: where the cache's folders go (default ``$TMPDIR``, else /var/tmp).
        cache_bytes: the cache's budget (default: the whole data set, at most half of the free
            space of ``cache_dir``'s file system); one that cannot hold what ``buffer +
            num_workers + 1`` batches in a row read is refused at ``start()`` (``buffer``
            defaults to 10 with the cache, ``num_workers`` counts as ``max_workers`` with
            ``'auto'``).
        job: the job the cache belongs to (default: ``SLURM_JOB_ID``, else torchrun's
            ``TORCHELASTIC_RUN_ID``, else "default").
        on_error: ``'raise'`` a ``ShardError`` naming the shard, sample and offset, or
            ``'skip'`` the sample with a ``SkippedSamplesWarning``, counted in ``stats``.
        storage_options: passed to fsspec for URLs (credentials, ...).
        remote: a ``shmseq.remote.RemotePolicy``: the timeout of each remote request and the
            retries of transient failures (default ``RemotePolicy()``: 30 s, 5 attempts, with a
            ``deadline`` of a third of ``timeout``, so that a server that stalls is named before
            a batch times out; one given whose ``worst_case()`` is longer is refused: see
            ``remote.fit_to_timeout``); ``stats`` counts the requests, bytes, retries and time
            spent waiting on them.
        options: ``ShmSequence``'s (``batch_size``, ``num_workers``, ``seed``, ``rank``, ...).
            Every rank gets as many batches: ``last_batch='discard'`` cuts the epoch to a
            multiple of the world size, otherwise it is padded with its first samples.
    """

    worker: ShardWorker
    _plan: ShardPlan

    def __init__(self, shards: ShardIndex | str | os.PathLike | Iterable[str | os.PathLike],
                 decode: Callable[[dict], object], *,
                 shuffle_window: int | None = None, shuffle_shards: int | None = None,
                 cache: bool | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | None = None, job: str | None = None, on_error: str = "raise",
                 storage_options: dict | None = None, remote: RemotePolicy | None = None,
                 **options: Any) -> None:
        check_int("shuffle_window", shuffle_window, 1, optional=True)
        check_int("shuffle_shards", shuffle_shards, 1, optional=True)
        check_bool("cache", cache, optional=True)
        check_int("cache_bytes", cache_bytes, 1, optional=True)
        if shuffle_window is not None and shuffle_shards is not None:
            raise ValueError(f"shuffle_window={shuffle_window} and shuffle_shards={shuffle_shards} "
                             "are two ways to bound the shuffle: give one of them")
        index = as_shard_index(shards, storage_options)
        far = any(is_remote(shard.url) for shard in index.shards)
        if shuffle_window is None and shuffle_shards is None:
            shuffle_window, shuffle_shards = ((None, SHUFFLE_SHARDS) if far else
                                              (SHUFFLE_WINDOW, None))
        self.shuffle_window, self.shuffle_shards = shuffle_window, shuffle_shards
        if cache is None:
            cache = far and shuffle_window is None
        if not cache:
            given = [name for name, value in (("cache_dir", cache_dir), ("cache_bytes", cache_bytes),
                                              ("job", job)) if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} set the shard cache, which is off for these "
                                 f"shards ({'a window of samples' if far else 'local files'}): "
                                 "pass cache=True to read them through it")
        self.cache = ShardCache(index, cache_dir, job, cache_bytes, storage_options=storage_options,
                                policy=remote) if cache else None
        worker = ShardWorker(index, decode, on_error=on_error, storage_options=storage_options,
                             remote=remote, cache=self.cache)
        self._prefetcher: weakref.finalize | None = None
        if cache and options.get("buffer") is None:
            options["buffer"] = CACHED_RING_SLOTS
        super().__init__(worker, len(index), **options)
        policy = fit_to_timeout(remote, self.timeout)  # a stalled server named before the timeout
        self.worker.reader.policy = policy
        if self.cache is not None:
            self.cache.timeout, self.cache.policy = self.timeout, policy

    def _make_plan(self, dset_size: ArrayLike, batch_size: int, shuffle: bool, last_batch: str,
                   rank: int | None, world_size: int | None) -> ShardPlan:
        return ShardPlan(self.worker.reader.index, batch_size,
                         shuffle_window=self.shuffle_window or SHUFFLE_WINDOW,
                         shuffle_shards=self.shuffle_shards, shuffle=bool(shuffle), seed=self._seed,
                         last_batch=last_batch, rank=rank, world_size=world_size,
                         seed_given=self._seed_given)

    def start(self, compat: object = None) -> Self:
        """As ``ShmSequence.start``; with the cache, its room is checked first (a budget too
        small for what the batches in flight read is refused here), and this rank's prefetcher
        starts with the workers."""
        if self.cache is None:
            return super().start(compat)
        depth = self._prepare_cache()
        prefetcher = Prefetcher(self.cache, self._plan, self.epoch, self._resume_at, depth,
                                self.worker.reader.counters)
        try:
            super().start(compat)
        except BaseException:
            prefetcher.close()
            raise
        # closed by finish(), or with the sequence if nobody references it any more
        self._prefetcher = weakref.finalize(self, prefetcher.close)
        prefetcher.start()
        self.cache.count_held()
        return self

    def start_test(self, test_mode: str = "default") -> Self:
        if self.cache is None:
            return super().start_test(test_mode)
        self._prepare_cache()
        super().start_test(test_mode)
        self.cache.count_held()
        return self

    def _prepare_cache(self) -> int:
        """The cache's folder and budget, its room checked; how many batches may be in flight."""
        self.finish()
        assert self.cache is not None  # read through the cache
        self.cache.prepare()
        self._plan.refresh()
        assert self.buffer is not None  # a cached sequence's ring has a buffer (__init__)
        workers = self.max_workers if self.max_workers is not None else self.num_workers
        depth = batches_in_flight(self.buffer, cast(int, workers))
        check_room(self.cache, self._plan, self.epoch, self._resume_at, depth,
                   f"batch_size={self.batch_size}, buffer={self.buffer}, "
                   f"num_workers={self.num_workers}, " + (
                       f"shuffle_shards={self.shuffle_shards}" if self.shuffle_shards else
                       f"shuffle_window={self.shuffle_window}"))
        return depth

    @property
    def stats(self) -> LoaderStats:
        """``ShmSequence``'s, with the shard cache's counts (``shard_fetches``, ...)."""
        stats = super().stats
        if self.cache is not None:
            stats.add_counts(self.worker.pop_counts())  # this process's: the prefetcher's
        return stats

    def finish(self) -> None:
        super().finish()
        closer, self._prefetcher = self._prefetcher, None
        if closer is not None:
            closer()
        if self.cache is not None:
            self._stats.add_counts(self.worker.pop_counts())
            self.cache.release()
        self.worker.reader.close()  # the files read in this process, by num_workers=0 or threads

    def state_dict(self) -> dict:
        """``ShmSequence``'s state, plus the window and the samples of the epoch that runs
        before a resume on another world size had taken."""
        state = super().state_dict()
        return {**state, "shuffle_window": self.shuffle_window,
                "shuffle_shards": self.shuffle_shards,
                "consumed_before": self._plan.consumed(state["epoch"])}

    def load_state_dict(self, state: dict) -> None:
        """As ``ShmSequence``'s; a state saved on another world size resumes too: every rank
        had taken the epoch's first ``position x world_size`` batches, and the rest of the
        epoch is dealt over this run's ranks (the global sample order is kept)."""
        for name in ("shuffle_window", "shuffle_shards"):
            if state.get(name, getattr(self, name)) != getattr(self, name):
                raise ValueError(f"state {name}={state[name]!r} does not match this sequence's "
                                 f"{name}={getattr(self, name)!r}: build the sequence as the "
                                 "saved one was")
        self._plan.refresh()
        consumed, saved_ranks = state.get("consumed_before", 0), state.get("world_size", 1)
        if saved_ranks != self._plan.world_size:
            consumed += state["position"] * saved_ranks * state["batch_size"]
            state = {**state, "world_size": self._plan.world_size, "position": 0}
        self._plan.resume_after(int(state["epoch"]), consumed)
        super().load_state_dict(state)
