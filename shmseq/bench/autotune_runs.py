"""What the autotune bench runs (``shmseq.bench.autotune``): its workloads, a loader's setting,
the workers whose batches cost what a workload says, the trainer that takes them, and the trace
of a run (its workers and batches/s over time). Apart from the matrix of settings and the
report, which both read them.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Final, Literal

import numpy as np

from shmseq import ShmSequence

from . import systems
from .runner import Run
from .shard_data import JpegCrop, jpeg_samples
from .streaming import cpu_out
from .workloads import Allocator, InPlaceWorker, Workload, check_batch

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

AUTO: Final = "auto"
RING_WORKERS = 2
TRACE_SECONDS = 0.5
JPEGS = 64              # the photo-like JPEGs the cpu-jpeg workers decode, in turn


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

def self_tuned(workload: TunedWorkload) -> Setting:
    """What the loader picks itself on a workload: its ring, or its workers."""
    return Setting(RING_WORKERS) if workload.case == "ring" else Setting(AUTO)


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
