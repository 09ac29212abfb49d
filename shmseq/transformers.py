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

from typing import TYPE_CHECKING

import transformers
from torch.utils.data import DataLoader, Dataset

from .torch import on_ring

if TYPE_CHECKING:  # what OnRing is mixed into, for the checker: super() is a Trainer's
    _Mixed = transformers.Trainer
else:
    _Mixed = object


class OnRing(_Mixed):
    """Mixed into a ``transformers.Trainer`` class (before it): its train, eval and test
    loaders, with ``dataloader_num_workers`` > 0, come through shmseq's ring."""

    def get_train_dataloader(self) -> DataLoader:
        return on_ring(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        return on_ring(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return on_ring(super().get_test_dataloader(test_dataset))


class Trainer(OnRing, transformers.Trainer):
    """``transformers.Trainer``, its batches through shmseq's ring."""


__all__ = ["OnRing", "Trainer"]
