"""The streaming bench's remote mode (``--streaming --remote``): the same shards read from local
disk, over HTTP and over S3, by shmseq and by torch's ``DataLoader``.

The servers are ``shmseq.bench.servers``' (werkzeug's threaded server; moto's S3 on it), on
127.0.0.1, each in a process of its own (its CPU and memory are not the trainer's), with
``delay`` seconds added to every request and an optional bandwidth cap. The shards are made
with ``SAMPLES_PER_SHARD`` samples each and their shuffle bounded in shards (``shuffle_shards``,
``ShardSequence``'s default for remote shards), for every system, so that all read one stream:

* ``shmseq-local``: ``ShardSequence`` over the local shards, read where they lie.
* ``shmseq-http``, ``shmseq-s3``: ``ShardSequence`` over the index's URL, through the node's
  shard cache (each shard fetched whole, once per node), in a fresh folder each run, with a
  budget of ``--cache-fraction`` of the set (raised to what the batches in flight read, where
  that is more): a data set larger than the node's cache, so that every epoch streams from
  the server.
* ``torch-local``, ``torch-http``, ``torch-s3``: torch's ``DataLoader`` over a ``ShardWorker``
  of the same index, which reads each batch's samples where they lie, a range request per run
  of neighbouring samples: what a torch user gets from the same shards.

Beside them, where installed, the peers (``peers``: ``litdata-s3``, ``mosaic-s3``,
``webdataset-http``, ``webdataset-s3``), each its own recommended way over the same servers, and
``peers_report``'s table of them beside shmseq: the first epoch from a cold cache, the steady
rate after it, the first batch.

Each remote run's window is observed from the server's log, cleared as the window starts:
requests per sample delivered and bytes sent over the bytes of those samples. shmseq's windows
span whole epochs. Beside them, in every repeat, each endpoint's ceiling (``ceiling-http``,
``ceiling-s3``): every shard fetched whole by ``FETCH_THREADS`` threads (the cache's
prefetcher's), with no loader.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator

import numpy as np

from shmseq import remote
from shmseq.shards.cache import estimated_bytes
from shmseq.shards.prefetch import FETCH_THREADS, room_needed
from shmseq.shards import SHUFFLE_SHARDS, ShardIndex, batches_in_flight

from . import memory, peers, peers_report, systems
from .report import Cell
from .runner import Run, Window, timed_run
from .streaming import (Expected, Prepared, ShardWorkload, checker, cpu_out, images_per_s, paired,
                        ratios, shard_sequence, started, torch_shards)
from .streaming_report import less_or_more, present, ratio_text

if TYPE_CHECKING:
    from shmseq.shards import ShardSequence

    from .servers import ServerProcess

BACKENDS = ("http", "s3")
LOCAL = "local"
CEILING = "ceiling"  # the endpoint alone, timed as a system (as the limit is)
LOADERS = ("shmseq", "torch")
SYSTEM_NAMES = [*(f"{CEILING}-{backend}" for backend in BACKENDS),
                *(f"{loader}-{source}" for source in (LOCAL, *BACKENDS) for loader in LOADERS)]
TORCH_SYSTEM_NAMES = [name for name in SYSTEM_NAMES if name.startswith("torch-")]
SAMPLES_PER_SHARD = 64      # one request a shard per 64 samples: 0.016 a sample
IMAGES, QUICK_IMAGES = 8192, 2048  # 128 and 32 shards: the cache's need is 25 of them
CACHE_FRACTION = 0.25
DELAY_MS = 30.0
NEEDS = {"http": ("werkzeug", "fsspec", "aiohttp"),
         "s3": ("werkzeug", "moto", "boto3", "fsspec", "aiohttp", "s3fs")}


def system(loader: str, source: str) -> str:
    return f"{loader}-{source}"


def source_of(name: str) -> str:
    """``local``, ``http`` or ``s3``: where a system reads its shards."""
    return name.split("-", 1)[1]


def workload(base: ShardWorkload, images: int) -> ShardWorkload:
    """``base``'s samples in shards of ``SAMPLES_PER_SHARD``, shuffled within
    ``SHUFFLE_SHARDS`` shards (the remote default), ``images`` of them."""
    return replace(base, images=images, samples_per_shard=SAMPLES_PER_SHARD,
                   shuffle_shards=SHUFFLE_SHARDS)


def missing(backend: str) -> list[str]:
    """The packages a backend needs that are not installed."""
    return [name for name in NEEDS[backend] if importlib.util.find_spec(name) is None]


# -- the cache's budget ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """A workload's cache budget: ``fraction`` (asked) of the set's ``set_bytes`` (what the
    cache counts: each shard and its tar tail), unless the cache ``needs`` more."""

    fraction: float
    set_bytes: int
    needs: int

    @property
    def bytes(self) -> int:
        return max(math.ceil(self.fraction * self.set_bytes), self.needs)

    @property
    def raised(self) -> bool:
        return self.bytes > math.ceil(self.fraction * self.set_bytes)

    def describe(self, name: str) -> str:
        share = self.bytes / self.set_bytes
        said = (f"{name}: shard cache budget {self.bytes / 1e6:,.0f} MB, {share:.2f} of the set's "
                f"{self.set_bytes / 1e6:,.0f} MB")
        if not self.raised:
            return said + f" (--cache-fraction {self.fraction:g})"
        said += (f", raised from --cache-fraction {self.fraction:g}: what "
                 f"{batches_in_flight(systems.IN_FLIGHT, systems.NUM_WORKERS)} batches in flight "
                 "read at most, and one shard being fetched")
        if self.bytes >= self.set_bytes:
            said += (" (the whole set: the epochs after the first are read from the cache, not "
                     "the server; more --images give a set larger than the cache)")
        return said


def budget(prepared: Prepared, fraction: float) -> Budget:
    """The workload's budget: ``fraction`` of the set, or what the cache needs with the
    sequence's batches in flight if more (``room_needed``: below it, ``start()`` refuses it)."""
    needs = room_needed(prepared.index, prepared.workload.plan(prepared.index), 0, 0,
                        batches_in_flight(systems.IN_FLIGHT, systems.NUM_WORKERS))[0]
    return Budget(fraction, int(estimated_bytes(prepared.index).sum()), needs)


# -- the servers ----------------------------------------------------------------------------------
@dataclass
class Endpoint:
    """A backend's server, and the URL of each workload's index on it."""

    backend: str
    server: ServerProcess
    urls: dict[str, str]

    @property
    def storage_options(self) -> dict | None:
        return self.server.storage_options


@contextlib.contextmanager
def serving(root: Path, folders: dict[str, Path], backends: list[str], delay_ms: float,
            bandwidth_mb_s: float | None,
            log: Callable[[str], None]) -> Iterator[dict[str, Endpoint]]:
    """A server per backend on 127.0.0.1 in a process of its own (left out of the loaders' PSS),
    serving every workload's shards (``folders``, under ``root``; uploaded once each to S3);
    stopped after the block, with fsspec's IO thread."""
    from fsspec import asyn
    from .servers import ServerProcess, stop_fsspec_io

    shaping = {"delay": delay_ms / 1e3,
               "bandwidth": None if bandwidth_mb_s is None else bandwidth_mb_s * 1e6}
    io_before = asyn.iothread[0]
    try:
        with contextlib.ExitStack() as stack:
            endpoints = {}
            for backend in backends:
                server = stack.enter_context(ServerProcess(backend, root, **shaping))
                assert server.process.pid is not None  # started
                stack.enter_context(memory.apart(server.process.pid))
                began = time.perf_counter()
                endpoints[backend] = Endpoint(backend, server, {
                    name: _index_url(server, backend, root, folder, name)
                    for name, folder in folders.items()})
                log(f"{backend} server at {server.url}"
                    + (f", shards uploaded in {time.perf_counter() - began:.1f} s"
                       if backend == "s3" else ""))
            yield endpoints
    finally:
        if asyn.iothread[0] is not None and asyn.iothread[0] is not io_before:
            stop_fsspec_io(asyn)


def _index_url(server: ServerProcess, backend: str, root: Path, folder: Path, name: str) -> str:
    if backend == "http":
        return f"{server.url}/{folder.relative_to(root).as_posix()}/shards.json"
    return f"{server.upload(folder, name)}/shards.json"


# -- the systems and their runs -------------------------------------------------------------------
class Observed(Window):
    """A run's window as its server saw it (cleared as it begins): requests per sample and bytes
    sent over the bytes of the samples delivered; and the peak of the run's shard cache."""

    def __init__(self, prepared: Prepared, endpoint: Endpoint | None) -> None:
        self.endpoint = endpoint
        self.expected = Expected(prepared.workload, prepared.index)
        self.sizes = sample_bytes(prepared.index)
        self.seq: ShardSequence | None = None  # the run's, where it has a cache
        self.first = 0

    def begin(self, k: int) -> None:
        self.first = k
        if self.endpoint is not None:
            self.endpoint.server.clear_log()

    def end(self, k: int) -> dict:
        if self.endpoint is None:
            return {}
        found = self.traffic(np.concatenate([self.expected(n) for n in range(self.first, k)]))
        if self.seq is not None:
            found["cache_peak_bytes"] = self.seq.stats.cache_peak_bytes
        return found

    def traffic(self, ids: np.ndarray) -> dict:
        """What the server did since the window began, for the samples ``ids`` delivered."""
        assert self.endpoint is not None  # a run over a server
        requests, sent = self.endpoint.server.counts()
        return {"requests_per_sample": requests / len(ids),
                "read_amplification": sent / int(self.sizes[ids].sum())}


def ceiling(prepared: Prepared, endpoint: Endpoint, repeat: int) -> Run:
    """The endpoint's own rate on a workload's shards, a ``Run`` of ``CEILING``: every shard
    fetched whole into a scratch folder with ``remote.fetch`` (the cache's call),
    ``FETCH_THREADS`` at a time (its prefetcher's), no loader; observed as the loaders are."""
    options = endpoint.storage_options
    name = prepared.workload.name
    index = ShardIndex.load(endpoint.urls[name], options)
    observed = Observed(prepared, endpoint)
    with tempfile.TemporaryDirectory(prefix="shmseq-bench-ceiling-") as folder, \
            ThreadPoolExecutor(FETCH_THREADS) as pool:
        observed.begin(0)
        began = time.perf_counter()
        list(pool.map(lambda number: remote.fetch(index.shards[number].url,
                                                  os.path.join(folder, str(number)),
                                                  storage_options=options),
                      range(len(index.shards))))
        seconds = time.perf_counter() - began
    return Run(system(CEILING, endpoint.backend), name, repeat,
               len(index) / prepared.workload.batch_size / seconds,
               **observed.traffic(np.arange(len(index))))


def sample_bytes(index: ShardIndex) -> np.ndarray:
    """Each sample's bytes in its shard (its members' headers and data), by global id."""
    return np.concatenate([np.diff(np.append(shard.offsets, shard.end)) for shard in index.shards])


@contextlib.contextmanager
def shmseq_source(prepared: Prepared, endpoint: Endpoint | None, cache_bytes: int,
                  observed: Observed) -> Iterator[Iterator]:
    """``ShardSequence`` over the local index, or over the endpoint's through a shard cache in a
    fresh folder, of ``cache_bytes``."""
    workload = prepared.workload
    if endpoint is None:
        with started(shard_sequence(prepared.index, workload, prepared.decode,
                                    out_type=cpu_out())) as batches:
            yield batches
        return
    with tempfile.TemporaryDirectory(prefix="shmseq-bench-cache-") as folder:
        observed.seq = shard_sequence(endpoint.urls[workload.name], workload, prepared.decode,
                                      out_type=cpu_out(), cache_dir=folder,
                                      cache_bytes=cache_bytes,
                                      storage_options=endpoint.storage_options)
        with started(observed.seq) as batches:
            yield batches


def torch_source(prepared: Prepared, endpoint: Endpoint | None, cache_bytes: int,
                 observed: Observed) -> ContextManager[Iterator]:
    """torch's ``DataLoader`` over a ``ShardWorker`` of the local index, or of the endpoint's
    (loaded here, on the clock, as ``ShardSequence`` loads it), reading in place."""
    if endpoint is None:
        return torch_shards(prepared)
    options = endpoint.storage_options
    index = ShardIndex.load(endpoint.urls[prepared.workload.name], options)
    return torch_shards(replace(prepared, index=index), storage_options=options)


Source = Callable[[Prepared, Endpoint | None, int, Observed], ContextManager[Iterator]]
SOURCES: dict[str, Source] = {"shmseq": shmseq_source, "torch": torch_source}


def measurer(prepared: dict[str, Prepared], endpoints: dict[str, Endpoint],
             budgets: dict[str, Budget]) -> Callable[..., Run]:
    """``run_matrix``'s ``measure`` for the remote mode's systems. shmseq's and the peers'
    windows span whole epochs, their first epoch timed from the start: what their caches
    fetched then compares with what the epochs read; torch's, whole rounds of its workers
    (batches k to k + 1 built side by side): what they requested then compares with what they
    delivered."""
    def measure(name: str, workload: ShardWorkload, repeat: int, seconds: float,
                warmup_seconds: float) -> Run:
        ready = prepared[workload.name]
        loader, source = name.split("-", 1)
        endpoint = endpoints.get(source)
        if loader == CEILING:
            assert endpoint is not None  # a server's
            return ceiling(ready, endpoint, repeat)
        observed = Observed(ready, endpoint)
        epoch = observed.expected.length
        budget = budgets[workload.name].bytes
        if loader in peers.PEERS:
            assert endpoint is not None  # the peers read the servers only
            return timed_run(name, workload.name, repeat,
                             lambda: peers.batches(loader, ready, peer_url(endpoint, workload.name,
                                                                           loader),
                                                   endpoint.storage_options, budget),
                             peers.checker(ready), seconds, warmup_seconds, workload.early_batches,
                             whole=epoch, window=observed, epoch=epoch)
        shmseq = loader == "shmseq"
        return timed_run(name, workload.name, repeat,
                         lambda: SOURCES[loader](ready, endpoint, budget, observed),
                         checker(ready), seconds, warmup_seconds, workload.early_batches,
                         whole=epoch if shmseq else systems.NUM_WORKERS, window=observed,
                         epoch=epoch if shmseq else None)
    return measure


def peer_url(endpoint: Endpoint, workload: str, peer: str) -> str:
    """Where a peer reads a workload: its own format's bucket, or the tar shards' index."""
    own = endpoint.urls.get(f"{workload}-{peer}")
    return endpoint.urls[workload] if own is None else own.rsplit("/", 1)[0]


@contextlib.contextmanager
def mode(prepared: dict[str, Prepared], root: Path, folders: dict[str, Path], backends: list[str],
         delay_ms: float, bandwidth_mb_s: float | None, fraction: float,
         log: Callable[[str], None], names: list[str],
         skipped: dict[str, str]) -> Iterator[tuple[Callable[..., Run], "Report"]]:
    """The remote mode of the systems ``names``, while its servers run: ``run_matrix``'s
    ``measure`` and the report's part, each workload's budget found first, and the peers' own
    formats written (served beside the tar shards); ``skipped``: the peers left out, and why."""
    budgets = {name: budget(ready, fraction) for name, ready in prepared.items()}
    for name, found in budgets.items():
        log(found.describe(name))
    asked = {peer for name in names if (peer := peers.peer_of(name))}
    formats = peers.formats(prepared, root, asked, folders)
    with serving(root, {**folders, **formats}, backends, delay_ms, bandwidth_mb_s,
                 log) as endpoints:
        yield (measurer(prepared, endpoints, budgets),
               Report(backends, delay_ms, bandwidth_mb_s, budgets,
                      {name: ready.workload for name, ready in prepared.items()},
                      skipped if asked or skipped else None))


# -- the report -----------------------------------------------------------------------------------
COLUMNS = f"""\
- requests/sample, read amp. (remote systems): from the server's own log over the timed
  window only: the requests it answered per sample delivered, and the bytes it sent over the
  bytes of the samples delivered (their tar headers and data). shmseq's windows span whole
  epochs (its cache fetches a shard whole, once an epoch at most); torch's, whole rounds of its
  workers (it reads each batch's samples where they lie, a range request per run of
  neighbouring samples).
- peak cache MB: the most shmseq's shard cache held in the run (``seq.stats.cache_peak_bytes``,
  the bytes being fetched included); never above the budget (a warning above the table
  otherwise).
- Systems: ceiling-http and ceiling-s3 are the endpoint alone: every shard fetched whole into
  a scratch folder with ``shmseq.remote.fetch`` (the cache's call), {FETCH_THREADS} at a time
  (its prefetcher's; a worker that finds a shard missing fetches it too, so shmseq's server
  may send more than that), no loader; its images/s are the set's images over that time.
  shmseq-local and torch-local read the local shards where they lie; shmseq-http and shmseq-s3 are
  ``ShardSequence`` over the index's URL, through the node's shard cache in a fresh folder each
  run; torch-http and torch-s3 are torch's ``DataLoader`` over a ``ShardWorker`` of the index's
  URL, reading in place: what a torch user gets from the same shards. All read one stream
  (shuffled within ``shuffle_shards`` shards, as ``ShardSequence`` does remote shards), with 2
  workers and the same batches in flight."""
# shmseq's, per epoch: two requests a shard of 64 samples (its version, then its bytes)
TARGETS = {"read_amplification": 1.05, "requests_per_sample": 0.035}


class Report:
    """The remote mode's part of the streaming report (``streaming.markdown``'s ``remote``):
    the servers and budgets above the table, its columns, its lines, and the peers' table where
    they were asked (``peers_skipped``: those left out, and why; None: none asked)."""

    def __init__(self, backends: list[str], delay_ms: float, bandwidth_mb_s: float | None,
                 budgets: dict[str, Budget], workloads: dict[str, ShardWorkload],
                 peers_skipped: dict[str, str] | None = None) -> None:
        self.backends, self.delay_ms, self.bandwidth_mb_s = backends, delay_ms, bandwidth_mb_s
        self.budgets, self.workloads, self.peers_skipped = budgets, workloads, peers_skipped
        self.columns = COLUMNS + ("" if peers_skipped is None else "\n" + peers_report.COLUMNS)

    def tables(self, runs: list[Run]) -> list[str]:
        if self.peers_skipped is None:
            return []
        return [peers_report.section(runs, self.workloads, self.backends, self.peers_skipped)]

    def notes(self, cells: list[Cell]) -> list[str | None]:
        """The servers, the budgets, and a warning where a cache held more than its budget."""
        cap = ("no bandwidth cap" if self.bandwidth_mb_s is None
               else f"at most {self.bandwidth_mb_s:g} MB/s over all its connections")
        over = [f"{c.workload} {c.system} {c.spreads['cache_peak_bytes'][1] / 1e6:,.0f} MB"
                for c in cells if c.cache_peak_bytes is not None
                and c.spreads["cache_peak_bytes"][1] > self.budgets[c.workload].bytes]
        return [f"Servers: {', '.join(self.backends)} on 127.0.0.1, each in a process of its own "
                f"on this machine's cores, {self.delay_ms:g} ms added to every request, {cap}.",
                "Cache: " + "; ".join(b.describe(name) for name, b in self.budgets.items()) + ".",
                f"WARNING: a shard cache held more than its budget: {', '.join(over)}"
                if over else None]

    def highlights(self, runs: list[Run], cells: list[Cell]) -> list[str]:
        found = []
        for name, workload in self.workloads.items():
            get = {c.system: c for c in cells if c.workload == name}
            found += [line for backend in self.backends
                      if (line := self._line(runs, get, workload, backend))]
        return found

    def _line(self, runs: list[Run], get: dict[str, Cell], workload: ShardWorkload,
              backend: str) -> str | None:
        """shmseq over ``backend`` against shmseq from local disk, torch over the same backend
        and the endpoint's ceiling, repeat by repeat; its traffic; what bounds it."""
        ours, local, theirs = (system(loader, source) for loader, source in (
            ("shmseq", backend), ("shmseq", LOCAL), ("torch", backend)))
        if ours not in get:
            return None
        parts = [f"{workload.name} over {backend}: {ours} {_images(get[ours], workload)} images/s"]
        of_local = ratios(runs, workload.name, ours, local)
        if of_local:
            parts[0] += f", {ratio_text(of_local['rate'])} {local}'s ({_images(get[local], workload)})"
        torch = ratios(runs, workload.name, ours, theirs)
        if torch:
            parts.append(f"{ratio_text(torch['rate'])} {theirs}'s ({_images(get[theirs], workload)}) "
                         f"with {less_or_more(torch['cpu'])} trainer CPU a batch "
                         f"({get[ours].cpu_us_per_batch:,.0f} against "
                         f"{get[theirs].cpu_us_per_batch:,.0f} µs), its first batch in "
                         f"{ratio_text(torch['first'])} {theirs}'s time")
        parts.append(_traffic(get[ours], get.get(theirs)))
        served = served_of_ceiling(runs, workload.name, backend)
        if served:
            top = get[system(CEILING, backend)]
            rate = images_per_s(top, workload)[0]
            parts.append(f"the server sent {ratio_text(served)} the bytes a second of its ceiling "
                         f"({rate:,.0f} images/s, "
                         f"{rate * self.budgets[workload.name].set_bytes / workload.images / 1e6:,.0f} "
                         "MB/s)" + _bound(served, of_local, rate, get.get(local), workload))
        return "; ".join(parts) + "; ratios taken repeat by repeat, median (min-max)"

    def as_json(self, runs: list[Run]) -> dict:
        """The settings, budgets and ratios of the remote mode, for ``streaming.json``."""
        found: dict[str, dict] = {}
        for name in self.workloads:
            for backend in self.backends:
                ours = system("shmseq", backend)
                found[f"{name} {backend}"] = {
                    "of_local": ratios(runs, name, ours, system("shmseq", LOCAL)),
                    "of_torch": ratios(runs, name, ours, system("torch", backend)),
                    "served_of_ceiling": served_of_ceiling(runs, name, backend) or None}
        for name in self.workloads:
            for backend in self.backends:
                of_peer, best = peers_report.best_peer_ratios(runs, name, backend)
                if of_peer:
                    found[f"{name} {backend}"]["of_best_peer"] = {"epoch_rate": of_peer,
                                                                  "best": best}
        return {"backends": self.backends, "delay_ms": self.delay_ms,
                "peers_skipped": self.peers_skipped,
                "bandwidth_mb_s": self.bandwidth_mb_s,
                "budgets": {name: {**asdict(b), "bytes": b.bytes, "raised": b.raised}
                            for name, b in self.budgets.items()},
                "targets": TARGETS, "ratios": found}


def served_of_ceiling(runs: list[Run], workload: str, backend: str) -> list[float]:
    """Repeat by repeat, the bytes a second the server sent shmseq over those it sent its
    ceiling (each run's images/s times its read amplification)."""
    return [mine.batches_per_second * present(mine.read_amplification)
            / (top.batches_per_second * present(top.read_amplification))
            for mine, top in paired(runs, workload, system("shmseq", backend),
                                    system(CEILING, backend))]


def _images(cell: Cell, workload: ShardWorkload) -> str:
    return f"{images_per_s(cell, workload)[0]:,.0f}"


def _traffic(ours: Cell, theirs: Cell | None) -> str:
    """Ours' requests a sample and read amplification against its targets, and theirs'."""
    met = all(getattr(ours, name) <= target for name, target in TARGETS.items())
    said = (f"{ours.system} {ours.requests_per_sample:.3f} requests a sample and read "
            f"amplification {ours.read_amplification:.2f} (targets per epoch: at most "
            f"{TARGETS['requests_per_sample']:g} and {TARGETS['read_amplification']:g}: "
            f"{'met' if met else 'not met'})")
    if theirs is not None and theirs.read_amplification is not None:
        said += (f", {theirs.system} {theirs.requests_per_sample:.3f} and "
                 f"{theirs.read_amplification:.2f}")
    return said


def _bound(served: list[float], of_local: dict | None, ceiling_rate: float, local: Cell | None,
           workload: ShardWorkload) -> str:
    """What bounds shmseq's remote rate: the workers (as fast as from local disk), the
    endpoint (near its ceiling), or neither alone; and whether the endpoint's ceiling allows
    half of local disk's rate."""
    if of_local and statistics.median(of_local["rate"]) >= 0.9:
        said = ": as fast as from local disk, bound by the workers"
    elif statistics.median(served) >= 0.75:
        said = ": transport-bound, by the endpoint"
    else:
        said = (": below both local disk's rate and the endpoint's ceiling, neither bounds it "
                "alone (the server, the fetches and the workers share this machine's cores)")
    if local is not None:
        local_rate = images_per_s(local, workload)[0]
        said += (f"; the ceiling is {ceiling_rate / local_rate:.2f}x shmseq-local's rate: 0.5x "
                 f"local's is {'within' if ceiling_rate >= 0.5 * local_rate else 'beyond'} the "
                 "endpoint's reach")
    return said
