"""The streaming bench's workloads and systems by name (``shmseq.bench.streaming`` runs them):
the shards each workload reads, the names of the three systems, the device the decode stage
runs on, and the stage itself. Apart, since both the runs and the report read them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from shmseq.decode import DecodeStage
from shmseq.engine import cuda_available
from shmseq.shards import ShardIndex, ShardPlan

from .workloads import ImageBatches

SEED = 0
SHMSEQ, TORCH = "shmseq-shards", "torch-shards"
STAGE_DEVICE = "cuda" if cuda_available() else "cpu"
STAGE = "shmseq-gpu-decode" if STAGE_DEVICE == "cuda" else "shmseq-trainer-decode"


@dataclass(frozen=True)
class ShardWorkload(ImageBatches):
    """Batches of ``batch_size`` ``side`` x ``side`` x 3 uint8 images and int64 labels, from
    ``images`` samples of ``kind`` (``jpeg`` or ``uint8``) in shards of ``samples_per_shard``,
    their shuffle bounded by ``shuffle_window`` samples or else (given) ``shuffle_shards`` shards.
    ``early_batches``: the batches after the first timed apart (``first N × steady``)."""

    name: str
    kind: str
    batch_size: int = 64
    images: int = 1024
    samples_per_shard: int = 256
    side: int = 224
    shuffle_window: int = 1000
    shuffle_shards: int | None = None
    early_batches: int = 10

    @property
    def folder(self) -> str:
        """The name of its shards' folder: what they were made with."""
        return f"{self.kind}-{self.images}-{self.samples_per_shard}-{self.side}-{SEED}"

    @property
    def bounded(self) -> dict:
        """How the shuffle is bounded, as ``ShardSequence`` takes it: one of the two."""
        return ({"shuffle_shards": self.shuffle_shards} if self.shuffle_shards is not None
                else {"shuffle_window": self.shuffle_window})

    def plan(self, index: ShardIndex) -> ShardPlan:
        """The epochs' batches, as both loaders take them."""
        return ShardPlan(index, self.batch_size, **self.bounded, shuffle=True, seed=SEED,
                         last_batch="discard")


STREAM_WORKLOADS = {w.name: w for w in (ShardWorkload("shards-jpeg", "jpeg"),
                                        ShardWorkload("shards-uint8", "uint8"))}
QUICK_IMAGES = 256  # --quick: smaller sets (4 batches an epoch), made in a second or two


def quick(workload: ShardWorkload) -> ShardWorkload:
    return replace(workload, images=QUICK_IMAGES, samples_per_shard=QUICK_IMAGES // 4)


@dataclass
class Prepared:
    """A workload's shards, as every run reads them."""

    workload: ShardWorkload
    index: ShardIndex
    decode: Callable[[dict], object]


def decode_stage(side: int) -> DecodeStage:
    """The stage the third system decodes with: CUDA's where there is one, else the CPU's."""
    return DecodeStage(side, device=STAGE_DEVICE, seed=SEED)
