"""The accelerator sweep: at what step rate does each loader starve a training step?

A simulated accelerator stands in for the GPU: each training step hands it a batch and takes
a fixed time, ``time.sleep(step)``. That is what a GPU step looks like from the trainer's
thread: it enqueues the step's kernels and then waits (in ``loss.item()`` or the next
synchronisation) with the GIL released and no CPU used, while the loader's workers build the
next batches. The batch's pages are not read by the trainer, as a DMA engine copies a pinned
batch to the device without the CPU. So the measure is the loader's alone: whether the next
batch is there when the step ends, and how much of the trainer's CPU the loader takes.

For each loader and step time, a fresh loader is started, warmed up, then timed for a few
seconds: images/s delivered; stall, the share of the wall time the accelerator sat idle
(waiting for the next batch, or for the trainer's thread to finish with the last one: a
loader's work in the trainer's thread delays the next step as surely as a late batch); and
the trainer process's CPU per batch (all its threads: unpickling, freeing, pinning, a
loader's own threads). The repeats interleave the loaders, so that drift on a shared machine
hits them alike; figures are medians with their min-max spread.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

WARMUP_BATCHES = 3
MIN_BATCHES = 10


@dataclass
class Measurement:
    loader: str
    step_ms: float
    repeat: int
    images_per_s: float
    stall: float
    cpu_us_per_batch: float


@dataclass
class Summary:
    """One loader at one step time, over the repeats: medians and (min, max) spreads."""
    loader: str
    step_ms: float
    images_per_s: float
    images_per_s_spread: tuple[float, float]
    stall: float
    stall_spread: tuple[float, float]
    cpu_us_per_batch: float
    runs: int = 1  # the repeats summarised: a spread needs two or more


def accelerator_step(batch: object, seconds: float) -> None:
    """A training step on the simulated accelerator (see the module's docstring)."""
    time.sleep(seconds)


def measure(name: str, open_loader: Callable, step_ms: float, seconds: float,
            repeat: int) -> Measurement:
    """A fresh loader, warmed up, then timed for ``seconds`` (and ``MIN_BATCHES`` at least)."""
    step = step_ms / 1000
    with open_loader() as batches:
        for _ in range(WARMUP_BATCHES):
            accelerator_step(next(batches), step)
        busy, images, count = 0.0, 0, 0
        cpu, began = time.process_time(), time.perf_counter()
        while count < MIN_BATCHES or time.perf_counter() - began < seconds:
            batch = next(batches)
            images += len(batch[1])
            stepped = time.perf_counter()
            accelerator_step(batch, step)
            busy += time.perf_counter() - stepped
            del batch  # the slot goes back before the next wait
            count += 1
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    return Measurement(name, step_ms, repeat, images / wall, 1 - busy / wall, cpu / count * 1e6)


def run(loaders: Mapping[str, Callable], steps_ms: Iterable[float], repeats: int, seconds: float,
        progress: Callable[[Measurement], None]) -> list[Measurement]:
    """Every loader at every step time, ``repeats`` times, the loaders' order rotating."""
    names = list(loaders)
    found = []
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for step_ms in steps_ms:
            for name in order:
                found.append(measure(name, loaders[name], step_ms, seconds, repeat))
                progress(found[-1])
    return found


def summarize(measurements: list[Measurement]) -> list[Summary]:
    """One summary per (loader, step time), loaders in the order first measured."""
    groups: dict[tuple[str, float], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.loader, m.step_ms), []).append(m)
    loaders = list(dict.fromkeys(m.loader for m in measurements))
    steps = sorted({m.step_ms for m in measurements}, reverse=True)
    found = []
    for step_ms in steps:
        for loader in loaders:
            group = groups[loader, step_ms]
            rates, stalls = [m.images_per_s for m in group], [m.stall for m in group]
            found.append(Summary(loader, step_ms, statistics.median(rates), (min(rates), max(rates)),
                                 statistics.median(stalls), (min(stalls), max(stalls)),
                                 statistics.median(m.cpu_us_per_batch for m in group),
                                 len(group)))
    return found


def fed_down_to(summaries: list[Summary], loader: str, stall: float = 0.05) -> float | None:
    """The shortest step time at which ``loader`` stalls the step less than ``stall``."""
    kept = [s.step_ms for s in summaries if s.loader == loader and s.stall < stall]
    return min(kept) if kept else None
