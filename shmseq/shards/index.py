"""A shard index: each shard's URL, the byte offset where each of its samples begins, where
the last ends, the whole file's size and SHA-256 (version 2), and each sample's own digest
(version 3: a sample read before its whole shard is in is checked against it). With it every
sample has a global id (shard after shard); ``scan`` makes one from shards, ``save``/``load``
keep it as JSON.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from typing import IO, Callable, Iterable

import numpy as np

from .. import remote
from ..remote import is_remote
from .files import DIGEST_CHUNK_BYTES
from .progress import length_of, progress_bar, samples_found
from .tar import BLOCK, ShardError, key_and_field


INDEX_VERSION = 3     # written; 1 (no shard sizes or checksums) and 2 (no samples' digests) are read too
READ_VERSIONS = (1, 2, 3)
SAMPLE_DIGEST_BYTES = 16  # of a sample's SHA-256: 128 bits tell a changed sample from its own


def sample_digest(data: bytes | memoryview) -> bytes:
    """A sample's digest, as the index keeps it: the first bytes of its span's SHA-256."""
    return hashlib.sha256(data).digest()[:SAMPLE_DIGEST_BYTES]


def open_url(url: str, storage_options: dict | None = None) -> IO[bytes]:
    """A binary file object for a local path or any fsspec URL (see ``shmseq.remote``)."""
    return remote.open_file(url, storage_options)


@dataclass(frozen=True)
class Shard:
    """One tar file: where each of its samples begins, where the last one ends, and, in an
    index written or scanned since version 2, the whole file's size and SHA-256 (a shard cache
    checks every copy against them); since version 3, each sample's digest too (a sample read
    while its shard is being fetched is checked against it)."""
    url: str
    offsets: np.ndarray  # int64: the byte offset of each sample's first member header
    end: int             # the byte offset just past the last sample's last member
    size: int | None = None    # the whole file's bytes (a tar writer's tail included)
    sha256: str | None = None  # the whole file's, in hex
    digests: bytes | None = None  # each sample's ``sample_digest``, one after another

    def __post_init__(self) -> None:
        if self.digests is not None and len(self.digests) != SAMPLE_DIGEST_BYTES * len(self.offsets):
            raise ValueError(f"the index entry of shard {self.url} has {len(self.digests):,} bytes "
                             f"of samples' digests for {len(self.offsets):,} samples (it needs "
                             f"{SAMPLE_DIGEST_BYTES} each): the index is damaged; scan the "
                             "shards again")

    def __len__(self) -> int:
        return len(self.offsets)

    def digest(self, ordinal: int) -> bytes | None:
        """Sample ``ordinal``'s digest (None in an index before version 3)."""
        if self.digests is None:
            return None
        return self.digests[ordinal * SAMPLE_DIGEST_BYTES:(ordinal + 1) * SAMPLE_DIGEST_BYTES]

    def span(self, ordinal: int) -> tuple[int, int]:
        """The bytes of sample ``ordinal``: its members' headers and data."""
        stop = self.offsets[ordinal + 1] if ordinal + 1 < len(self.offsets) else self.end
        return int(self.offsets[ordinal]), int(stop)

    def run_span(self, ordinals: tuple[int, ...]) -> tuple[int, int]:
        """The bytes of a run of neighbouring samples (``ordinals`` ascending, one apart)."""
        return self.span(ordinals[0])[0], self.span(ordinals[-1])[1]


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
        with progress_bar(progress, length_of(urls), "shards", "scanning shards") as bar:
            for url in urls:
                shards.append(_scan_shard(url, storage_options, samples_found(bar, url)))
                bar.update(1)
        return cls(shards)

    @classmethod
    def load(cls, url: str, storage_options: dict | None = None) -> "ShardIndex":
        """An index saved by ``save``; shard URLs in it that are relative are taken relative
        to the index's own location."""
        saved = _saved(url, storage_options)
        if saved.get("version") not in READ_VERSIONS:
            raise ValueError(f"{url} is not a shard index of version {INDEX_VERSION} "
                             f"(it says version {saved.get('version')!r}): scan the shards again")
        if is_remote(url):
            _refuse_local_entries(url, saved["shards"])
        base = url.rsplit("/", 1)[0] if "/" in url else "."
        return cls(Shard(_joined(base, entry["url"]), np.asarray(entry["offsets"], np.int64),
                         int(entry["end"]), entry.get("size"), entry.get("sha256"),
                         _decoded(entry.get("sample_sha256")))
                   for entry in saved["shards"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the index as JSON; shard paths under its folder are kept relative to it."""
        folder = os.path.dirname(os.path.abspath(path))
        entries = [{"url": _relative(shard.url, folder), "offsets": shard.offsets.tolist(),
                    "end": shard.end, "size": shard.size, "sha256": shard.sha256,
                    "sample_sha256": _encoded(shard.digests)}
                   for shard in self.shards]
        with open(path, "w") as file:
            json.dump({"version": INDEX_VERSION, "shards": entries}, file)


def _encoded(digests: bytes | None) -> str | None:
    return None if digests is None else base64.b64encode(digests).decode()


def _decoded(digests: str | None) -> bytes | None:
    return None if digests is None else base64.b64decode(digests, validate=True)


def shard_digests(file: IO[bytes], offsets: np.ndarray, end: int) -> tuple[int, str, bytes]:
    """(size, SHA-256 in hex, each sample's ``sample_digest``) of a shard whose samples begin
    at ``offsets`` and end at ``end``, read once from its start in chunks (a remote shard is
    read once)."""
    file.seek(0)
    whole, size, digests = hashlib.sha256(), 0, []
    stops = np.append(offsets[1:], end).astype(np.int64)
    sample, current = 0, hashlib.sha256()
    while chunk := file.read(DIGEST_CHUNK_BYTES):
        whole.update(chunk)
        view, begin = memoryview(chunk), size
        size += len(chunk)
        while sample < len(offsets):
            low, high = max(int(offsets[sample]), begin), min(int(stops[sample]), size)
            if low < high:
                current.update(view[low - begin:high - begin])
            if stops[sample] > size:
                break
            digests.append(current.digest()[:SAMPLE_DIGEST_BYTES])
            sample, current = sample + 1, hashlib.sha256()
    if sample < len(offsets):
        raise ShardError(f"the shard ends at byte {size:,}, before its sample at byte "
                         f"{int(offsets[sample]):,} ends (byte {int(stops[sample]):,})")
    return size, whole.hexdigest(), b"".join(digests)


def _saved(url: str, storage_options: dict | None) -> dict:
    """A saved index's JSON; a remote one fetched whole first, as a cache fetches a shard (one
    streamed GET over HTTP or S3: no client library's start-up before a loader's first batch)."""
    if not is_remote(url):
        with open_url(url) as file:
            return json.load(file)
    with tempfile.TemporaryDirectory(prefix="shmseq-index-") as folder:
        path = os.path.join(folder, "index.json")
        remote.fetch(url, path, storage_options=storage_options)
        with open(path, "rb") as file:
            return json.load(file)


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
                member_key, _ = key_and_field(member.name)
                if member_key != key:
                    offsets.append(member.offset)
                    key = member_key
                    if found is not None:
                        found(len(offsets))
                end = member.offset_data + -(-member.size // BLOCK) * BLOCK
            size, sha256, digests = shard_digests(file, np.asarray(offsets, np.int64), end)
    except (OSError, tarfile.TarError, ShardError) as exc:
        raise ShardError(f"cannot index shard {url}: {type(exc).__name__}: "
                         f"{remote.reason(exc, url)}") from exc
    return Shard(url, np.asarray(offsets, np.int64), end, size, sha256, digests)


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
