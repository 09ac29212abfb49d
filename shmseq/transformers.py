"""Hugging Face's ``transformers.Trainer`` with its DataLoaders on shmseq's ring.

The Trainer builds each loader as torch's ``DataLoader(...)`` and hands it to Accelerate's
``prepare()``, which builds a torch ``DataLoader`` again from its attributes: importing shmseq's
``DataLoader`` into ``transformers.trainer`` would put no batch on the ring. Here the prepared
loaders are put back on it with ``shmseq.torch.on_ring``, and everything the Trainer and
Accelerate do with them (sharding, device placement, persistent eval loaders) is unchanged::

    from shmseq.transformers import Trainer      # was: from transformers import Trainer

or, for a Trainer subclass of your own (or a library's), mix ``OnRing`` in before it::

    class MyTrainer(OnRing, SFTTrainer): ...
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import transformers
from torch.utils.data import DataLoader, Dataset

from .engine import warn_user
from .torch import DataLoader as RingLoader
from .torch import on_ring

if TYPE_CHECKING:  # what OnRing is mixed into, for the checker: super() is a Trainer's
    _Mixed = transformers.Trainer
else:
    _Mixed = object


class OnRing(_Mixed):
    """Mixed into a ``transformers.Trainer`` class (before it): its train, eval and test
    loaders, with ``dataloader_num_workers`` > 0, come through shmseq's ring.

    ``loaders`` maps ``"train"``, ``"eval"`` and ``"test"`` to the ``shmseq.torch.DataLoader``
    that each kind of loader last read through: its ``num_workers``, and its ``stats.batches``,
    the batches that came through the ring (none without workers). Without workers (torch's
    and transformers' default, ``dataloader_num_workers=0``) a loader loads in the training
    process, as torch's does: the trainer says so once, in a ``RuntimeWarning``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.loaders: dict[str, RingLoader] = {}
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        return self._on_ring("train", super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        return self._on_ring("eval", super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return self._on_ring("test", super().get_test_dataloader(test_dataset))

    def _on_ring(self, kind: str, loader: DataLoader) -> DataLoader:
        """``loader`` on the ring (``on_ring``), kept as ``loaders[kind]``. One that has no
        workers never uses the ring, which a trainer imported for it should not keep quiet:
        the first such loader of this trainer says so."""
        ringed = on_ring(loader)
        base = getattr(ringed, "base_dataloader", ringed)
        assert isinstance(base, RingLoader), "on_ring's"
        if base.num_workers == 0 and all(kept.num_workers for kept in self.loaders.values()):
            warn_user(_no_workers(kind))
        self.loaders[kind] = base
        return ringed


def _no_workers(kind: str) -> str:
    """What a trainer whose loaders have no workers is told."""
    return (f"shmseq.transformers.Trainer: with dataloader_num_workers=0 (transformers' "
            f"default) the {kind} batches are loaded in the training process, as torch's "
            "DataLoader loads them without workers, and none goes through shmseq's ring: pass "
            "TrainingArguments(dataloader_num_workers=2) or more (worker processes, up to the "
            f"cores the training leaves free). trainer.loaders[{kind!r}] is the loader that "
            "ran; its stats.batches counts the batches that came through the ring")


class Trainer(OnRing, transformers.Trainer):
    """``transformers.Trainer``, its batches through shmseq's ring."""


__all__ = ["OnRing", "Trainer"]
