"""The streaming bench's report (``shmseq.bench.streaming`` runs the bench): the table, the
ratios taken repeat by repeat, the lines of what it shows, the notes on the decode stage;
``RemotePart`` is what the remote mode adds to it.
"""
from __future__ import annotations

import statistics
from typing import Protocol

from shmseq._apps.report import with_spread

from . import systems
from .report import Cell, _fmt, drift_note, machine_line, of_limit, summarize, timing
from .runner import LIMIT, Run
from .streaming_workloads import SHMSEQ, STAGE, STAGE_DEVICE, TORCH, ShardWorkload, decode_stage


class RemotePart(Protocol):
    """What a mode reading remote shards adds to the report (``remote_streaming.Report`` is
    one): notes above the table, tables after it, its columns, lines of what it shows."""

    columns: str

    def notes(self, cells: list[Cell]) -> list[str | None]:
        """Paragraphs above the table (None: left out)."""

    def highlights(self, runs: list[Run], cells: list[Cell]) -> list[str]:
        """Lines of "What it shows"."""

    def tables(self, runs: list[Run]) -> list[str]:
        """Tables after the main one (their columns added to ``columns``)."""


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
             "cpu": [present(other.cpu_us_per_batch) / present(mine.cpu_us_per_batch)
                     for mine, other in pairs],
             "first": [present(mine.first_batch_seconds) / present(other.first_batch_seconds)
                       for mine, other in pairs]}
    if all(mine.peak_pss_bytes and other.peak_pss_bytes for mine, other in pairs):
        found["pss"] = [present(mine.peak_pss_bytes) / present(other.peak_pss_bytes)
                        for mine, other in pairs]
    return found


def present(figure: float | None) -> float:
    """A figure the runs compared have: a loader's (the limit has none), a remote run's."""
    assert figure is not None, "a figure the run has not"
    return figure


def ratio_text(values: list[float]) -> str:
    median = statistics.median(values)
    return (f"{median:.2f}x" if len(values) < 2
            else f"{median:.2f}x ({min(values):.2f}-{max(values):.2f})")


def less_or_more(less: list[float]) -> str:
    """``Nx less`` where ours took less CPU than theirs (the median of ``less``), else ``Nx more``."""
    if statistics.median(less) >= 1:
        return f"{ratio_text(less)} less"
    return f"{ratio_text([1 / value for value in less])} more"


def _workers_line(runs: list[Run], get: dict[str, Cell], workload: ShardWorkload) -> str | None:
    """Decoding in shmseq's workers against torch's, on one workload."""
    found = ratios(runs, workload.name)
    if found is None:
        return None
    ours, theirs = get[SHMSEQ], get[TORCH]
    return (f"{workload.name}: {SHMSEQ} {images_per_s(ours, workload)[0]:,.0f} images/s, "
            f"{ratio_text(found['rate'])} torch's DataLoader over the same shards and decode "
            f"({images_per_s(theirs, workload)[0]:,.0f} images/s), with "
            f"{less_or_more(found['cpu'])} trainer CPU a batch "
            f"({ours.cpu_us_per_batch:,.0f} against {theirs.cpu_us_per_batch:,.0f} µs), its "
            f"first batch in {ratio_text(found['first'])} torch's time ({ours.first_batch_s:.3f} "
            f"against {theirs.first_batch_s:.3f} s)"
            + (f", {ratio_text(found['pss'])} its process tree's PSS "
               f"({present(ours.pss_bytes) / 1e6:,.0f} against "
               f"{present(theirs.pss_bytes) / 1e6:,.0f} MB)"
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
            against.append(f"{ratio_text(found['rate'])} the images/s of {called} with "
                           f"{less_or_more(found['cpu'])} trainer CPU")
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
             *(remote.tables(runs) if remote else []),
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
