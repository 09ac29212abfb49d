"""The remote mode's table of shmseq beside its peers (``peers``), over each backend: each
system's whole first epoch from a cold cache (making the loader included), its steady rate after
it, its first batch, and what the server sent it; a peer that cannot read a backend shows n/a
with the reason, one not installed is named with the reason; shmseq's whole-epoch rate over the
best peer's, repeat by repeat, against the target.
"""
from __future__ import annotations

import statistics
from shmseq._apps.report import with_spread

from . import peers
from .runner import Run
from .streaming_report import _row, ratio_text
from .streaming_workloads import ShardWorkload

TARGET = 1.2  # shmseq's whole-epoch images/s over the best peer's, at least
HEADS = ("workload", "over", "system", "whole epoch images/s", "steady images/s", "first batch s",
         "requests/sample", "read amp.")
# a row's figures: (``Run`` field, format, scale by the batch size)
FIGURES = (("epoch_batches_per_second", ",.0f", True), ("batches_per_second", ",.0f", True),
           ("first_batch_seconds", ".2f", False), ("requests_per_sample", ".3f", False),
           ("read_amplification", ".2f", False))
COLUMNS = f"""\
- Peers: whole epoch images/s is the first epoch's images over its time from making the loader
  (its workers started, its cache empty in a fresh folder) to the epoch's last batch; steady
  images/s is the rate after it (the timed window, whole epochs); first batch s, from making the
  loader. Every batch is checked: full batches of the workload's crops, each sample once an
  epoch. shmseq's line says its whole-epoch rate over the best peer's on the same backend,
  repeat by repeat (the target: at least {TARGET:g}x)."""


def section(runs: list[Run], workloads: dict[str, ShardWorkload], backends: list[str],
            skipped: dict[str, str]) -> str:
    """The table and its lines (``skipped``: the peers left out, and why)."""
    lines = [_row(list(HEADS)), "| --- | --- | --- |" + " ---: |" * (len(HEADS) - 3)]
    said = []
    for name, workload in workloads.items():
        mine = [run for run in runs if run.workload == name]
        for backend in backends:
            lines += [_row([name, backend, system, *_figures(system, mine, workload, skipped)])
                      for system in (f"shmseq-{backend}", *_peer_names(backend))]
            said += [line for line in [_line(mine, name, backend)] if line]
    notes = [f"{peer}: skipped, {reason}" for peer, reason in skipped.items()]
    return "\n".join(["Side by side with the peers, each from a cold cache:", "", *lines, "",
                      *(f"- {line}" for line in said + notes)])


def _peer_names(backend: str) -> list[str]:
    return [f"{peer}-{backend}" for peer in peers.PEERS]


def _figures(system: str, runs: list[Run], workload: ShardWorkload,
             skipped: dict[str, str]) -> list[str]:
    """A row's cells: each figure's median (min-max), or why the system has none."""
    peer = peers.peer_of(system)
    backend = system.split("-", 1)[1]
    why = (peers.CANNOT_READ.get((peer, backend)) or skipped.get(peer)) if peer else None
    own = [run for run in runs if run.system == system]
    if why or not own:
        return [f"n/a: {why}" if why else "not run", *[""] * (len(FIGURES) - 1)]
    return [_spread([getattr(run, field) for run in own], spec,
                    workload.batch_size if scaled else 1) for field, spec, scaled in FIGURES]


def _spread(values: list[float | None], spec: str, scale: int) -> str:
    found = [value * scale for value in values if value is not None]
    if not found:
        return "—"
    return with_spread(statistics.median(found), (min(found), max(found)), spec, len(found))


def best_peer_ratios(runs: list[Run], workload: str, backend: str) -> tuple[list[float], list[str]]:
    """Repeat by repeat, shmseq's whole-epoch rate over the best peer's on ``backend`` in that
    repeat, and which peer was best."""
    by: dict[int, dict[str, Run]] = {}
    for run in runs:
        if run.workload == workload and run.system.endswith(f"-{backend}"):
            by.setdefault(run.repeat, {})[run.system] = run
    ratios, best = [], []
    for found in by.values():
        theirs = [found[name] for name in _peer_names(backend) if name in found]
        if f"shmseq-{backend}" in found and theirs:
            top = max(theirs, key=_epoch)
            ratios.append(_epoch(found[f"shmseq-{backend}"]) / _epoch(top))
            best.append(top.system)
    return ratios, best


def _epoch(run: Run) -> float:
    return run.epoch_batches_per_second or 0.0


def _line(runs: list[Run], workload: str, backend: str) -> str | None:
    ratios, best = best_peer_ratios(runs, workload, backend)
    if not ratios:
        return None
    median = statistics.median(ratios)
    verdict = ("met" if median >= TARGET else
               f"not met: {median / TARGET:.2f} of it, {TARGET / median - 1:.0%} short")
    return (f"{workload} over {backend}: shmseq-{backend}'s whole epoch {ratio_text(ratios)} the "
            f"best peer's ({', '.join(sorted(set(best)))}); target {TARGET:g}x: {verdict}; "
            "ratios taken repeat by repeat, median (min-max)")
