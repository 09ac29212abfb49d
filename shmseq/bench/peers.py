"""The streaming bench's peers (``--streaming --remote``, where they are installed: ``pip install
'shmseq[peers]'``): litdata, MosaicML streaming and WebDataset reading the same samples from the
same servers as shmseq, each its own recommended way, with the same decode and 2 workers.

* ``litdata-s3``: the samples written with ``litdata.optimize`` into its chunks (as many samples
  a chunk as the tar shards have), uploaded to the S3 endpoint, read with ``StreamingDataset``
  (``shuffle=True``, ``drop_last=True``, the decode as its ``transform``) and
  ``StreamingDataLoader``. litdata reads object stores and local folders, no plain HTTP.
* ``mosaic-s3``: the samples written with ``MDSWriter`` into MDS shards (of the tar shards'
  size), uploaded, read with a ``StreamingDataset`` whose ``__getitem__`` decodes (its own
  pattern) and torch's ``DataLoader``; its S3 client finds the endpoint in ``S3_ENDPOINT_URL``.
  It reads object stores and SFTP, no plain HTTP.
* ``webdataset-http``, ``webdataset-s3``: the very tar shards shmseq reads, through
  ``WebDataset(urls, shardshuffle=...)`` ``.shuffle(1000)`` (the buffer its docs use)
  ``.map(decode).batched(batch)`` and torch's ``DataLoader(batch_size=None)``; over HTTP with curl
  (its default for ``http://``), over S3 with ``pipe:aws s3 cp`` (its documented route).

Every peer starts from an empty cache folder of its own each run (cold); the caches that have a
budget get shmseq's. Each peer is imported only where it runs.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator
from unittest import mock

import numpy as np

from shmseq._apps.data import made_once
from shmseq.shards import ShardIndex, ShardReader

from . import systems
from .streaming_workloads import SEED, Prepared
from .workloads import BatchMismatch

PEERS = ("litdata", "mosaic", "webdataset")
MODULES = {"litdata": "litdata", "mosaic": "streaming", "webdataset": "webdataset"}
PINNED = {"litdata": "0.2.76", "mosaic": "0.13.0", "webdataset": "1.0.2"}  # as measured
CANNOT_READ = {
    ("litdata", "http"): "litdata reads s3://, gs://, azure://, hf://, r2:// and local folders, "
                         "no plain HTTP",
    ("mosaic", "http"): "MosaicML streaming reads s3, gs, oci, azure, hf, sftp and dbfs remotes, "
                        "no plain HTTP"}
SHUFFLE_BUFFER = 1000  # WebDataset's sample buffer, as its docs shuffle
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}  # moto's test credentials


def peer_of(name: str) -> str | None:
    """The peer a system's name is of (``litdata-s3``: ``litdata``), None for shmseq's own."""
    loader = name.split("-", 1)[0]
    return loader if loader in PEERS else None


def system_names(backends: tuple[str, ...] | list[str]) -> list[str]:
    """Each peer over each backend it can read."""
    return [f"{peer}-{backend}" for backend in backends for peer in PEERS
            if (peer, backend) not in CANNOT_READ]


@functools.cache
def missing(peer: str) -> str | None:
    """Why a peer cannot run here (not installed, or its import fails), None where it can."""
    try:
        importlib.import_module(MODULES[peer])
    except ModuleNotFoundError as exc:
        if exc.name != MODULES[peer]:
            return f"{MODULES[peer]} does not import: {exc}"
        return f"not installed (pip install 'shmseq[peers]', or {MODULES[peer]} itself)"
    except Exception as exc:  # noqa: BLE001 - said in the report, where the peer's row would be
        return f"{MODULES[peer]} does not import: {type(exc).__name__}: {exc}"
    return None


# -- the peers' own formats, written once beside the tar shards ---------------------------------
def formats(prepared: dict[str, Prepared], root: Path, peers: set[str],
            folders: dict[str, Path]) -> dict[str, Path]:
    """Each workload's samples in the formats of ``peers`` that have one (litdata's chunks,
    MosaicML's MDS), made once under ``root`` (reused as the tar shards are), by bucket name
    (``<workload>-<peer>``)."""
    writers: dict[str, Callable[[Prepared, Path, Path], None]] = {
        "litdata": _litdata_chunks, "mosaic": _mds_shards}
    return {f"{name}-{peer}": made_once(root / f"{folders[name].name}-{peer}",
                                        functools.partial(writers[peer], ready, folders[name]))
            for name, ready in prepared.items() for peer in sorted(peers & set(writers))}


def shard_samples(folder: Path, number: int) -> Iterator[dict]:
    """The samples of one tar shard, their members as bytes (no ``__`` fields): what every
    format stores and every peer decodes."""
    index = ShardIndex.load(str(folder / "shards.json"))
    first = sum(len(shard.offsets) for shard in index.shards[:number])
    for sample in ShardReader(index).read(np.arange(first, first + len(index.shards[number].offsets))):
        yield {key: value for key, value in sample.items() if not key.startswith("__")}


def _litdata_chunks(prepared: Prepared, shards: Path, out: Path) -> None:
    import litdata
    litdata.optimize(fn=functools.partial(shard_samples, shards),
                     inputs=list(range(len(prepared.index.shards))), output_dir=str(out),
                     chunk_size=prepared.workload.samples_per_shard, num_workers=1)


def _mds_shards(prepared: Prepared, shards: Path, out: Path) -> None:
    from streaming import MDSWriter
    first = next(shard_samples(shards, 0))
    size = max(os.path.getsize(shard.url) for shard in prepared.index.shards)
    with MDSWriter(out=str(out), columns={key: "bytes" for key in first}, size_limit=size) as writer:
        for number in range(len(prepared.index.shards)):
            for sample in shard_samples(shards, number):
                writer.write(sample)


# -- the runs -------------------------------------------------------------------------------------
@contextlib.contextmanager
def batches(peer: str, prepared: Prepared, url: str, storage_options: dict | None,
            cache_bytes: int) -> Iterator[Iterator]:
    """A peer's batches over ``url`` (its format's folder, or the tar shards' index), epoch after
    epoch, its cache in a fresh folder of ``cache_bytes``; its workers stopped after the block."""
    endpoint = (storage_options or {}).get("client_kwargs", {}).get("endpoint_url")
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"shmseq-bench-{peer}-"))
        stack.enter_context(mock.patch.dict(os.environ, {
            **CREDENTIALS, **({"S3_ENDPOINT_URL": endpoint} if endpoint else {})}))
        if peer == "litdata" and endpoint and endpoint.startswith("http://"):
            stack.enter_context(_litdata_through_boto3())
        loader = LOADERS[peer](prepared, url, endpoint, cache, cache_bytes)
        try:
            yield itertools.chain.from_iterable(map(iter, itertools.repeat(loader)))
        finally:
            if loader._iterator is not None:  # its persistent workers, as DataLoader's __del__
                loader._iterator._shutdown_workers()


def _litdata_through_boto3() -> ContextManager:
    """litdata fetches its chunks with obstore where it is installed, whose client it gives no
    ``allow_http``: against a plain-HTTP S3 endpoint (moto's, here) that client refuses every
    request, so litdata reads through boto3 there, its own path where obstore is absent."""
    from litdata.streaming import downloader
    return mock.patch.object(downloader, "_OBSTORE_AVAILABLE", False)


def _loader_options() -> dict:
    """What every peer's torch loader is given: 2 workers, kept across epochs, forked."""
    return {"num_workers": systems.NUM_WORKERS, "persistent_workers": True,
            "multiprocessing_context": systems.START_METHOD}


def _litdata(prepared: Prepared, url: str, endpoint: str | None, cache: str,
             cache_bytes: int) -> Any:
    import litdata
    options = {"endpoint_url": endpoint, "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
               "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
    dataset = litdata.StreamingDataset(url, cache_dir=cache, storage_options=options, shuffle=True,
                                       drop_last=True, seed=SEED, transform=prepared.decode,
                                       max_cache_size=cache_bytes)
    return litdata.StreamingDataLoader(dataset, batch_size=prepared.workload.batch_size,
                                       **_loader_options())


def _mosaic(prepared: Prepared, url: str, endpoint: str | None, cache: str,
            cache_bytes: int) -> Any:
    import torch.utils.data
    from streaming import StreamingDataset

    class Decoded(StreamingDataset):
        def __getitem__(self, at: Any) -> Any:
            return prepared.decode(super().__getitem__(at))

    batch = prepared.workload.batch_size
    dataset = Decoded(remote=url, local=cache, shuffle=True, shuffle_seed=SEED, batch_size=batch,
                      cache_limit=cache_bytes)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, drop_last=True,
                                       **_loader_options())


def _webdataset(prepared: Prepared, url: str, endpoint: str | None, cache: str,
                cache_bytes: int) -> Any:
    """No cache: WebDataset streams each shard as it reads it. Its ``WebLoader`` is torch's
    ``DataLoader`` with methods to chain more stages after it; with none chained, the
    ``DataLoader`` itself (whose workers ``batches`` stops)."""
    import torch.utils.data
    import webdataset
    base = url.rsplit("/", 1)[0]
    names = [Path(shard.url).name for shard in prepared.index.shards]
    urls = ([f"{base}/{name}" for name in names] if endpoint is None else
            [f"pipe:aws s3 cp --quiet --endpoint-url {endpoint} {base}/{name} -" for name in names])
    dataset = (webdataset.WebDataset(urls, shardshuffle=len(urls), seed=SEED)
               .shuffle(SHUFFLE_BUFFER).map(prepared.decode)
               .batched(prepared.workload.batch_size, partial=False))
    return torch.utils.data.DataLoader(dataset, batch_size=None, **_loader_options())


LOADERS: dict[str, Callable[..., Any]] = {"litdata": _litdata, "mosaic": _mosaic,
                                          "webdataset": _webdataset}


def checker(prepared: Prepared) -> Callable[[int, object], None]:
    """``check(k, batch)`` for a loader with an order of its own: full batches of the workload's
    images, each sample once an epoch (an epoch of the plan's length, so that, with no sample
    repeated, every one came)."""
    workload = prepared.workload
    length = workload.plan(prepared.index).length(0)
    shape = (workload.batch_size, *workload.image_shape)
    seen: set[int] = set()

    def check(k: int, batch: Any) -> None:
        images, labels = (np.asarray(part) for part in batch)
        if k % length == 0:
            seen.clear()
        if images.shape != shape or images.dtype != np.uint8:
            raise BatchMismatch(f"{workload.name} batch {k}: images {images.dtype}{images.shape}")
        fresh = set(labels.tolist())
        if len(fresh) != len(labels) or seen & fresh:
            raise BatchMismatch(f"{workload.name} batch {k}: a sample came twice in epoch "
                                f"{k // length}")
        seen.update(fresh)
    return check
