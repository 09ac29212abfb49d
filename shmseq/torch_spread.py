"""A pass of torch's ``DistributedSampler`` as all the ranks read it together, so that a state
saved on one world size resumes on another.

The sampler draws one global order an epoch (from its ``seed`` plus the epoch) and deals it:
rank ``r`` of ``W`` takes positions ``r, r + W, ...``. Ranks step together (DDP), so after ``k``
batches of ``B`` samples on each, the ranks have read exactly the first ``k * B * W`` positions
of that order. A state records that count (``consumed``); a resume on another world size draws
the same global order, drops what was consumed, and deals the rest to the new ranks as the
sampler deals a pass: equal shares (padded by repeating its first samples, or cut with the
sampler's ``drop_last``). A state taken in such a pass counts on from there, so it resumes on
any world size again. The same world size resumes a pass the sampler drew itself by drawing it
again (``torch_state``).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler


@dataclasses.dataclass(frozen=True)
class Spread:
    """A pass of the global order of ``epoch``, read up to ``end``: the first ``base`` positions
    were read before this pass began (resumed on another world size: ``drawn`` False), then
    ``batch_size`` samples a batch on each of ``world`` ranks."""
    epoch: int
    end: int
    base: int
    batch_size: int
    world: int
    drawn: bool  # the sampler drew the pass itself (not a rest dealt again)

    def state(self, num_yielded: int) -> dict:
        """Where the ranks together stand after ``num_yielded`` batches each."""
        consumed = min(self.end, self.base + num_yielded * self.batch_size * self.world)
        return {"epoch": self.epoch, "end": self.end, "consumed": consumed,
                "drawn_by": self.world if self.drawn else None}


def _distributed(index_sampler: object) -> tuple[DistributedSampler, int] | None:
    """The ``DistributedSampler`` a torch ``BatchSampler`` batches, and its batch size."""
    sampler = getattr(index_sampler, "sampler", None)
    batch_size = getattr(index_sampler, "batch_size", None)
    if isinstance(sampler, DistributedSampler) and isinstance(batch_size, int):
        return sampler, batch_size
    return None


def spread_of(index_sampler: object) -> Spread | None:
    """The pass the sampler is about to draw; None without a ``DistributedSampler``."""
    found = _distributed(index_sampler)
    if found is None:
        return None
    sampler, batch_size = found
    end = sampler.total_size if sampler.drop_last else len(sampler.dataset)  # type: ignore[arg-type]
    return Spread(sampler.epoch, end, 0, batch_size, sampler.num_replicas, True)


def dealt_again(index_sampler: object, saved: dict | None) -> bool:
    """Whether a saved pass resumes by dealing its rest again: it was saved on another world
    size, or was itself such a rest."""
    found = _distributed(index_sampler)
    return saved is not None and found is not None and saved["drawn_by"] != found[0].num_replicas


def rest_of_pass(index_sampler: object, saved: dict) -> tuple[Spread, Iterator[list[int]]]:
    """This rank's batches of what the ranks had not read of the saved pass."""
    found = _distributed(index_sampler)
    assert found is not None, "dealt_again said so"
    sampler, batch_size = found
    rest = _global_order(sampler, saved["epoch"])[saved["consumed"]:saved["end"]]
    world = sampler.num_replicas
    if sampler.drop_last:
        rest = rest[:len(rest) // world * world]
    elif rest:
        missing = -len(rest) % world
        rest += (rest * (missing // len(rest) + 1))[:missing]
    mine = rest[sampler.rank::world]
    drop_last = bool(getattr(index_sampler, "drop_last", False))
    spread = Spread(saved["epoch"], saved["end"], saved["consumed"], batch_size, world, False)
    return spread, iter(BatchSampler(mine, batch_size, drop_last))


def _global_order(sampler: DistributedSampler, epoch: int) -> list[int]:
    """The order the sampler deals in ``epoch``, before it pads or cuts it for its ranks."""
    count = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(count))
    generator = torch.Generator()
    generator.manual_seed(sampler.seed + epoch)
    return torch.randperm(count, generator=generator).tolist()
