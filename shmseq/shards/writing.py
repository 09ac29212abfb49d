"""Writing shards: samples packed into tar files (``write_shards``), in one process or in several
at once for a sequence of samples, and their index written beside them; ``image_folder_samples``
reads an image folder as such samples.
"""
from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import io
import os
import tarfile
from typing import Iterable

import numpy as np

from ..checks import check_int
from .index import Shard, ShardIndex, shard_digests
from .progress import Bar, length_of, progress_bar


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
    with progress_bar(progress, length_of(samples), "samples", "writing shards") as bar:
        if parallel > 1:
            assert isinstance(samples, collections.abc.Sequence)  # parallel: a sequence
            shards = _write_in_processes(samples, pattern, samples_per_shard, parallel, bar)
        else:
            shards = _write_in_turn(samples, pattern, samples_per_shard, bar)
    written = ShardIndex(shards)
    written.save(index or os.path.join(os.path.dirname(pattern % 0) or ".", "shards.json"))
    return written


def _parallel(processes: int | None, count: int, samples_per_shard: int) -> int:
    """How many processes write the shards of ``count`` samples."""
    shards = max(-(-count // samples_per_shard), 1)
    wanted = len(os.sched_getaffinity(0)) if processes is None else processes
    return min(wanted, shards)


def _write_in_turn(samples: Iterable[dict], pattern: str, samples_per_shard: int,
                   bar: Bar) -> list[Shard]:
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
                        processes: int, bar: Bar) -> list[Shard]:
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
        size, sha256, digests = shard_digests(written, np.asarray(offsets, np.int64), end)
    return Shard(path, np.asarray(offsets, np.int64), end, size, sha256, digests)


class image_folder_samples(collections.abc.Sequence):
    """An image folder (``root/<class>/<image>``, as ``ImageFolderWorker`` reads it) as
    samples for ``write_shards``: the encoded file under its extension and the label as
    ``cls``, in the folder's order. A sequence: ``write_shards`` reads its files in as many
    processes as it writes shards with."""

    def __init__(self, root: str | os.PathLike) -> None:
        from ..vision import ImageFolder
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
