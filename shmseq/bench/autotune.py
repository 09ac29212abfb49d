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

Here the report and the chart; what runs is ``autotune_runs``'s (workloads, workers, traces)
and ``autotune_matrix``'s (the settings, the static rules, a run); their names stay importable
from here.
"""
from __future__ import annotations

import multiprocessing
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from shmseq._apps.load import usable_cores
from shmseq._apps.report import with_spread

from .autotune_matrix import (EARLY_BATCHES, GRAIN_RULE, RING_SWEEP, SETTLE_SECONDS, STATIC_RULES,
                              WORKER_SWEEP, Matrix, auto_refused, cores_sweep, fixed_default_ring,
                              grain_workers, matrix, ram_mb, running, started, static_picks, sweep)
from .autotune_runs import (AUTO, AUTOTUNE_WORKLOADS, JPEGS, RING_WORKERS, TRACE_SECONDS,
                            CostlyWorker, FreshArrays, Setting, Trace, TunedRun, TunedWorkload,
                            in_flight, jpeg_pool, loader, ring_slots, self_tuned, spend_cpu, trainer)
from .report import Cell, _fmt, machine_line, summarize, timing
from .runner import Run
from .streaming_report import paired, ratio_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["AUTO", "AUTOTUNE_WORKLOADS", "COLUMNS", "EARLY_BATCHES", "GRAIN_RULE", "JPEGS", "NEAR_BEST",
           "RING_SWEEP", "RING_WORKERS", "SETTLE_SECONDS", "STATIC_RULES", "TARGETS", "TRACE_SECONDS",
           "WORKER_SWEEP", "CostlyWorker", "FreshArrays", "Matrix", "Setting", "Trace", "TunedRun",
           "TunedWorkload", "auto_refused", "batches_rate", "best_swept", "cores_sweep", "fewest_line",
           "fixed_default_ring", "grain_workers", "highlights", "in_flight", "jpeg_pool", "loader",
           "markdown", "matrix", "ram_mb", "ring_slots", "running", "self_tuned", "spend_cpu", "started",
           "static_line", "static_picks", "sweep", "sweep_line", "table", "traced", "trainer", "tuned_line",
           "tuned_runs", "write_chart"]

NEAR_BEST = 0.98        # within 2 % of the best: enough workers to keep the ring full
TARGETS = {"auto": 0.90, "ring": 0.95}  # of the rate of the sweep's best setting


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
            f"{ratio_text(ratios)} the sweep's best ({best_said}), repeat by repeat; "
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
        f"{' and '.join(who)} ({name}): {ratio_text(_rates(runs, workload, name, best.system))} "
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
