"""The streaming workloads: shmseq's ``ShardSequence`` against PyTorch's ``DataLoader`` over the
same tar shards, with the same decode; and, on the JPEG shards, the decode moved into the trainer.

Both loaders run the very same reading code: torch's is ``DataLoader(ShardWorker(index,
decode), batch_size=None, sampler=<the ShardPlan's batches, epoch after epoch>, num_workers=2,
persistent_workers=True, prefetch_factor=5, fork)``, so each of its workers calls
``worker[ids]`` as shmseq's do, on the same ids in the same order; ``ShardSequence`` is given
that plan's arguments (seed, ``shuffle_window``, ``last_batch='discard'``), 2 workers, 10 slots
sized by its first batches (no ``slot_bytes``, as a user writes it), fork. Both hand over torch
CPU tensors. Two kinds of shards
(``shard_data``): photo-like JPEGs decoded and random-resized-cropped to 224 x 224 in the
workers (``shards-jpeg``: decode-bound), and raw 224 x 224 x 3 uint8 images (``shards-uint8``:
no decoding, the transport and the reading are what is left).

The third system (``STAGE``, JPEG shards only) is what ``shmseq.decode`` is for: the workers
read each JPEG's encoded bytes (``encoded_sample()``) and a ``DecodeStage`` decodes, crops and
normalizes every batch in the trainer's process, with nvJPEG where there is CUDA
(``shmseq-gpu-decode``), or else in the trainer's own threads with simplejpeg
(``shmseq-trainer-decode``: the stage's CPU path, which spends the trainer's CPU by design).

The consumer checks every batch: its labels (each sample's id) against the plan's, and for
the uint8 shards each image's marker bytes; the stage's images are read whole, as a trainer's
first layer reads them (a mean per image, which on a GPU also waits for the decode). The runs
interleave the systems, as the transport matrix's do; the report gives images/s and the
trainer's CPU a batch and an image, the first batch, the PSS of the trainer and its workers
(``memory.py``), medians and min-max over the repeats, shmseq's ratio to torch (and the
stage's to both) within each repeat, and each worker-decoding loader's rate
over the limit: the same ``worker[ids]`` calls by 1 and by 2 processes with no transport
(``limit_rate``).
"""
from __future__ import annotations

import itertools
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, Callable, ContextManager, Iterator, Protocol

import numpy as np

from shmseq._apps.report import with_spread
from shmseq.decode import DecodeStage, encoded_sample
from shmseq.engine.trainer.devices import cuda_available, torch_available
from shmseq import ShmSequence
from shmseq.shards import ShardIndex, ShardPlan, ShardSequence, ShardWorker
from shmseq.vision import IMAGENET_MEAN, IMAGENET_STD

from . import limit, systems
from .report import Cell, _fmt, drift_note, machine_line, of_limit, summarize, timing
from .runner import LIMIT, Run, timed_run
from .shard_data import largest_sample
from .workloads import BatchMismatch, ImageBatches, _head, _tail


class RemotePart(Protocol):
    """What a mode reading remote shards adds to the report (``remote_streaming.Report`` is
    one): notes above the table, its columns, lines of what it shows."""

    columns: str

    def notes(self, cells: list[Cell]) -> list[str | None]:
        """Paragraphs above the table (None: left out)."""

    def highlights(self, runs: list[Run], cells: list[Cell]) -> list[str]:
        """Lines of "What it shows"."""

SEED = 0
SHMSEQ, TORCH = "shmseq-shards", "torch-shards"
STAGE_DEVICE = "cuda" if cuda_available() else "cpu"
STAGE = "shmseq-gpu-decode" if STAGE_DEVICE == "cuda" else "shmseq-trainer-decode"


@dataclass(frozen=True)
class ShardWorkload(ImageBatches):
    """Batches of ``batch_size`` ``side`` x ``side`` x 3 uint8 images and int64 labels, from
    ``images`` samples of ``kind`` (``jpeg`` or ``uint8``) in shards of ``samples_per_shard``,
    their shuffle bounded by ``shuffle_window`` samples or else (given) ``shuffle_shards`` shards.
    ``early_batches``: the batches after the first timed apart (``first N × steady``)."""

    name: str
    kind: str
    batch_size: int = 64
    images: int = 1024
    samples_per_shard: int = 256
    side: int = 224
    shuffle_window: int = 1000
    shuffle_shards: int | None = None
    early_batches: int = 10

    @property
    def folder(self) -> str:
        """The name of its shards' folder: what they were made with."""
        return f"{self.kind}-{self.images}-{self.samples_per_shard}-{self.side}-{SEED}"

    @property
    def bounded(self) -> dict:
        """How the shuffle is bounded, as ``ShardSequence`` takes it: one of the two."""
        return ({"shuffle_shards": self.shuffle_shards} if self.shuffle_shards is not None
                else {"shuffle_window": self.shuffle_window})

    def plan(self, index: ShardIndex) -> ShardPlan:
        """The epochs' batches, as both loaders take them."""
        return ShardPlan(index, self.batch_size, **self.bounded, shuffle=True, seed=SEED,
                         last_batch="discard")


STREAM_WORKLOADS = {w.name: w for w in (ShardWorkload("shards-jpeg", "jpeg"),
                                        ShardWorkload("shards-uint8", "uint8"))}
QUICK_IMAGES = 256  # --quick: smaller sets (4 batches an epoch), made in a second or two


def quick(workload: ShardWorkload) -> ShardWorkload:
    return replace(workload, images=QUICK_IMAGES, samples_per_shard=QUICK_IMAGES // 4)


@dataclass
class Prepared:
    """A workload's shards, as every run reads them."""

    workload: ShardWorkload
    index: ShardIndex
    decode: Callable[[dict], object]


# -- the loaders -------------------------------------------------------------------------------
class EpochBatches:
    """torch's sampler: the plan's batches (int64 id arrays), epoch 0, 1, ... without end."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            yield from self.plan.batches(epoch)


def shard_sequence(shards: ShardIndex | str, workload: ShardWorkload,
                   decode: Callable[[dict], object], batch_bytes: int | None = None,
                   **options: Any) -> ShardSequence:
    """``ShardSequence`` over ``shards`` (an index, or its URL) with the plan's arguments,
    slots sized to ``batch_bytes`` up front where batches vary in size (so that none takes the
    overflow path), else (None) by the first batches."""
    slot_bytes = None if batch_bytes is None else batch_bytes + systems.SLOT_SLACK
    return ShardSequence(shards, decode, **workload.bounded, batch_size=workload.batch_size,
                         shuffle=True, seed=SEED, last_batch="discard", slot_bytes=slot_bytes,
                         buffer=systems.IN_FLIGHT, num_workers=systems.NUM_WORKERS,
                         start_method=systems.START_METHOD, **options)


@contextmanager
def started(seq: ShmSequence) -> Iterator[Iterator]:
    """The sequence's batches, epoch after epoch; finished after the block."""
    try:
        yield systems._epochs(seq.start())
    finally:
        seq.finish()


def cpu_out() -> str:
    """What the worker-decoding systems hand over: torch CPU tensors, or numpy without torch."""
    return "cpu" if torch_available() else "null"


def shmseq_shards(prepared: Prepared) -> ContextManager[Iterator]:
    """``ShardSequence`` decoding in its workers, its ring sized by its first batches (its
    default: crops of one size, batches of one size)."""
    return started(shard_sequence(prepared.index, prepared.workload, prepared.decode,
                                  out_type=cpu_out()))


def decode_stage(side: int) -> DecodeStage:
    """The stage the third system decodes with: CUDA's where there is one, else the CPU's."""
    return DecodeStage(side, device=STAGE_DEVICE, seed=SEED)


def shmseq_decode_stage(prepared: Prepared) -> ContextManager[Iterator]:
    """``ShardSequence`` whose workers only read the encoded JPEGs, decoded in the trainer by a
    ``DecodeStage`` on ``STAGE_DEVICE`` into normalized float ``(N, 3, side, side)``."""
    workload = prepared.workload
    return started(shard_sequence(prepared.index, workload, encoded_sample(),
                                  workload.batch_size * largest_sample(prepared.index),
                                  out_type=STAGE_DEVICE, device=decode_stage(workload.side)))


def torch_shards(prepared: Prepared, **options: Any) -> ContextManager[Iterator]:
    """torch's ``DataLoader`` over a ``ShardWorker``: one ``worker[ids]`` per batch
    (``options``: the worker's, ``storage_options`` say)."""
    return systems._dataloader(ShardWorker(prepared.index, prepared.decode, **options),
                               "file_descriptor", batch_size=None,
                               sampler=EpochBatches(prepared.workload.plan(prepared.index)))


STREAM_SYSTEMS: dict[str, Callable[[Prepared], ContextManager[Iterator]]] = {
    SHMSEQ: shmseq_shards,
    TORCH: torch_shards,
    STAGE: shmseq_decode_stage,
}
STREAM_TORCH_SYSTEMS = (TORCH, STAGE)
STREAM_SYSTEM_NAMES = [LIMIT, *STREAM_SYSTEMS]  # the limit is timed apart (``limit_rate``)


def runs_on(name: str, workload: ShardWorkload) -> bool:
    """Whether a system runs on a workload: the decode stage decodes JPEGs only."""
    return name != STAGE or workload.kind == "jpeg"


# -- the limit: the workers' own work, no transport --------------------------------------------
def _build(prepared: Prepared, wid: int, processes: int, seconds: float, warmup_seconds: float,
           barrier: Barrier, rates: Queue) -> None:
    worker = ShardWorker(prepared.index, prepared.decode)
    expected = Expected(prepared.workload, prepared.index)
    built, start = 0, time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        worker[expected(wid + built * processes)]
        built += 1
    barrier.wait()
    timed, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or not timed:
        worker[expected(wid + (built + timed) * processes)]
        timed += 1
    rates.put(timed / elapsed)


def limit_rate(prepared: Prepared, seconds: float, warmup_seconds: float = 0.0) -> float:
    """The faster of 1 and ``NUM_WORKERS`` processes (as the transport matrix's limit)."""
    return limit.limit_rate(prepared, seconds, warmup_seconds, build=_build, slack=60.0)


# -- checking and timing -----------------------------------------------------------------------
class Expected:
    """The ``k``-th batch's ids in the endless stream of the plan's epochs."""

    def __init__(self, workload: ShardWorkload, index: ShardIndex) -> None:
        self.plan = workload.plan(index)
        self.length = self.plan.length(0)
        self._epoch = -1
        self._batches: list[np.ndarray] = []

    def __call__(self, k: int) -> np.ndarray:
        epoch, position = divmod(k, self.length)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self.plan.batches(epoch)
        return self._batches[position]


def _check_labels(workload: ShardWorkload, k: int, labels: np.ndarray, ids: np.ndarray) -> None:
    if not np.array_equal(labels, ids):
        raise BatchMismatch(f"{workload.name} batch {k}: labels {labels[:4]}... expected "
                            f"{ids[:4]}...")


def checker(prepared: Prepared, system: str = SHMSEQ) -> Callable[[int, object], None]:
    """``check(k, batch)``: raise ``BatchMismatch`` unless ``batch`` is the ``k``-th of the
    plan's stream: its shape, its labels (the samples' ids), and for raw images their markers
    (the decode stage's batches: ``stage_checker``)."""
    if system == STAGE:
        return stage_checker(prepared)
    workload = prepared.workload
    expected = Expected(workload, prepared.index)
    shape = (workload.batch_size, *workload.image_shape)

    def check(k: int, batch: Any) -> None:
        images, labels = (np.asarray(part) for part in batch)
        ids = expected(k)
        if images.shape != shape or images.dtype != np.uint8:
            raise BatchMismatch(f"{workload.name} batch {k}: images {images.dtype}{images.shape}")
        _check_labels(workload, k, labels, ids)
        if workload.kind == "uint8" and not (np.array_equal(images[:, 0, 0, 0], _head(ids)) and
                                             np.array_equal(images[:, -1, -1, -1], _tail(ids))):
            raise BatchMismatch(f"{workload.name} batch {k}: image markers do not match labels "
                                "(torn or stale batch)")
    return check


NORMALIZED = (min(-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)),
              max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)))


def stage_checker(prepared: Prepared) -> Callable[[int, object], None]:
    """``check(k, batch)`` for the decode stage's float ``(N, 3, side, side)`` batches: their
    shape, their labels, and every pixel read, as a trainer's first layer reads them (one mean
    per image, which on a GPU waits for the batch's decode: no work is left pending), each
    within what normalizing ``[0, 1]`` can give."""
    workload = prepared.workload
    expected = Expected(workload, prepared.index)
    shape = (workload.batch_size, 3, workload.side, workload.side)

    def check(k: int, batch: Any) -> None:
        images, labels = batch
        means = images.mean(dim=(1, 2, 3)).cpu().numpy()
        if tuple(images.shape) != shape or not images.is_floating_point():
            raise BatchMismatch(f"{workload.name} batch {k}: images {images.dtype}"
                                f"{tuple(images.shape)}, expected floats of {shape}")
        _check_labels(workload, k, labels.cpu().numpy(), expected(k))
        if not (np.isfinite(means).all() and NORMALIZED[0] <= means.min() <= means.max()
                <= NORMALIZED[1]):
            raise BatchMismatch(f"{workload.name} batch {k}: image means {means.min():.2f} to "
                                f"{means.max():.2f}, outside the normalized range "
                                f"{NORMALIZED[0]:.2f} to {NORMALIZED[1]:.2f}")
    return check


def measurer(prepared: dict[str, Prepared]) -> Callable[..., Run]:
    """``run_matrix``'s ``measure`` for the streaming workloads (by name, prepared)."""
    def measure(name: str, workload: ShardWorkload, repeat: int, seconds: float,
                warmup_seconds: float) -> Run:
        ready = prepared[workload.name]
        if name == LIMIT:
            return Run(name, workload.name, repeat, limit_rate(ready, seconds, warmup_seconds))
        return timed_run(name, workload.name, repeat, lambda: STREAM_SYSTEMS[name](ready),
                         checker(ready, name), seconds, warmup_seconds,
                         workload.early_batches)
    return measure


# -- the report --------------------------------------------------------------------------------
COLUMNS = """\
What the columns mean:
- images/s, batches/s: what the consumer received, every batch checked (its labels against the
  plan; the raw images' marker bytes; the decode stage's images read whole, a mean per image
  within the normalized range); median of the repeats (min-max).
- trainer CPU µs/batch, µs/image: CPU time of the training process (all its threads) per batch
  and per image: what the loader takes from your training step (for the decode stage, the
  decode it runs there).
- first batch s: from creating the loader (workers started) to the first batch in hand.
- first N × steady: the rate over the N batches after the first, over the steady rate.
- tree PSS MB: the proportional set size of the trainer and its workers together (a page they
  share counted once), the largest of samples taken every 0.1 s while the loader warms up
  (after the first N batches) and at the end of the timed window; median of the repeats
  (min-max). With as many batches in flight, shmseq's
  ring holds all its slots for the whole run, where torch's DataLoader holds the batches done
  and not yet taken: fewer than its prefetch while the workers are the slower side."""
LIMIT_COLUMN = """\
- × limit: images/s over the limit's. The limit is the workers' own work: the same
  ``worker[ids]`` calls (reading the samples at their offsets, decoding, stacking) on the same
  batches, by 1 and by 2 processes in turn, with no transport, no consumer and no batch kept;
  the faster of the two. Each system is timed in a window of its own: a ratio above 1.00
  (marked †) says only that the machine ran faster in that window. The decode stage has none:
  its workers decode nothing, so that limit does not bound it."""


def shown(system: str) -> str:
    """A system's name in the table; the decode stage's says where it decoded."""
    return f"{system} (decoded on {STAGE_DEVICE})" if system == STAGE else system


def cells_of(runs: list[Run], workloads: dict[str, ShardWorkload]) -> list[Cell]:
    """``summarize``'s cells, the decode stage's without a ratio to a limit that is not its own."""
    cells = summarize(runs, workloads)
    for cell in cells:
        if cell.system == STAGE:
            cell.of_limit = None
    return cells


def images_per_s(cell: Cell, workload: ShardWorkload) -> tuple[float, tuple[float, float]]:
    """The cell's images/s and their min-max."""
    per_batch = workload.batch_size / (workload.batch_bytes / 1e9)  # images per GB
    return cell.gb_per_s * per_batch, (cell.gb_per_s_spread[0] * per_batch,
                                       cell.gb_per_s_spread[1] * per_batch)


def images_rate(cell: Cell, workload: ShardWorkload) -> str:
    """The cell's images/s, with their min-max over two or more runs."""
    rate, spread = images_per_s(cell, workload)
    return with_spread(rate, spread, ",.0f", cell.runs)


def _per_image(cell: Cell, workload: ShardWorkload) -> float | None:
    return None if cell.cpu_us_per_batch is None else cell.cpu_us_per_batch / workload.batch_size


# a remote loader's columns: (heading, ``Cell`` field, format, unit)
REMOTE_COLUMNS = (("requests/sample", "requests_per_sample", ".3f", 1),
                  ("read amp.", "read_amplification", ".2f", 1),
                  ("peak cache MB", "cache_peak_bytes", ",.0f", 1e6))


def table(cells: list[Cell], workloads: dict[str, ShardWorkload]) -> str:
    """The cells as a markdown table; the × limit column where the limit ran, the remote
    columns where a remote loader did (blank for the others)."""
    spread = " (min-max)" if any(c.runs > 1 for c in cells) else ""
    early = sorted({w.early_batches for w in workloads.values()})
    limit = any(c.system == LIMIT for c in cells)
    remote = any(c.spreads for c in cells)
    heads = ["workload", "system", f"images/s{spread}", "batches/s", "trainer CPU µs/batch",
             "trainer CPU µs/image", "first batch s", f"first {'/'.join(map(str, early))} × steady",
             *(["× limit"] * limit), "tree PSS MB",
             *([heading for heading, *_ in REMOTE_COLUMNS] if remote else [])]
    lines = [_row(heads), "| --- | --- |" + " ---: |" * (len(heads) - 2)]
    for c in cells:
        workload = workloads[c.workload]
        lines.append(_row([c.workload, shown(c.system), images_rate(c, workload),
                           f"{c.batches_per_s:.1f}", _fmt(c.cpu_us_per_batch, ',.0f'),
                           _fmt(_per_image(c, workload), ',.1f'), _fmt(c.first_batch_s, '.3f'),
                           _fmt(c.early_of_steady, '.2f'), *([of_limit(c.of_limit)] * limit),
                           _pss(c), *([_remote_cell(c, *column[1:]) for column in REMOTE_COLUMNS]
                                      if remote else [])]))
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _remote_cell(cell: Cell, name: str, spec: str, unit: float) -> str:
    """A remote figure with its min-max; blank where the loader read no server."""
    value = getattr(cell, name)
    if value is None:
        return ""
    low, high = cell.spreads[name]
    return with_spread(value / unit, (low / unit, high / unit), spec, cell.runs)


def _pss(cell: Cell) -> str:
    if cell.pss_bytes is None:
        return "—"
    assert cell.pss_spread is not None  # with the median
    low, high = cell.pss_spread
    return with_spread(cell.pss_bytes / 1e6, (low / 1e6, high / 1e6), ",.0f", cell.runs)


def paired(runs: list[Run], workload: str, ours: str, theirs: str) -> list[tuple[Run, Run]]:
    """(ours, theirs) on ``workload`` in every repeat where both ran (side by side)."""
    by = {(r.system, r.repeat): r for r in runs if r.workload == workload}
    repeats = sorted({repeat for _, repeat in by if (ours, repeat) in by and (theirs, repeat) in by})
    return [(by[ours, r], by[theirs, r]) for r in repeats]


def ratios(runs: list[Run], workload: str, ours: str = SHMSEQ,
           theirs: str = TORCH) -> dict[str, list[float]] | None:
    """``ours``' rate over ``theirs``', their CPU a batch over ours and ours' first batch over
    theirs, repeat by repeat (the two were run side by side), and ours' tree PSS over theirs
    where both were sampled; None unless both ran."""
    pairs = paired(runs, workload, ours, theirs)
    if not pairs:
        return None
    found = {"rate": [mine.batches_per_second / other.batches_per_second for mine, other in pairs],
             "cpu": [_present(other.cpu_us_per_batch) / _present(mine.cpu_us_per_batch)
                     for mine, other in pairs],
             "first": [_present(mine.first_batch_seconds) / _present(other.first_batch_seconds)
                       for mine, other in pairs]}
    if all(mine.peak_pss_bytes and other.peak_pss_bytes for mine, other in pairs):
        found["pss"] = [_present(mine.peak_pss_bytes) / _present(other.peak_pss_bytes)
                        for mine, other in pairs]
    return found


def _present(figure: float | None) -> float:
    """A figure the runs compared have: a loader's (the limit has none), a remote run's."""
    assert figure is not None, "a figure the run has not"
    return figure


def _ratio(values: list[float]) -> str:
    median = statistics.median(values)
    return (f"{median:.2f}x" if len(values) < 2
            else f"{median:.2f}x ({min(values):.2f}-{max(values):.2f})")


def _less_or_more(less: list[float]) -> str:
    """``Nx less`` where ours took less CPU than theirs (the median of ``less``), else ``Nx more``."""
    if statistics.median(less) >= 1:
        return f"{_ratio(less)} less"
    return f"{_ratio([1 / value for value in less])} more"


def _workers_line(runs: list[Run], get: dict[str, Cell], workload: ShardWorkload) -> str | None:
    """Decoding in shmseq's workers against torch's, on one workload."""
    found = ratios(runs, workload.name)
    if found is None:
        return None
    ours, theirs = get[SHMSEQ], get[TORCH]
    return (f"{workload.name}: {SHMSEQ} {images_per_s(ours, workload)[0]:,.0f} images/s, "
            f"{_ratio(found['rate'])} torch's DataLoader over the same shards and decode "
            f"({images_per_s(theirs, workload)[0]:,.0f} images/s), with "
            f"{_less_or_more(found['cpu'])} trainer CPU a batch "
            f"({ours.cpu_us_per_batch:,.0f} against {theirs.cpu_us_per_batch:,.0f} µs), its "
            f"first batch in {_ratio(found['first'])} torch's time ({ours.first_batch_s:.3f} "
            f"against {theirs.first_batch_s:.3f} s)"
            + (f", {_ratio(found['pss'])} its process tree's PSS "
               f"({_present(ours.pss_bytes) / 1e6:,.0f} against "
               f"{_present(theirs.pss_bytes) / 1e6:,.0f} MB)"
               if "pss" in found else "")
            + "; ratios taken repeat by repeat, median (min-max)"
            + "".join(f"; {c.system} at {c.of_limit:.2f}x the limit" for c in (ours, theirs)
                      if c.of_limit is not None))


STAGE_ON_CPU = (
    "without CUDA the stage decodes with its CPU path, in the trainer's own threads (decoding, "
    "cropping and normalizing to float), so its trainer CPU is the decode itself, "
    "by design: the stage is meant for a GPU, whose nvJPEG takes the decode off the trainer's CPU "
    "(a CUDA machine runs shmseq-gpu-decode); without one, decode in the workers")


def _stage_line(runs: list[Run], get: dict[str, Cell], workload: ShardWorkload) -> str | None:
    """The decode stage against each loader that decodes in its workers, on one workload."""
    if STAGE not in get:
        return None
    stage = get[STAGE]
    against = []
    for other, called in ((TORCH, "torch's DataLoader"), (SHMSEQ, SHMSEQ)):
        found = ratios(runs, workload.name, STAGE, other)
        if found is not None:
            against.append(f"{_ratio(found['rate'])} the images/s of {called} with "
                           f"{_less_or_more(found['cpu'])} trainer CPU")
    return (f"{workload.name}: {STAGE}, decoded on {STAGE_DEVICE} in the trainer's process, "
            f"{images_per_s(stage, workload)[0]:,.0f} images/s, {_per_image(stage, workload):,.0f} "
            "µs of trainer CPU an image" + "".join(f"; {line}" for line in against)
            + ("; " + STAGE_ON_CPU if STAGE_DEVICE == "cpu" else ""))


def highlights(runs: list[Run], cells: list[Cell], workloads: dict[str, ShardWorkload]) -> list[str]:
    found = []
    for name in dict.fromkeys(c.workload for c in cells):
        get = {c.system: c for c in cells if c.workload == name}
        found += [line for line in (_workers_line(runs, get, workloads[name]),
                                    _stage_line(runs, get, workloads[name])) if line]
    return found


def markdown(runs: list[Run], workloads: dict[str, ShardWorkload], info: dict, settings: dict,
             data: list[str], load: list[str], command: str, warning: str | None = None,
             remote: RemotePart | None = None) -> str:
    """The table with its machine and load (a ``warning`` if it was busy), the data, the
    columns, what it shows, the command; ``remote`` (a ``RemotePart``) adds the
    remote mode's notes, columns and lines."""
    cells = cells_of(runs, workloads)
    head = (f"{machine_line(info)} {systems.NUM_WORKERS} workers and {settings['buffer']} "
            f"batches in flight for every loader; {timing(settings)}.")
    shows = "\n".join(f"- {line}" for line in highlights(runs, cells, workloads)
                      + (remote.highlights(runs, cells) if remote else []))
    decoded = [workloads[c.workload] for c in cells if c.system == STAGE]
    columns = COLUMNS + ("\n" + LIMIT_COLUMN if any(c.system == LIMIT for c in cells) else "")
    parts = [head, "Load: " + "; ".join(load), warning, "Shards: " + "; ".join(data),
             *(remote.notes(cells) if remote else []), table(cells, workloads),
             drift_note(cells, lambda cell: f"{images_rate(cell, workloads[cell.workload])} images/s"),
             stage_note(decoded[0].side) if decoded else None,
             columns + ("\n" + remote.columns if remote else ""),
             f"What it shows:\n{shows}" if shows else None, f"Reproduce: `{command}`"]
    return "\n\n".join(part for part in parts if part) + "\n"


def stage_note(side: int) -> str:
    """What the decode stage's row is, and on which device it ran."""
    where = ("torchcodec's batched nvJPEG decode on the GPU" if STAGE_DEVICE == "cuda" else
             f"simplejpeg in {decode_stage(side).threads} threads of the trainer's process, no GPU here")
    return (f"{STAGE}: the workers only read each JPEG's encoded bytes (`encoded_sample()`); "
            f"a `DecodeStage` decodes every batch in the trainer ({where}), random-resized-crops "
            f"it to {side}, flips and normalizes it into float32 (N, 3, {side}, {side}); "
            f"{SHMSEQ} and torch's DataLoader deliver uint8 (N, {side}, {side}, 3) "
            "crops, decoded in their workers. The stage is meant for GPUs"
            + ("." if STAGE_DEVICE == "cuda" else
               ": on this CPU-only machine it spends the trainer's own CPU on the decode, by design."))
