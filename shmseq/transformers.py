"""Hugging Face's ``transformers.Trainer`` with its DataLoaders on shmseq's ring.

The Trainer builds each loader as torch's ``DataLoader(...)`` and hands it to Accelerate's
``prepare()``, which builds a torch ``DataLoader`` again from its attributes: importing shmseq's
``DataLoader`` into ``transformers.trainer`` would put no batch on the ring. Here the prepared
loaders are put back on it with ``shmseq.torch.on_ring``, and everything the Trainer and
Accelerate do with them (sharding, device placement, persistent eval loaders) is unchanged::

    from shmseq.transformers import Trainer      # was: from transformers import Trainer

or, for a Trainer subclass of your own (or a library's), mix ``OnRing`` in before it::

    class MyTrainer(OnRing, SFTTrainer): ...

Resumed from a checkpoint taken mid-epoch, the Trainer skips the epoch's first batches with
Accelerate's ``skip_first_batches``, which builds a torch ``DataLoader`` again: here that loader
is put on the ring too (in the Trainer's ``_run_epoch``, transformers 5), so that the rest of
the epoch comes through it, and no worker builds the batches skipped.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import transformers
import transformers.trainer
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
    the batches that came through the ring (none without workers); the rest of an epoch
    resumed from a checkpoint comes through a loader of its own (see ``_run_epoch``). Without
    workers (torch's and transformers' default, ``dataloader_num_workers=0``) a loader loads in
    the training process, as torch's does: the trainer says so once, in a ``RuntimeWarning``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.loaders: dict[str, RingLoader] = {}
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        return self._on_ring("train", super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        return self._on_ring("eval", super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return self._on_ring("test", super().get_test_dataloader(test_dataset))

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' epoch, the rest of a resumed one through the ring too. The Trainer
        skips a resumed epoch's first batches with Accelerate's ``skip_first_batches``, by its
        name in ``transformers.trainer`` (no method of the Trainer's to override), and the
        torch loader it builds would read the rest of the epoch: while the epoch runs, that
        name gives the loader on the ring (``_skipping_on_ring``), ``loaders["train"]`` while
        it reads and after, if the training stops there. It reads that one pass; the epochs
        after it read through the prepared loader, ``loaders["train"]`` again."""
        reading = self.loaders.get("train")
        with _skipping_on_ring(self) as rest:
            outcome = super()._run_epoch(*args, **kwargs)
        if rest and reading is not None and not self.control.should_training_stop:
            self.loaders["train"] = reading
        return outcome

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


@contextlib.contextmanager
def _skipping_on_ring(trainer: OnRing) -> Iterator[list[RingLoader]]:
    """Inside: ``transformers.trainer.skip_first_batches`` gives ``trainer``'s train loader, its
    first batches skipped, on the ring, kept as ``loaders["train"]`` and listed in what this
    yields: Accelerate's ``SkipBatchSampler`` skips their indices, and no worker builds them.
    Any other loader is skipped by Accelerate's function alone. On leaving, the listed
    loaders' persistent workers stop: each reads one pass."""
    accelerates: Callable[..., DataLoader] = transformers.trainer.skip_first_batches
    rest: list[RingLoader] = []

    def skip_first_batches(loader: DataLoader, num_batches: int = 0) -> DataLoader:
        skipped = accelerates(loader, num_batches)
        if getattr(loader, "base_dataloader", loader) is not trainer.loaders.get("train"):
            return skipped
        ringed = trainer._on_ring("train", skipped)
        rest.append(trainer.loaders["train"])
        return ringed

    transformers.trainer.skip_first_batches = skip_first_batches
    try:
        yield rest
    finally:
        transformers.trainer.skip_first_batches = accelerates
        for loader in rest:
            loader.close()


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
