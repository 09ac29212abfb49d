"""Hugging Face's ``Trainer`` fed by torch's DataLoader and by shmseq's ring: a tiny causal
language model built from a config (nothing downloaded) trained and evaluated with two
workers, persistent or not, gives the same losses step for step, and shmseq's batches, train
and eval, come through its ring; resumed from a checkpoint taken mid-epoch, the rest of that
epoch comes through the ring too, without building the batches it skips."""
import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch_datasets as data  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


@pytest.fixture(scope="module")
def transformers():
    """transformers, imported as these tests run, not as the suite is collected: its Trainer
    takes 140 MB of the suite's process, whose page tables every worker forked after it copies
    (a fork took twice as long)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub: never ask it
    return pytest.importorskip("transformers")


def ring_batches(transformers):
    """A callback that keeps the loaders the Trainer used, to count the batches they brought
    through the ring."""

    class RingBatches(transformers.TrainerCallback):
        def __init__(self):
            self.loaders = {"train": {}, "eval": {}}

        def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
            self._saw("train", train_dataloader)

        def on_evaluate(self, args, state, control, eval_dataloader=None, **kwargs):
            self._saw("eval", eval_dataloader)

        def _saw(self, kind: str, loader) -> None:
            base = getattr(loader, "base_dataloader", loader)
            self.loaders[kind][id(base)] = base

        def counts(self) -> dict:
            """Batches through the ring, by kind of loader (none: torch's loaders)."""
            return {kind: sum(getattr(base, "stats", None) and base.stats.batches or 0
                              for base in loaders.values())
                    for kind, loaders in self.loaders.items()}

    return RingBatches()


def trainer_of(transformers, trainer_class, output_dir, callbacks=(), train_dataset=None,
               **arguments):
    """A trainer of a tiny GPT-2 built from a config (4 steps, evaluating every 2, of 32
    sequences unless ``train_dataset`` is given), its ``TrainingArguments`` these updated with
    ``arguments``."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0))
    settings = dict(output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=2,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                    disable_tqdm=True, seed=0)
    args = transformers.TrainingArguments(**{**settings, **arguments})
    return trainer_class(model=model, args=args,
                         train_dataset=train_dataset or data.TokenSequences(32),
                         eval_dataset=data.TokenSequences(8), callbacks=list(callbacks))


def fit(transformers, trainer_class, output_dir, persistent_workers: bool):
    """Train 4 steps, evaluating every 2 and once more after, with 2 workers: the logged losses
    (step, loss), the ring's batches, and the trainer."""
    ring = ring_batches(transformers)
    trainer = trainer_of(transformers, trainer_class, output_dir, [ring],
                         dataloader_num_workers=2, dataloader_persistent_workers=persistent_workers)
    trainer.train()
    trainer.evaluate()
    return [(entry["step"], entry.get("loss", entry.get("eval_loss")))
            for entry in trainer.state.log_history if "loss" in entry or "eval_loss" in entry
            ], ring.counts(), trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_trainer_on_the_ring_trains_and_evaluates_as_on_torchs_loader(persistent_workers,
                                                                        transformers, tmp_path):
    from shmseq.transformers import Trainer as RingTrainer
    torchs, none, _ = fit(transformers, transformers.Trainer, tmp_path / "torch",
                          persistent_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn of with workers
        ours, ring, trainer = fit(transformers, RingTrainer, tmp_path / "shmseq",
                                  persistent_workers)
    assert ours == torchs and len(torchs) == 4 + 3
    assert none == {"train": 0, "eval": 0}
    assert ring["train"] >= 4 and ring["eval"] >= 3 * 2  # every step's batch, 3 evaluations of 2
    assert trainer.loaders["train"].stats.batches >= 4 and trainer.loaders["eval"].num_workers == 2


@pytest.mark.timeout(120)
def test_a_trainer_without_workers_says_once_that_its_batches_bypass_the_ring(transformers,
                                                                              tmp_path):
    """transformers' default, ``dataloader_num_workers=0``, loads in the training process: the
    trainer says so once, naming the argument, and ``loaders`` shows which loader ran."""
    from shmseq.transformers import Trainer as RingTrainer
    trainer = trainer_of(transformers, RingTrainer, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        trainer.evaluate()
    told = [str(w.message) for w in caught if "shmseq" in str(w.message)]
    assert len(told) == 1, told
    assert "dataloader_num_workers=0" in told[0] and "dataloader_num_workers=2" in told[0]
    assert all(trainer.loaders[kind].num_workers == 0 and trainer.loaders[kind].stats.batches == 0
               for kind in ("train", "eval"))


class RecordedTokens(data.TokenSequences):
    """``TokenSequences`` that appends each index it builds to the file ``record``: the
    worker processes' record of the samples they built."""

    def __init__(self, n: int, record: str):
        super().__init__(n)
        self.record = record

    def __getitem__(self, i):
        with open(self.record, "a") as record:  # one short write: lines never interleave
            record.write(f"{i}\n")
        return super().__getitem__(i)


def built(record) -> list[int]:
    return [int(line) for line in record.read_text().split()]


def losses(trainer, after: int = 0) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in trainer.state.log_history
            if "loss" in entry and entry["step"] > after]


EPOCH, SAVED_AT = 8, 3  # steps of 4 sequences: an epoch of 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_trainer_resumed_mid_epoch_reads_the_rest_of_it_through_the_ring(
        persistent_workers, transformers, tmp_path):
    """Resumed from the checkpoint of step 3, the trainer trains on the epoch's last 5 batches
    with the uninterrupted run's losses; they come through the ring, and the workers build
    their 20 samples only: the 12 of the batches skipped are not built."""
    from shmseq.transformers import Trainer as RingTrainer
    settings = dict(max_steps=EPOCH, eval_strategy="no", save_strategy="steps",
                    save_steps=SAVED_AT, dataloader_num_workers=2,
                    dataloader_persistent_workers=persistent_workers)
    full = trainer_of(transformers, RingTrainer, tmp_path / "full", train_dataset=RecordedTokens(
        32, str(tmp_path / "full.txt")), **settings)
    full.train()
    record = tmp_path / "resumed.txt"
    resumed = trainer_of(transformers, RingTrainer, tmp_path / "resumed",
                         train_dataset=RecordedTokens(32, str(record)), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{SAVED_AT}"))
    assert losses(resumed, after=SAVED_AT) == losses(full, after=SAVED_AT)
    assert len(losses(full, after=SAVED_AT)) == EPOCH - SAVED_AT
    assert resumed.loaders["train"].stats.batches == EPOCH - SAVED_AT, "the rest, on the ring"
    samples = built(record)
    assert len(samples) == len(set(samples)) == 4 * (EPOCH - SAVED_AT), "only the rest, once"
