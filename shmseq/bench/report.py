"""From runs to results: one cell per system and workload, the table, targets, JSON, a chart.

A cell's rates are the best of its repeats (on a shared machine noise only ever
slows a run down, the limit's included); its CPU time and first-batch time are
medians. Ratios are taken within one run: only figures measured side by side
compare.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .runner import LIMIT, Run
from .workloads import WORKLOADS

TORCH_SYSTEMS = ("torch-sample", "torch-batch", "torch-sample-fs", "torch-batch-fs")
SHMSEQ_PROCESS = ("shmseq-proc", "shmseq-inplace")


@dataclass
class Cell:
    """One system on one workload, summarised over its repeats."""

    workload: str
    system: str
    gb_per_s: float
    batches_per_s: float
    cpu_us_per_batch: float | None
    first_batch_s: float | None
    of_limit: float | None


@dataclass
class Target:
    text: str
    met: bool


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[Run]) -> list[Cell]:
    """One cell per (workload, system), in the order the runs came."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.system), []).append(run)
    cells = []
    for (workload, system), group in groups.items():
        rate = max(r.batches_per_second for r in group)
        cells.append(Cell(workload, system, rate * WORKLOADS[workload].batch_bytes / 1e9, rate,
                          _median([r.cpu_us_per_batch for r in group]),
                          _median([r.first_batch_seconds for r in group]), None))
    limits = {c.workload: c.gb_per_s for c in cells if c.system == LIMIT}
    for cell in cells:
        if cell.workload in limits:
            cell.of_limit = cell.gb_per_s / limits[cell.workload]
    return cells


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(cells: list[Cell]) -> str:
    """The results as a markdown table."""
    lines = ["| workload | system | GB/s | batches/s | consumer CPU µs/batch | first batch s | × limit |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        lines.append(f"| {c.workload} | {c.system} | {c.gb_per_s:.2f} | {c.batches_per_s:.1f} | "
                     f"{_fmt(c.cpu_us_per_batch, '.0f')} | {_fmt(c.first_batch_s, '.3f')} | "
                     f"{_fmt(c.of_limit, '.2f')} |")
    return "\n".join(lines)


def _vs_torch(get, workload: str, system: str, attr: str, unit: str, factor: float) -> Target | None:
    rivals = [t for t in TORCH_SYSTEMS if (workload, t) in get]
    if (workload, system) not in get or not rivals:
        return None
    rival = max(rivals, key=lambda t: getattr(get[workload, t], attr))
    ours, best = getattr(get[workload, system], attr), getattr(get[workload, rival], attr)
    return Target(f"{workload}: {system} {ours:.4g} {unit} = {ours / best:.1f}x DataLoader's best "
                  f"({rival}, {best:.4g}); target >= {factor:g}x", ours >= factor * best)


def _of_limit(get, workload: str, system: str, factor: float) -> Target | None:
    cell = get.get((workload, system))
    if cell is None or cell.of_limit is None:
        return None
    return Target(f"{workload}: {system} at {cell.of_limit:.2f}x the limit; target >= {factor:g}x",
                  cell.of_limit >= factor)


def targets(cells: list[Cell]) -> list[Target]:
    """The issue's targets, for whichever of their cells this run measured."""
    get = {(c.workload, c.system): c for c in cells}
    found = [_vs_torch(get, "imagenet256", "shmseq-inplace", "gb_per_s", "GB/s", 4),
             _of_limit(get, "imagenet256", "shmseq-inplace", 0.8)]
    found += [_vs_torch(get, "cifar", s, "batches_per_s", "batches/s", 8) for s in SHMSEQ_PROCESS]
    for c in cells:
        if c.system in SHMSEQ_PROCESS:
            found.append(Target(f"{c.workload}: {c.system} consumer CPU {c.cpu_us_per_batch:.0f} "
                                "µs/batch; target <= 300", c.cpu_us_per_batch <= 300))
            found.append(Target(f"{c.workload}: {c.system} first batch {c.first_batch_s:.3f} s "
                                "(fork); target <= 0.5 s", c.first_batch_s <= 0.5))
    return [t for t in found if t is not None]


def _read(path: str, key: str) -> str:
    with open(path) as file:
        for line in file:
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return "unknown"


def machine() -> dict:
    """What the figures were measured on."""
    kib = int(_read("/proc/meminfo", "MemTotal").split()[0])
    return {"nproc": len(os.sched_getaffinity(0)),
            "cpu": _read("/proc/cpuinfo", "model name"),
            "ram": f"{kib / 2**20:.1f} GiB",
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__}


def markdown(cells: list[Cell], found: list[Target], info: dict, settings: dict,
             command: str) -> str:
    """The table with its machine, how to read it, the targets and the command."""
    head = (f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['ram']} RAM; Python "
            f"{info['python']}, numpy {info['numpy']}, torch {info['torch']}.")
    notes = (f"2 workers everywhere. GB/s and batches/s: best of {settings['repeats']} run(s) of "
             f"{settings['seconds']:g} s each; consumer CPU (process time of the consumer process, all "
             "its threads, so it includes building the batches for shmseq-thread and serial) and "
             "first batch (from start, pool start included): medians. The limit: the same 2 "
             "processes building batches into preallocated memory, with no transport.")
    checks = "\n".join(f"- [{'x' if t.met else ' '}] {t.text}" for t in found)
    return (f"{head}\n\n{table(cells)}\n\n{notes}\n\nTargets:\n\n{checks}\n\n"
            f"Reproduce: `{command}`\n")


def write_json(path: Path, runs: list[Run], cells: list[Cell], found: list[Target],
               info: dict, settings: dict) -> None:
    document = {"machine": info, "settings": settings, "summary": [asdict(c) for c in cells],
                "targets": [asdict(t) for t in found], "runs": [asdict(r) for r in runs]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_chart(path: Path, cells: list[Cell]) -> bool:
    """GB/s per workload and system, the limit marked; False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    workloads = list(dict.fromkeys(c.workload for c in cells))
    systems = list(dict.fromkeys(c.system for c in cells if c.system != LIMIT))
    get = {(c.workload, c.system): c for c in cells}
    width = 0.8 / max(len(systems), 1)
    figure, axes = pyplot.subplots(figsize=(11, 5))
    for i, system in enumerate(systems):
        xs = [w + (i - (len(systems) - 1) / 2) * width for w in range(len(workloads))]
        ys = [get[wl, system].gb_per_s if (wl, system) in get else 0 for wl in workloads]
        axes.bar(xs, ys, width, label=system)
    label = "limit (no transport)"
    for w, workload in enumerate(workloads):
        if (workload, LIMIT) in get:
            axes.hlines(get[workload, LIMIT].gb_per_s, w - 0.45, w + 0.45, colors="black",
                        linestyles="dashed", label=label)
            label = None
    axes.set_xticks(range(len(workloads)), workloads)
    axes.set_yscale("log")
    axes.set_ylabel("GB/s delivered (log scale)")
    axes.set_title("Batches delivered to the consumer, 2 workers")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True
