"""``python -m shmseq.bench --autotune``: a loader that sizes itself, against a sweep of fixed
settings run side by side, and what the static rules of torch's DataLoader and Grain pick.

Every workload has a best setting that the sweep beside it finds (repeats interleaved by
``runner.run_matrix``, every batch checked by ``workloads.check_batch``):

* ``latency``: each batch waits 20 ms (``time.sleep``, as a read from object storage) and spends
  1 ms of the worker's CPU on numpy work; ``num_workers`` 1 to 16.
* ``cpu-jpeg``: each image decoded from a photo-like JPEG and cropped to 224 x 224
  (``shard_data.JpegCrop``: shmseq.vision's JPEG path); ``num_workers`` 1 to 2x the CPU budget.
* ``trainer``: the trainer's step takes 25 ms (a sleep, as it waits on an accelerator) and a
  worker 8 ms of CPU a batch: the fewest workers that keep the ring full are enough.
* ``ring-imagenet256``, ``ring-imagenet64``, ``ring-cifar``: the transport matrix's batches
  (``InPlaceWorker``), 2 workers, ``buffer`` 2 to 10 slots.

Beside the sweeps run ``num_workers='auto'`` (worker workloads) and the default ring (no
``buffer``; ring workloads), each left out with the reason where this version of ShmSequence
has neither; and, as fixed settings, torch's default (``num_workers=0``) and what Grain's
``pick_performance_config`` picks. A fixed setting of ``W`` workers has ``2W + 2`` slots (see
``in_flight``). ``auto`` is timed from ``settle`` seconds after its loader is made (its start
and first batch included), and every run is traced every ``TRACE_SECONDS``: its worker count
and the batches/s since the point before, which the chart draws for ``auto``.
"""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Final, Iterator, Literal

import numpy as np

from shmseq import ShmSequence
from shmseq._apps.load import usable_cores
from shmseq._apps.report import with_spread

from . import systems
from .memory import SAMPLE_SECONDS
from .report import Cell, _fmt, machine_line, summarize, timing
from .runner import Run, timed_run
from .shard_data import JpegCrop, jpeg_samples
from .streaming import _ratio, cpu_out, paired, started
from .workloads import Allocator, InPlaceWorker, Workload, check_batch

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from numpy.typing import DTypeLike

AUTO: Final = "auto"
WORKER_SWEEP = (1, 2, 4, 6, 8, 12, 16)   # the latency-bound sweep
RING_SWEEP = (2, 3, 4, 5, 6, 8, 10)      # ring slots, with RING_WORKERS workers
RING_WORKERS = 2
SETTLE_SECONDS = 10.0   # auto's timed window starts this long after its loader is made
TRACE_SECONDS = 0.5
EARLY_BATCHES = 10      # timed apart after the first, as runner.timed_run does
JPEGS = 64              # the photo-like JPEGs the cpu-jpeg workers decode, in turn
NEAR_BEST = 0.98        # within 2 % of the best: enough workers to keep the ring full
TARGETS = {"auto": 0.90, "ring": 0.95}  # of the rate of the sweep's best setting
GRAIN_RULE = "google/grain: grain/_src/python/dataset/transformations/prefetch_autotune.py"


@dataclass(frozen=True)
class TunedWorkload(Workload):
    """Batches of the transport matrix (copied from the pool) that cost a worker more: a wait
    of ``latency_s``, ``cpu_s`` of numpy work, every image decoded from a JPEG (``jpeg``); and
    a trainer step of ``step_s``. ``case`` (latency, cpu, trainer or ring): what its fixed
    settings vary (``sweep``) and the target it is held to."""

    case: str = "cpu"
    latency_s: float = 0.0
    cpu_s: float = 0.0
    jpeg: bool = False
    step_s: float = 0.0
    about: str = ""


AUTOTUNE_WORKLOADS = {w.name: w for w in (
    TunedWorkload("latency", 64, 32, case="latency", latency_s=0.020, cpu_s=0.001,
                  about="latency-bound workers: each batch waits 20 ms (time.sleep, as a read "
                        "from object storage) and spends 1 ms of CPU on numpy work"),
    TunedWorkload("cpu-jpeg", 32, 224, jpeg=True,
                  about="CPU-bound workers: every image decoded from a photo-like JPEG "
                        "(300-500 px) and cropped to 224 x 224 (shmseq.vision's JPEG path)"),
    TunedWorkload("trainer", 64, 64, case="trainer", cpu_s=0.008, step_s=0.025,
                  about="trainer-bound: the trainer's step takes 25 ms (a sleep), a worker "
                        "8 ms of CPU a batch"),
    *(TunedWorkload(f"ring-{name}", batch_size, side, case="ring",
                    about=f"the transport matrix's {name} batches, built in place")
      for name, batch_size, side in (("imagenet256", 256, 224), ("imagenet64", 64, 224),
                                     ("cifar", 256, 32))))}


@dataclass(frozen=True)
class Setting:
    """A loader's configuration: ``workers`` (a count, or ``AUTO``) and ``buffer`` (ring slots;
    None: the loader's default)."""

    workers: int | Literal["auto"]
    buffer: int | None = None

    @property
    def name(self) -> str:
        if self.workers == 0:
            return "num_workers=0"
        if self.workers == AUTO:
            return f"num_workers='{AUTO}'"
        return f"num_workers={self.workers}, buffer={self.buffer or 'default'}"

    @property
    def tuned(self) -> bool:
        """Whether the loader picks part of it itself: auto's workers, or the default ring."""
        return self.workers == AUTO or (self.buffer is None and self.workers != 0)

    @property
    def options(self) -> dict[str, Any]:
        """ShmSequence's arguments for it."""
        return {"num_workers": self.workers,
                **({} if self.buffer is None else {"buffer": self.buffer})}


def in_flight(workers: int) -> int:
    """A fixed setting's slots: two batches a worker, as torch's ``prefetch_factor=2`` keeps in
    flight (and Grain's worker: a batch in its buffer of one, one it builds), and two that the
    trainer holds, as ``shmseq.DataLoader`` sizes its ring."""
    return 2 * workers + 2


def cores_sweep(budget: int) -> list[int]:
    """Worker counts from 1 to twice the CPU budget: each up to 4, then the latency sweep's."""
    return sorted({w for w in (1, 2, 3, 4, *WORKER_SWEEP, 24, 32) if w <= 2 * budget} | {budget})


def sweep(workload: TunedWorkload, budget: int) -> list[Setting]:
    """The fixed settings a workload is swept over."""
    if workload.case == "ring":
        return [Setting(RING_WORKERS, slots) for slots in RING_SWEEP]
    counts = WORKER_SWEEP if workload.case == "latency" else cores_sweep(budget)
    return [Setting(count, in_flight(count)) for count in counts]


def self_tuned(workload: TunedWorkload) -> Setting:
    """What the loader picks itself on a workload: its ring, or its workers."""
    return Setting(RING_WORKERS) if workload.case == "ring" else Setting(AUTO)


# -- the static rules --------------------------------------------------------------------------
def ram_mb() -> int:
    """This machine's RAM, in MiB: the budget Grain's rule is given here."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20


def grain_workers(element_bytes: int) -> int:
    """Grain's ``pick_performance_config`` (``GRAIN_RULE``, its ``_get_num_workers``): as many
    workers as elements (here batches) fit in ``ram_budget_mb``, at most ``max_workers``, whose
    default is ``multiprocessing.cpu_count()``. Given this machine's RAM as the budget."""
    return min(int(ram_mb() / (element_bytes / 2**20)), multiprocessing.cpu_count())


def static_picks(workload: TunedWorkload) -> dict[Setting, list[str]]:
    """The settings torch's defaults and Grain's rule give a workload, and who picks each."""
    picks: dict[Setting, list[str]] = {Setting(0): ["torch's default"]}
    if workload.case == "ring":
        picks[Setting(RING_WORKERS, in_flight(RING_WORKERS))] = [
            f"torch, {RING_WORKERS} workers: prefetch_factor=2"]
    grain = grain_workers(workload.batch_bytes)
    picks.setdefault(Setting(grain, in_flight(grain)) if grain else Setting(0), []).append(
        "Grain's rule")
    return picks


STATIC_RULES = (
    "torch's DataLoader: num_workers=0 by default (batches built in the trainer's process); "
    "with workers, prefetch_factor=2 (two batches a worker in flight). Grain's "
    f"pick_performance_config ({GRAIN_RULE}): num_workers = min(ram_budget_mb / the element's "
    "size in MiB, max_workers, by default multiprocessing.cpu_count()), the element being "
    "what mp_prefetch hands over (a batch, where batching comes first); each worker keeps "
    "per_worker_buffer_size=1 element, which the rule leaves alone (its buffer size is for "
    "the thread prefetch of single elements). Here ram_budget_mb is this machine's RAM "
    "({ram} MiB) and cpu_count() {cores}. Both run as fixed settings: ShmSequence with W "
    "workers and 2W + 2 slots; num_workers=0 as torch runs it, each batch built by the same "
    "worker in the trainer's thread into fresh arrays.")


# -- the workers and the trainer ---------------------------------------------------------------
def spend_cpu(seconds: float) -> None:
    """Numpy work until this thread has spent ``seconds`` of CPU: a batch costs the same CPU
    however busy the machine is (and takes longer when it is)."""
    scratch = np.linspace(1.0, 2.0, 1024)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        np.sqrt(scratch, out=scratch)


@functools.lru_cache(maxsize=None)
def jpeg_pool() -> tuple[dict, ...]:
    """The JPEGs the cpu-jpeg workers decode, made once and inherited by forked workers."""
    return tuple(jpeg_samples(JPEGS))


class FreshArrays:
    """``fill_batch``'s ``out`` outside a loader: fresh arrays, as a dataset returns them."""

    @staticmethod
    def empty(shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        return np.empty(shape, dtype)


class CostlyWorker(InPlaceWorker):
    """The transport matrix's in-place worker, each batch then costing what its workload says:
    a wait, CPU, or its images decoded from JPEGs (each image's two marker bytes kept, so that
    ``check_batch`` still tells a torn or misordered batch). ``worker[indices]`` builds it into
    fresh arrays, for the trainer's own thread (``num_workers=0``)."""

    def __init__(self, workload: TunedWorkload) -> None:
        super().__init__(workload)
        self.costs = workload
        self.decode = JpegCrop(workload.side) if workload.jpeg else None
        self.jpegs = jpeg_pool() if workload.jpeg else ()

    def fill_batch(self, indices: np.ndarray, out: Allocator) -> tuple[np.ndarray, np.ndarray]:
        images, labels = super().fill_batch(indices, out)
        if self.costs.latency_s:
            time.sleep(self.costs.latency_s)
        if self.costs.cpu_s:
            spend_cpu(self.costs.cpu_s)
        if self.decode is not None:
            for row, index in enumerate(indices):
                image, _ = self.decode(self.jpegs[index % len(self.jpegs)])
                image[0, 0, 0], image[-1, -1, -1] = images[row, 0, 0, 0], images[row, -1, -1, -1]
                images[row] = image
        return images, labels

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.fill_batch(indices, FreshArrays)


def loader(workload: TunedWorkload, setting: Setting) -> ShmSequence:
    """ShmSequence as the transport matrix's shmseq-inplace, with the setting's workers and ring."""
    return ShmSequence(CostlyWorker(workload), workload.epoch_samples,
                       batch_size=workload.batch_size,
                       slot_bytes=workload.batch_bytes + systems.SLOT_SLACK, shuffle=False, seed=0,
                       out_type=cpu_out(), start_method=systems.START_METHOD, **setting.options)


class Trace:
    """A run's worker count and the batches/s it delivered, every ``TRACE_SECONDS`` from its
    start (made as its loader is); its most and last worker counts, and its ring's slots. The
    count is the setting's, or auto's own (``seq.stats.workers``)."""

    def __init__(self, setting: Setting) -> None:
        self.fixed = setting.workers if isinstance(setting.workers, int) else None
        self.points: list[tuple[float, int | None, float]] = []
        self.most = self.final = self.fixed
        self.slots: int | None = None
        self.seq: ShmSequence | None = None
        self.start = self.since = time.perf_counter()
        self.count = 0

    def follow(self, seq: ShmSequence) -> ShmSequence:
        self.seq = seq
        return seq

    def workers(self) -> int | None:
        if self.fixed is not None or self.seq is None:
            return self.fixed
        said = getattr(self.seq.stats, "workers", None)
        return None if said is None else int(said)

    def batch(self) -> None:
        """A batch arrived: the counts as they are now, and a point where one is due."""
        self.count += 1
        self.final = self.workers()
        if self.final is not None:
            self.most = max(self.most or 0, self.final)
        if self.slots is None and self.seq is not None:
            self.slots = ring_slots(self.seq)
        now = time.perf_counter()
        if now - self.since >= TRACE_SECONDS:
            self.points.append((round(now - self.start, 3), self.final,
                                self.count / (now - self.since)))
            self.since, self.count = now, 0

    def figures(self) -> dict:
        """``TunedRun``'s fields."""
        return {"workers_max": self.most, "workers_final": self.final, "ring_slots": self.slots,
                "trace": self.points}


def ring_slots(seq: ShmSequence) -> int | None:
    """The slots of the loader's ring (None: no ring, as with ``num_workers=0``)."""
    ring = getattr(seq.pipeline, "ring", None)
    return None if ring is None else ring.spec.n_slots


def trainer(workload: TunedWorkload, trace: Trace) -> Callable[[int, object], None]:
    """The consumer: checks each batch as every bench mode does, traces it, and takes the
    workload's step (a sleep: the thread waits, as on an accelerator, without CPU)."""
    def step(k: int, batch: Any) -> None:
        check_batch(workload, k, batch)
        trace.batch()
        if workload.step_s:
            time.sleep(workload.step_s)
    return step


@dataclass
class TunedRun(Run):
    """A run of one setting, with its workers (the most and the last), its ring's slots and
    its trace: (seconds since the loader was made, workers, batches/s)."""

    workers_max: int | None = None
    workers_final: int | None = None
    ring_slots: int | None = None
    trace: list[tuple[float, int | None, float]] = field(default_factory=list)


# -- what runs ---------------------------------------------------------------------------------
def auto_refused() -> str | None:
    """Why ShmSequence refuses ``num_workers='auto'`` here (its error), or None: it takes it."""
    try:
        ShmSequence(InPlaceWorker(AUTOTUNE_WORKLOADS["latency"]), 1, out_type="null",
                    **Setting(AUTO).options)
    except (TypeError, ValueError) as exc:
        if "num_workers" not in str(exc):
            raise
        return str(exc)
    return None


def fixed_default_ring() -> int | None:
    """ShmSequence's default ``buffer`` where it is a fixed number of slots; None where the
    ring is sized by the loader."""
    default = inspect.signature(ShmSequence).parameters["buffer"].default
    return default if isinstance(default, int) else None


@dataclass
class Matrix:
    """What runs: each workload's settings, those of its sweep and who picks which (by
    workload, by setting name), auto's window, and why a self-tuned setting was left out."""

    workloads: list[TunedWorkload]
    settings: dict[str, dict[str, Setting]]
    swept: dict[str, list[str]]
    picks: dict[str, dict[str, list[str]]]
    settle_s: float
    left_out: list[str]

    @property
    def names(self) -> list[str]:
        """Every setting's name, in the order of the first workload that runs it."""
        return list(dict.fromkeys(name for found in self.settings.values() for name in found))

    def runs_on(self, name: str, workload: object) -> bool:
        return isinstance(workload, TunedWorkload) and name in self.settings[workload.name]

    def setting(self, workload: str, name: str) -> Setting:
        return self.settings[workload][name]

    def in_order(self, cells: list[Cell]) -> list[Cell]:
        """The cells by workload and setting, in the order the matrix lists them."""
        order = [(workload, name) for workload, found in self.settings.items() for name in found]
        return sorted(cells, key=lambda c: order.index((c.workload, c.system)))

    def measure(self, name: str, workload: TunedWorkload, repeat: int, seconds: float,
                warmup_seconds: float) -> TunedRun:
        """``run_matrix``'s ``measure``: one setting on one workload, traced; ``auto`` timed
        from ``settle_s`` after its start, with no PSS sampling meanwhile (its CPU would be
        taken from the loader sizing its pool by the CPU it finds free)."""
        setting = self.setting(workload.name, name)
        tuning = setting.workers == AUTO
        trace = Trace(setting)
        run = timed_run(name, workload.name, repeat, lambda: running(workload, setting, trace),
                        trainer(workload, trace), seconds, warmup_seconds, EARLY_BATCHES,
                        window_at=self.settle_s if tuning else 0.0,
                        pss_every=None if tuning else SAMPLE_SECONDS)
        return TunedRun(**asdict(run), **trace.figures())


def running(workload: TunedWorkload, setting: Setting, trace: Trace) -> ContextManager[Iterator]:
    """The setting's batches: ShmSequence's, traced; with ``num_workers=0`` built in the
    trainer's thread, as torch's DataLoader builds them (the transport matrix's ``serial``:
    ShmSequence's own ``num_workers=0`` also encodes each batch as into a slot, a second copy)."""
    if setting.workers == 0:
        return systems.serial(workload, CostlyWorker(workload))
    return started(trace.follow(loader(workload, setting)))


def matrix(names: list[str], settle_s: float, log: Callable[[str], None]) -> Matrix:
    """The settings of each workload named: its sweep, the self-tuned setting where this
    ShmSequence has it (saying why not where not), the static rules' picks."""
    refused, fixed_ring = auto_refused(), fixed_default_ring()
    left_out = []
    if refused:
        left_out.append(f"num_workers='{AUTO}' not run: this ShmSequence refuses it "
                        f"({refused}); its rows appear once it takes it")
    if fixed_ring:
        left_out.append(f"the default ring not run: this ShmSequence's buffer defaults to a "
                        f"fixed {fixed_ring} slots (the buffer={fixed_ring} rows); its rows "
                        "appear once the ring is sized from the batch")
    for line in left_out:
        log(line)
    workloads = [AUTOTUNE_WORKLOADS[name] for name in names]
    settings, swept, picks = {}, {}, {}
    for workload in workloads:
        tuned = self_tuned(workload)
        available = refused is None if tuned.workers == AUTO else fixed_ring is None
        fixed, found = sweep(workload, usable_cores()), static_picks(workload)
        chosen = [*fixed, *([tuned] if available else []), *found]
        settings[workload.name] = {s.name: s for s in chosen}
        swept[workload.name] = [s.name for s in fixed]
        picks[workload.name] = {s.name: who for s, who in found.items()}
    return Matrix(workloads, settings, swept, picks, settle_s, left_out)


# -- the report --------------------------------------------------------------------------------
COLUMNS = """\
What the columns mean:
- batches/s, GB/s: what the trainer received, every batch checked; median of the repeats
  (min-max). Fixed settings are timed after their first {early} batches and a warm-up;
  num_workers='auto' from {settle:g} s after its loader was made (its start, first batch and
  tuning inside those {settle:g} s).
- × best: over the rate of the best setting of the workload's sweep (picked by: "best of the
  sweep"); the static rules' picks may beat it.
- workers: the setting's; auto's, the most it ran and the last (seq.stats.workers).
- ring slots: the slots of the loader's ring (— for num_workers=0: batches built in the
  trainer's process, no ring).
- first batch s: from making the loader to its first batch in hand."""


def batches_rate(cell: Cell) -> str:
    """The cell's batches/s, with their min-max over two or more runs."""
    gigabytes = AUTOTUNE_WORKLOADS[cell.workload].batch_bytes / 1e9
    low, high = cell.gb_per_s_spread
    return with_spread(cell.batches_per_s, (low / gigabytes, high / gigabytes), ",.1f", cell.runs)


def tuned_runs(runs: list[Run], workload: str, name: str) -> list[TunedRun]:
    return [r for r in runs
            if isinstance(r, TunedRun) and (r.workload, r.system) == (workload, name)]


def _median(runs: list[TunedRun], figure: str) -> float | None:
    values = [getattr(r, figure) for r in runs if getattr(r, figure) is not None]
    return statistics.median(values) if values else None


def best_swept(cells: list[Cell], matrix: Matrix, workload: str) -> Cell | None:
    """The fastest setting of the workload's sweep (median batches/s)."""
    return max((c for _, c in _swept(cells, matrix, workload)), key=lambda c: c.batches_per_s,
               default=None)


def _swept(cells: list[Cell], matrix: Matrix, workload: str) -> list[tuple[Setting, Cell]]:
    """The settings of a workload's sweep that ran, with their cells, in the sweep's order."""
    get = {c.system: c for c in cells if c.workload == workload}
    return [(matrix.setting(workload, name), get[name]) for name in matrix.swept[workload]
            if name in get]


def _workers(runs: list[TunedRun], setting: Setting) -> str:
    if setting.workers != AUTO:
        return str(setting.workers)
    return (f"{_fmt(_median(runs, 'workers_max'), '.0f')} max, "
            f"{_fmt(_median(runs, 'workers_final'), '.0f')} last")


def table(runs: list[Run], cells: list[Cell], matrix: Matrix) -> str:
    """Every setting on every workload: its rates, who picks it, its workers and ring."""
    spread = " (min-max)" if any(c.runs > 1 for c in cells) else ""
    lines = [f"| workload | setting | picked by | batches/s{spread} | GB/s | × best | workers | "
             "ring slots | first batch s |", "| --- | --- | --- |" + " ---: |" * 6]
    for c in cells:
        best = best_swept(cells, matrix, c.workload)
        picked = matrix.picks[c.workload].get(c.system, []) + ["best of the sweep"] * (c is best)
        found = tuned_runs(runs, c.workload, c.system)
        of_best = None if best is None else c.batches_per_s / best.batches_per_s
        lines.append(f"| {c.workload} | {c.system} | {', '.join(picked)} | {batches_rate(c)} | "
                     f"{c.gb_per_s:.3f} | {_fmt(of_best, '.2f')} | "
                     f"{_workers(found, matrix.setting(c.workload, c.system))} | "
                     f"{_fmt(_median(found, 'ring_slots'), '.0f')} | "
                     f"{_fmt(c.first_batch_s, '.3f')} |")
    return "\n".join(lines)


# -- what it shows -----------------------------------------------------------------------------
def _rates(runs: list[Run], workload: str, ours: str, theirs: str) -> list[float]:
    """Our batches/s over theirs, repeat by repeat (the two ran side by side)."""
    return [mine.batches_per_second / other.batches_per_second
            for mine, other in paired(runs, workload, ours, theirs)]


def _against(target: float, ratios: list[float]) -> str:
    return f"target >= {target:.2f}x: {'met' if statistics.median(ratios) >= target else 'not met'}"


def tuned_line(runs: list[Run], get: dict[str, Cell], best: Cell, workload: TunedWorkload,
               settle_s: float) -> str:
    """The self-tuned setting against the sweep's best, and the target it is held to."""
    name = self_tuned(workload).name
    best_said = f"{best.system}: {batches_rate(best)} batches/s"
    if name not in get:
        return f"{workload.name}: {name} not run (see above); the sweep's best: {best_said}"
    ratios = _rates(runs, workload.name, name, best.system)
    since = f" from {settle_s:g} s after its start" if workload.case != "ring" else ""
    return (f"{workload.name}: {name} {batches_rate(get[name])} batches/s{since}, "
            f"{_ratio(ratios)} the sweep's best ({best_said}), repeat by repeat; "
            f"{_against(TARGETS['ring' if workload.case == 'ring' else 'auto'], ratios)}"
            f"{_tuned_detail(workload, tuned_runs(runs, workload.name, name))}")


def _tuned_detail(workload: TunedWorkload, found: list[TunedRun]) -> str:
    """What the loader picked: the default ring's slots, or auto's workers (against the CPU
    budget, where the workers are CPU-bound)."""
    if workload.case == "ring":
        return f"; the default ring had {_fmt(_median(found, 'ring_slots'), '.0f')} slots"
    detail = (f"; {_fmt(_median(found, 'workers_max'), '.0f')} workers at most, "
              f"{_fmt(_median(found, 'workers_final'), '.0f')} at the end")
    if workload.case == "cpu":
        detail += f", against a CPU budget of {usable_cores()} cores (target: at most that)"
    return detail


def sweep_line(cells: list[Cell], matrix: Matrix, workload: TunedWorkload) -> str:
    """Each swept setting's rate: GB/s by ring slots (to calibrate the default ring), or
    batches/s by workers."""
    swept = _swept(cells, matrix, workload.name)
    if workload.case == "ring":
        return (f"{workload.name}: GB/s by ring slots ({RING_WORKERS} workers): "
                + ", ".join(f"{s.buffer}: {c.gb_per_s:.2f}" for s, c in swept))
    return (f"{workload.name}: batches/s by workers: "
            + ", ".join(f"{s.workers}: {c.batches_per_s:,.1f}" for s, c in swept))


def fewest_line(runs: list[Run], cells: list[Cell], matrix: Matrix, best: Cell,
                workload: TunedWorkload) -> str:
    """Trainer-bound: the fewest workers whose rate is within 2 % of the best, and auto's
    count at the end (its target)."""
    near = [s.workers for s, c in _swept(cells, matrix, workload.name)
            if c.batches_per_s >= NEAR_BEST * best.batches_per_s]
    name = self_tuned(workload).name
    found = tuned_runs(runs, workload.name, name)
    ended = (f"{name} ended with {_fmt(_median(found, 'workers_final'), '.0f')}" if found
             else f"{name} not run")
    return (f"{workload.name}: the fewest workers within {100 * (1 - NEAR_BEST):.0f} % of the "
            f"sweep's best rate: {min(near)}; {ended} (target: {min(near)})")


def static_line(runs: list[Run], matrix: Matrix, best: Cell, workload: str) -> str | None:
    """What the static rules pick on a workload, and how it fares against the sweep's best."""
    if not matrix.picks[workload]:
        return None
    return f"{workload}: " + "; ".join(
        f"{' and '.join(who)} ({name}): {_ratio(_rates(runs, workload, name, best.system))} "
        "the sweep's best" for name, who in matrix.picks[workload].items())


def highlights(runs: list[Run], cells: list[Cell], matrix: Matrix) -> list[str]:
    found: list[str | None] = []
    for workload in matrix.workloads:
        best = best_swept(cells, matrix, workload.name)
        if best is None:
            continue
        get = {c.system: c for c in cells if c.workload == workload.name}
        found += [tuned_line(runs, get, best, workload, matrix.settle_s),
                  sweep_line(cells, matrix, workload)]
        if workload.case == "trainer":
            found.append(fewest_line(runs, cells, matrix, best, workload))
        found.append(static_line(runs, matrix, best, workload.name))
    return [line for line in found if line]


def markdown(runs: list[Run], matrix: Matrix, info: dict, settings: dict, command: str,
             load: list[str], warning: str | None = None) -> str:
    """The table with its machine and load (a ``warning`` if it was busy), what was left out
    and why, the workloads, the columns, the static rules, what it shows, the command."""
    cells = matrix.in_order(summarize(runs, AUTOTUNE_WORKLOADS))
    head = (f"{machine_line(info)} CPU budget: {usable_cores()} usable cores. Timed: "
            f"{timing(settings)}; num_workers='{AUTO}' from {matrix.settle_s:g} s after its "
            "loader was made.")
    about = "\n".join(f"- {w.name}: {w.about}; {w.batch_size} x {w.side}x{w.side}x3 uint8 "
                      f"({w.batch_bytes / 1e6:.2f} MB a batch)" for w in matrix.workloads)
    shows = "\n".join(f"- {line}" for line in highlights(runs, cells, matrix))
    rules = STATIC_RULES.format(ram=f"{ram_mb():,}", cores=multiprocessing.cpu_count())
    parts = [head, "Load: " + "; ".join(load), warning, *matrix.left_out,
             "Workloads:\n" + about, table(runs, cells, matrix),
             COLUMNS.format(early=EARLY_BATCHES, settle=matrix.settle_s), rules,
             f"What it shows:\n{shows}" if shows else None, f"Reproduce: `{command}`"]
    return "\n\n".join(part for part in parts if part) + "\n"


# -- the chart ---------------------------------------------------------------------------------
def traced(runs: list[Run], matrix: Matrix) -> list[TunedWorkload]:
    """The workloads where num_workers='auto' ran: those the chart draws."""
    return [w for w in matrix.workloads
            if self_tuned(w).workers == AUTO and tuned_runs(runs, w.name, self_tuned(w).name)]


def write_chart(path: Path, runs: list[Run], matrix: Matrix) -> bool:
    """auto's worker count and batches/s over time, a panel a workload, its sweep's best rate
    and the start of its window marked; False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    workloads = traced(runs, matrix)
    cells = summarize(runs, AUTOTUNE_WORKLOADS)
    figure, panels = pyplot.subplots(len(workloads), 1, figsize=(9, 3.2 * len(workloads)),
                                     squeeze=False)
    for axes, workload in zip(panels[:, 0], workloads):
        _draw(axes, runs, best_swept(cells, matrix, workload.name), workload, matrix.settle_s)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True


def _draw(axes: Axes, runs: list[Run], best: Cell | None, workload: TunedWorkload,
          settle_s: float) -> None:
    """One workload's panel: each repeat's rate (left axis) and workers (right axis)."""
    counts = axes.twinx()
    for n, run in enumerate(tuned_runs(runs, workload.name, self_tuned(workload).name)):
        axes.plot([t for t, _, _ in run.trace], [rate for _, _, rate in run.trace],
                  color="tab:blue", alpha=0.7, label=None if n else "batches/s, each repeat")
        counted = [(t, workers) for t, workers, _ in run.trace if workers is not None]
        counts.step([t for t, _ in counted], [workers for _, workers in counted], where="post",
                    color="tab:orange", alpha=0.7, label=None if n else "workers, each repeat")
    if best is not None:
        axes.axhline(best.batches_per_s, color="black", linestyle="dashed",
                     label=f"the sweep's best: {best.system}")
    axes.axvline(settle_s, color="grey", linestyle="dotted", label="timed window starts")
    axes.set_title(f"{workload.name}: num_workers='{AUTO}' over time")
    axes.set_xlabel("seconds since the loader was made")
    axes.set_ylabel("batches/s (every 0.5 s)")
    axes.set_ylim(bottom=0)
    counts.set_ylabel("workers")
    counts.set_ylim(bottom=0)
    lines, labels = axes.get_legend_handles_labels()
    more, more_labels = counts.get_legend_handles_labels()
    axes.legend(lines + more, labels + more_labels, fontsize="small", loc="lower right")
