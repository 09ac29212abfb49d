"""The demo's results: the sweep's table, what it shows, JSON and markdown, the chart."""
from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path

from .._apps.report import with_spread
from .sweep import Measurement, Summary, fed_down_to
from .training import Epoch

COLUMNS = """\
step ms: the simulated accelerator's time per training step (the trainer's thread waits, GIL
released, as it does on a GPU); img/s: images delivered per second; stall: the share of the
time the accelerator sat idle, waiting for its next batch (0 %: it never starves); trainer
CPU: the training process's CPU time per batch, all its threads. Medians of the repeats,
(min-max); a single run has no spread."""


def table(summaries: list[Summary]) -> str:
    width = max(len(s.loader) for s in summaries)
    spread = " (min-max)" if any(s.runs > 1 for s in summaries) else ""
    lines = [f"{'step ms':>7}  {'loader':<{width}}  {'img/s' + spread:>22}  "
             f"{'stall' + spread:>16}  {'trainer CPU µs/batch':>20}"]
    for s in summaries:
        rate = with_spread(s.images_per_s, s.images_per_s_spread, ",.0f", s.runs)
        stall = with_spread(s.stall, s.stall_spread, ".0%", s.runs)
        lines.append(f"{s.step_ms:>7g}  {s.loader:<{width}}  {rate:>22}  {stall:>16}  "
                     f"{s.cpu_us_per_batch:>20,.0f}")
    return "\n".join(lines)


def findings(summaries: list[Summary], ours: str = "shmseq") -> list[str]:
    """The step rate each loader keeps fed, and the trainer CPU each takes, against ours."""
    found = []
    loaders = list(dict.fromkeys(s.loader for s in summaries))
    for loader in loaders:
        fastest = fed_down_to(summaries, loader)
        found.append(f"{loader}: keeps a {fastest:g} ms step fed (stall under 5 %)" if fastest
                     else f"{loader}: stalls at every step time tried")
    shortest = min(s.step_ms for s in summaries)
    at = {s.loader: s for s in summaries if s.step_ms == shortest}
    for loader in loaders:
        if loader != ours:
            found.append(
                f"at {shortest:g} ms a step, {ours} delivers "
                f"{at[ours].images_per_s / at[loader].images_per_s:.1f}x the images/s of "
                f"{loader} and takes {at[loader].cpu_us_per_batch / at[ours].cpu_us_per_batch:.1f}x "
                "less trainer CPU a batch")
    return found


def write(out: Path, setup: dict, measurements: list[Measurement], summaries: list[Summary],
          epochs: list[Epoch], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    document = {"setup": setup, "summary": [asdict(s) for s in summaries],
                "measurements": [asdict(m) for m in measurements],
                "training": [asdict(e) for e in epochs]}
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")


def chart(path: Path, summaries: list[Summary], title: str, warning: str | None = None) -> bool:
    """Stall fraction against step time, one line per loader, with the busy machine's
    ``warning`` under it (the chart travels without the text); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    for loader in dict.fromkeys(s.loader for s in summaries):
        points = sorted((s for s in summaries if s.loader == loader), key=lambda s: s.step_ms)
        steps = [s.step_ms for s in points]
        stalls = [100 * s.stall for s in points]
        spread = [[100 * (s.stall - s.stall_spread[0]) for s in points],
                  [100 * (s.stall_spread[1] - s.stall) for s in points]]
        axes.errorbar(steps, stalls, yerr=spread, marker="o", capsize=3, label=loader)
    axes.set_xscale("log")
    axes.invert_xaxis()  # faster accelerators to the right
    axes.set_xticks(steps, [f"{s:g}" for s in steps])
    axes.set_xlabel("accelerator step time, ms (faster to the right)")
    runs = max(s.runs for s in summaries)
    axes.set_ylabel("stall: % of the time the accelerator is idle"
                    + (f"\n(median of {runs} runs, bars: min-max)" if runs > 1 else ""))
    axes.set_ylim(-3, 103)
    axes.set_title(title, fontsize="medium")
    axes.grid(alpha=0.3)
    axes.legend()
    lines = textwrap.wrap(warning or "", 115)
    if lines:
        figure.text(0.01, 0.01, "\n".join(lines), color="firebrick", fontsize="small")
    figure.tight_layout(rect=(0, 0.04 * len(lines), 1, 1))
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True
