"""The autotune bench's matrix (``shmseq.bench.autotune``): each workload's fixed settings (its
sweep), what the static rules of torch's DataLoader and Grain pick, the self-tuned setting
where this ShmSequence has it, and how one setting runs on one workload (``Matrix.measure``).
"""
from __future__ import annotations

import inspect
import multiprocessing
import os
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager, Iterator

from shmseq import ShmSequence
from shmseq._apps.load import usable_cores

from . import systems
from .autotune_runs import (AUTO, AUTOTUNE_WORKLOADS, RING_WORKERS, CostlyWorker, Setting, Trace,
                            TunedRun, TunedWorkload, in_flight, loader, self_tuned, trainer)
from .memory import SAMPLE_SECONDS
from .report import Cell
from .runner import timed_run
from .streaming import started
from .workloads import InPlaceWorker

WORKER_SWEEP = (1, 2, 4, 6, 8, 12, 16)   # the latency-bound sweep
RING_SWEEP = (2, 3, 4, 5, 6, 8, 10)      # ring slots, with RING_WORKERS workers
SETTLE_SECONDS = 10.0   # auto's timed window starts this long after its loader is made
EARLY_BATCHES = 10      # timed apart after the first, as runner.timed_run does
GRAIN_RULE = "google/grain: grain/_src/python/dataset/transformations/prefetch_autotune.py"


def cores_sweep(budget: int) -> list[int]:
    """Worker counts from 1 to twice the CPU budget: each up to 4, then the latency sweep's."""
    return sorted({w for w in (1, 2, 3, 4, *WORKER_SWEEP, 24, 32) if w <= 2 * budget} | {budget})


def sweep(workload: TunedWorkload, budget: int) -> list[Setting]:
    """The fixed settings a workload is swept over."""
    if workload.case == "ring":
        return [Setting(RING_WORKERS, slots) for slots in RING_SWEEP]
    counts = WORKER_SWEEP if workload.case == "latency" else cores_sweep(budget)
    return [Setting(count, in_flight(count)) for count in counts]


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
