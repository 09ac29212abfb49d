"""From runs to results: one cell per system and workload, the table, what it shows, JSON, a chart.

A cell's figures are medians over its repeats, with the min-max spread of its rates
(the repeats interleave the systems, so that a shared machine's drift hits them
alike; a single repeat has no spread). Ratios are taken within one run: only figures
measured side by side compare.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from shmseq._apps.report import with_spread

from .runner import LIMIT, Run
from .systems import ABOUT, NUM_WORKERS, TORCH_SYSTEMS
from .workloads import WORKLOADS

if TYPE_CHECKING:  # matplotlib is optional: imported where a chart is drawn
    from matplotlib.figure import Figure

COLUMNS = """\
What the columns mean:
- GB/s, batches/s: what the consumer received, every batch checked; median of the repeats
  (min-max); a single run has no spread.
- consumer CPU µs/batch: CPU time of the training process per batch, all its threads (so it
  includes building the batches for shmseq-thread and serial): what a loader takes from your
  training step.
- first batch s: from creating the loader (workers started) to the first batch in hand.
- first 100 × steady: the rate over the 100 batches after the first, over the steady rate (the
  GB/s column, measured after them): how soon the loader runs at full speed.
- × limit: GB/s over the limit's. The limit is the batches' own cost: the same batches built
  by the workers' own code, with no transport, no consumer and no batches in flight, by 1 and
  by 2 processes in turn, each rewriting one buffer (which stays in cache where a batch fits);
  the faster of the two. Every loader does that work and more, but each system is timed in
  its own window: where the machine ran faster in a loader's window than in the limit's, its
  ratio comes out above 1.00, and is marked †."""

ABOVE_LIMIT = "†"


@dataclass
class Cell:
    """One system on one workload, summarised over its repeats."""

    workload: str
    system: str
    gb_per_s: float
    gb_per_s_spread: tuple[float, float]
    batches_per_s: float
    cpu_us_per_batch: float | None
    first_batch_s: float | None
    of_limit: float | None
    early_of_steady: float | None = None
    runs: int = 1  # the repeats summarised: a spread needs two or more
    pss_bytes: float | None = None  # the process tree's peak PSS, median over the repeats
    pss_spread: tuple[int, int] | None = None
    # a remote loader's figures (``Run``'s), median over the repeats, and their min-max by name
    requests_per_sample: float | None = None
    read_amplification: float | None = None
    cache_peak_bytes: float | None = None
    spreads: dict[str, tuple[float, float]] = field(default_factory=dict)


REMOTE_FIGURES = ("requests_per_sample", "read_amplification", "cache_peak_bytes")


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[Run], workloads: Mapping = WORKLOADS) -> list[Cell]:
    """One cell per (workload, system), in the order the runs came (``workloads``: each
    workload by name, for its ``batch_bytes``)."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.system), []).append(run)
    cells = []
    for (workload, system), group in groups.items():
        rates = [r.batches_per_second for r in group]
        rate = statistics.median(rates)  # every run has one
        gigabytes = workloads[workload].batch_bytes / 1e9
        peaks = [r.peak_pss_bytes for r in group if r.peak_pss_bytes is not None]
        cells.append(Cell(workload, system, rate * gigabytes,
                          (min(rates) * gigabytes, max(rates) * gigabytes), rate,
                          _median([r.cpu_us_per_batch for r in group]),
                          _median([r.first_batch_seconds for r in group]), None,
                          _early_of_steady(group), len(group), _median(peaks),
                          (min(peaks), max(peaks)) if peaks else None, **_remote(group)))
    limits = {c.workload: c.gb_per_s for c in cells if c.system == LIMIT}
    for cell in cells:
        if cell.workload in limits:
            cell.of_limit = cell.gb_per_s / limits[cell.workload]
    return cells


def _remote(group: list[Run]) -> dict:
    """``Cell``'s remote figures of a group of runs: medians, and their min-max in ``spreads``."""
    found: dict = {"spreads": {}}
    for name in REMOTE_FIGURES:
        values = [getattr(r, name) for r in group if getattr(r, name) is not None]
        if values:
            found[name] = _median(values)
            found["spreads"][name] = (min(values), max(values))
    return found


def _early_of_steady(group: list[Run]) -> float | None:
    """The median over the repeats of each one's early rate over its steady rate."""
    return _median([r.early_batches_per_second / r.batches_per_second for r in group
                    if r.early_batches_per_second is not None])


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def above_limit(ratio: float | None) -> bool:
    """Whether a ``× limit`` ratio shows above 1.00, as printed (two decimals)."""
    return ratio is not None and round(ratio, 2) > 1.0


def of_limit(ratio: float | None) -> str:
    """The ``× limit`` cell: two decimals, marked where above 1.00 (see ``COLUMNS``)."""
    return _fmt(ratio, ".2f") + (ABOVE_LIMIT if above_limit(ratio) else "")


def table(cells: list[Cell]) -> str:
    """The results as a markdown table."""
    rates = "GB/s (min-max)" if any(c.runs > 1 for c in cells) else "GB/s"
    lines = [f"| workload | system | {rates} | batches/s | consumer CPU µs/batch | "
             "first batch s | first 100 × steady | × limit |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        lines.append(f"| {c.workload} | {c.system} | {_rate(c)} | "
                     f"{c.batches_per_s:.1f} | {_fmt(c.cpu_us_per_batch, '.0f')} | "
                     f"{_fmt(c.first_batch_s, '.3f')} | {_fmt(c.early_of_steady, '.2f')} | "
                     f"{of_limit(c.of_limit)} |")
    return "\n".join(lines)


def gb_per_s(cell: Cell) -> str:
    return f"{_rate(cell)} GB/s"


def drift_note(cells: list[Cell], rate: Callable[[Cell], str] = gb_per_s) -> str | None:
    """Under the table, where a ratio shows above 1.00: which, and the limit's own rates
    (``rate`` words a cell's: its GB/s here, its images/s in the streaming report)."""
    above = [c for c in cells if c.system != LIMIT and above_limit(c.of_limit)]
    if not above:
        return None
    limits = {c.workload: c for c in cells if c.system == LIMIT}
    named = ", ".join(f"{c.workload} {c.system} {c.of_limit:.2f}" for c in above)
    rates = ", ".join(f"{w} {rate(limits[w])}" for w in dict.fromkeys(c.workload for c in above))
    return (f"{ABOVE_LIMIT} Above the limit: {named}. Each system is timed in a window of its "
            "own: the machine ran faster in these loaders' windows than in the limit's "
            f"({rates}); more repeats narrow that drift. No loader does less work than the limit.")


def _rate(cell: Cell) -> str:
    return with_spread(cell.gb_per_s, cell.gb_per_s_spread, ".2f", cell.runs)


SHMSEQ_PROCESSES = ("shmseq-proc", "shmseq-inplace")  # their consumer CPU is the transport's
DROP_IN, ITS_ORIGINAL = "shmseq-torch", "torch-sample"  # the same loader arguments, side by side


def highlights(cells: list[Cell]) -> list[str]:
    """Per workload: shmseq's faster process system against PyTorch DataLoader's best, the bare
    ring (shmseq's own overhead) and the limit; shmseq.torch's DataLoader against torch's."""
    found = []
    for workload in dict.fromkeys(c.workload for c in cells):
        found += _drop_in(cells, workload)
        mine = [c for c in cells if c.workload == workload and c.system in SHMSEQ_PROCESSES]
        torch = [c for c in cells if c.workload == workload and c.system in TORCH_SYSTEMS
                 and c.system != DROP_IN]
        if not mine:
            continue
        best = max(mine, key=lambda c: c.gb_per_s)
        assert best.cpu_us_per_batch is not None  # a loader's (only the limit has none)
        line = f"{workload}: {best.system} {best.gb_per_s:.2f} GB/s"
        if torch:
            rival = max(torch, key=lambda c: c.gb_per_s)
            assert rival.cpu_us_per_batch is not None
            line += (f", {best.gb_per_s / rival.gb_per_s:.1f}x PyTorch DataLoader's best "
                     f"({rival.system}, {rival.gb_per_s:.2f} GB/s), with "
                     f"{rival.cpu_us_per_batch / best.cpu_us_per_batch:.1f}x less consumer CPU "
                     f"a batch ({best.cpu_us_per_batch:.0f} against {rival.cpu_us_per_batch:.0f} µs)")
        bare = [c for c in cells if c.workload == workload and c.system == "bare-ring"]
        if bare:
            assert bare[0].cpu_us_per_batch is not None
            line += (f"; {best.gb_per_s / bare[0].gb_per_s:.2f}x the bare ring's GB/s with "
                     f"{best.cpu_us_per_batch / bare[0].cpu_us_per_batch:.1f}x its consumer CPU")
        if best.of_limit is not None:
            line += f"; {best.of_limit:.2f}x the limit{ABOVE_LIMIT * above_limit(best.of_limit)}"
        found.append(line)
    return found


def _drop_in(cells: list[Cell], workload: str) -> list[str]:
    """shmseq.torch's DataLoader against torch's, given the same arguments."""
    get = {c.system: c for c in cells if c.workload == workload}
    if DROP_IN not in get or ITS_ORIGINAL not in get:
        return []
    ours, theirs = get[DROP_IN], get[ITS_ORIGINAL]
    assert ours.cpu_us_per_batch is not None and theirs.cpu_us_per_batch is not None  # loaders'
    images = WORKLOADS[workload].batch_size
    return [f"{workload}: {DROP_IN} {ours.batches_per_s * images:,.0f} images/s "
            f"({ours.gb_per_s:.2f} GB/s), {ours.gb_per_s / theirs.gb_per_s:.2f}x torch's "
            f"DataLoader given the same arguments ({theirs.batches_per_s * images:,.0f} "
            f"images/s), with {theirs.cpu_us_per_batch / ours.cpu_us_per_batch:.1f}x less "
            f"consumer CPU a batch ({ours.cpu_us_per_batch:.0f} against "
            f"{theirs.cpu_us_per_batch:.0f} µs)"]


def systems_legend(cells: list[Cell]) -> str:
    """What each system of the table is, in the table's order."""
    about = {LIMIT: "the batches' own cost, with no transport at all (see × limit)", **ABOUT}
    return "What the systems are:\n" + "\n".join(
        f"- {name}: {about[name]}" for name in dict.fromkeys(c.system for c in cells))


def machine_line(info: dict) -> str:
    """What the figures were measured on, as the reports' first line begins."""
    return (f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['ram']} RAM; Python "
            f"{info['python']}, numpy {info['numpy']}, torch {info['torch']}.")


def timing(settings: dict) -> str:
    """How each figure was timed: its repeats and their window."""
    repeats = settings["repeats"]
    return (f"{repeats} interleaved repeats of {settings['seconds']:g} s, medians (min-max)"
            if repeats > 1 else f"one run of {settings['seconds']:g} s each (no spread)")


def markdown(cells: list[Cell], info: dict, settings: dict, command: str,
             load: Sequence[str] = (), warning: str | None = None) -> str:
    """The table with its machine and load (a ``warning`` if it was busy), what each column
    and system is, what it shows, the command."""
    head = (f"{machine_line(info)} 2 workers and {settings['buffer']} batches in flight for "
            f"every loader; {timing(settings)}.")
    shows = "\n".join(f"- {line}" for line in highlights(cells))
    parts = [head, "Load: " + "; ".join(load) if load else None, warning, table(cells),
             drift_note(cells), COLUMNS, systems_legend(cells),
             f"What it shows:\n{shows}" if shows else None, f"Reproduce: `{command}`"]
    return "\n\n".join(part for part in parts if part) + "\n"


def write_json(path: Path, runs: list[Run], cells: list[Cell], info: dict, settings: dict) -> None:
    document = {"machine": info, "settings": settings, "summary": [asdict(c) for c in cells],
                "runs": [asdict(r) for r in runs]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_chart(path: Path, cells: list[Cell]) -> bool:
    """``chart_figure`` written to ``path``; False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure = chart_figure(cells)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True


def chart_figure(cells: list[Cell]) -> Figure:
    """GB/s per workload and system, the limit marked, min-max bars only where a cell has two
    or more runs, and a title that says which (needs matplotlib, with a backend chosen)."""
    from matplotlib import pyplot

    workloads = list(dict.fromkeys(c.workload for c in cells))
    systems = list(dict.fromkeys(c.system for c in cells if c.system != LIMIT))
    get = {(c.workload, c.system): c for c in cells}
    width = 0.8 / max(len(systems), 1)
    figure, axes = pyplot.subplots(figsize=(11, 5))
    for i, system in enumerate(systems):
        xs = [w + (i - (len(systems) - 1) / 2) * width for w in range(len(workloads))]
        found = [get.get((wl, system)) for wl in workloads]
        ys = [c.gb_per_s if c else 0 for c in found]
        axes.bar(xs, ys, width, yerr=_spread_bars(found), capsize=2, label=system)
    label = "limit (no transport)"
    for w, workload in enumerate(workloads):
        if (workload, LIMIT) in get:
            axes.hlines(get[workload, LIMIT].gb_per_s, w - 0.45, w + 0.45, colors="black",
                        linestyles="dashed", label=label)
            label = ""  # in the legend once
    axes.set_xticks(range(len(workloads)), workloads)
    axes.set_yscale("log")
    axes.set_ylabel("GB/s delivered (log scale)")
    axes.set_title(f"Batches delivered to the consumer, {NUM_WORKERS} workers "
                   f"({_what_bars_show(cells)})")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    return figure


def _spread_bars(found: list[Cell | None]) -> list[list[float]] | None:
    """A system's min-max bars, below and above each median; None where no cell of it has
    two runs: one run has no spread, and a bar of zero would claim one."""
    if not any(c is not None and c.runs > 1 for c in found):
        return None
    return [[c.gb_per_s - c.gb_per_s_spread[0] if c else 0 for c in found],
            [c.gb_per_s_spread[1] - c.gb_per_s if c else 0 for c in found]]


def _what_bars_show(cells: list[Cell]) -> str:
    """What the chart's figures are: one run's, or medians of how many runs, with bars."""
    counts = sorted({c.runs for c in cells})
    if counts[-1] == 1:
        return "one run each: no spread"
    runs = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    return f"median of {runs} runs, bars: min-max"
