"""The main job: train a small CNN on JPEG files fed by shmseq, against torch's DataLoader.

``python -m shmseq.demo`` makes a synthetic JPEG dataset (or reads ``--data DIR`` in
the ImageFolder layout), trains a small CNN on it with ``ShmSequence`` and the
in-place ``ImageFolderWorker``, trains the same model from the same initial weights
for as many steps fed by ``torch.utils.data.DataLoader`` (the same decode and
augmentation, sample by sample, as many workers, persistent), then iterates each
loader alone, without training: on CPU the model's compute usually bounds the
training rate, and only the loader-only rate shows the loaders' own difference.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

try:
    import torch
    from torch import nn
    from tqdm import tqdm
except ImportError as missing:
    raise SystemExit(f"the demo needs torch and tqdm ({missing}): "
                     "pip install torch 'shmseq[vision]'") from missing

from . import ShmSequence
from ._demo_data import make_dataset
from .vision import ImageFolder, ImageFolderWorker

DEFAULTS = {"images": 2000, "classes": 10, "epochs": 2, "batch_size": 64, "image_size": 64}
QUICK = {"images": 200, "classes": 10, "epochs": 1, "batch_size": 32, "image_size": 32}


@dataclass
class Feed:
    """Batches from one loader, epoch after epoch, timed by ``clock``; ``live_stall`` for the bar."""
    clock: WaitClock
    live_stall: Callable[[], float]


@dataclass
class Result:
    images_per_s: float
    stall_fraction: float
    loss: float = math.nan
    accuracy: float = math.nan


class FolderSamples:
    """The worker's decode and augmentation, one sample at a time, for torch's DataLoader.

    Each DataLoader worker process draws from its own generator, seeded by the
    worker's seed and the DataLoader worker id.
    """

    def __init__(self, worker: ImageFolderWorker):
        self.worker = worker
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.worker)

    def __getitem__(self, index: int):
        if self.rng is None:
            info = torch.utils.data.get_worker_info()
            self.rng = np.random.default_rng([self.worker.seed, info.id if info else 0])
        row = np.empty((self.worker.size, self.worker.size, 3), np.uint8)
        self.worker.load_into(index, row, self.rng)
        return torch.from_numpy(row), int(self.worker.folder.labels[index])


class WaitClock:
    """Times the consumer's waits on an iterator, start-up included, for both loaders alike."""

    def __init__(self, batches: Iterator):
        self.batches = batches
        self.waited = 0.0
        self.started = time.perf_counter()

    def __iter__(self):
        return self

    def __next__(self):
        began = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited += time.perf_counter() - began

    def stall_fraction(self) -> float:
        return self.waited / max(time.perf_counter() - self.started, 1e-9)


def epochs(loader) -> Iterator:
    """One epoch after another, for as long as the caller takes batches."""
    while True:
        yield from loader


@contextlib.contextmanager
def shmseq_feed(worker: ImageFolderWorker, args, device: torch.device) -> Iterator[Feed]:
    seq = ShmSequence(worker, len(worker), batch_size=args.batch_size, num_workers=args.workers,
                      seed=args.seed, out_type="cuda" if device.type == "cuda" else "cpu")

    def batches():
        with seq.start():  # started on the first request, so the clock sees the start-up
            yield from epochs(seq)

    clock = WaitClock(batches())
    try:
        yield Feed(clock, lambda: seq.stats.stall_fraction)
    finally:
        clock.batches.close()


@contextlib.contextmanager
def dataloader_feed(worker: ImageFolderWorker, args, device: torch.device) -> Iterator[Feed]:
    loader = torch.utils.data.DataLoader(
        FolderSamples(worker), batch_size=args.batch_size, shuffle=True,
        num_workers=args.workers, persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(args.seed))
    clock = WaitClock(epochs(loader))
    try:
        yield Feed(clock, clock.stall_fraction)
    finally:
        clock.batches.close()
        del loader, clock  # the last references: its persistent workers exit now


def small_cnn(classes: int) -> nn.Module:
    """Three conv blocks and a linear head: enough to learn the synthetic classes quickly."""
    def block(cin: int, cout: int) -> list:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*block(3, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2),
                         *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


class Trainer:
    """A fresh model, the same initial weights every time; one optimiser step per batch."""

    def __init__(self, classes: int, device: torch.device, seed: int):
        torch.manual_seed(seed)
        self.device = device
        self.model = small_cnn(classes).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.tally: list[tuple[float, int, int]] = []  # (loss sum, correct, samples) per step

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        # uint8 NHWC (a view of the slot) -> float NCHW in [-0.5, 0.5] on the device
        inputs = images.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
        labels = labels.to(self.device, non_blocking=True)
        logits = self.model(inputs.div_(255.0).sub_(0.5))
        loss = nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.tally.append((loss.item() * len(labels), (logits.argmax(1) == labels).sum().item(),
                           len(labels)))

    def reached(self, steps: int) -> tuple[float, float]:
        """Mean loss and accuracy over the last ``steps`` training batches."""
        loss_sum, correct, seen = np.sum(self.tally[-steps:], axis=0)
        return loss_sum / seen, correct / seen


def run(name: str, feed_of, steps: int, step: Callable) -> Result:
    """Call ``step`` on ``steps`` batches of a fresh loader; images/s and stall, start-up included."""
    images = 0
    began = time.perf_counter()
    with feed_of() as feed, tqdm(total=steps, desc=f"{name:<30}", unit="batch",
                                 dynamic_ncols=True) as bar:
        for batch in itertools.islice(feed.clock, steps):
            step(*batch)
            images += len(batch[1])
            del batch  # hand the slot back before waiting for the next one
            bar.set_postfix({"img/s": f"{images / (time.perf_counter() - began):.0f}",
                             "stall": f"{feed.live_stall():.0%}"}, refresh=False)
            bar.update()
        stall = feed.clock.stall_fraction()
    return Result(images / (time.perf_counter() - began), stall)


def train(name: str, feed_of, args, device: torch.device, steps: int, per_epoch: int) -> Result:
    """Train a fresh model on ``steps`` batches of the loader."""
    trainer = Trainer(args.classes, device, args.seed)
    result = run(name, feed_of, steps, trainer)
    result.loss, result.accuracy = trainer.reached(per_epoch)
    return result


def warm_up(args, device: torch.device) -> None:
    """One step on a dummy batch, so that torch's one-time set-up is charged to neither loader."""
    images = torch.zeros(args.batch_size, args.image_size, args.image_size, 3, dtype=torch.uint8)
    Trainer(args.classes, device, args.seed)(images, torch.zeros(args.batch_size, dtype=torch.int64))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shmseq.demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="an ImageFolder of JPEGs (DIR/<class>/*.jpg); "
                        "without it a synthetic set is made under --workdir")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        default=Path(tempfile.gettempdir()) / "shmseq-demo",
                        help="where the synthetic set is made, and reused (default %(default)s)")
    for flag, text in (("--images", "synthetic images"), ("--classes", "synthetic classes"),
                       ("--epochs", "training epochs"), ("--batch-size", "samples a batch"),
                       ("--image-size", "side of the square crops, in pixels")):
        key = flag[2:].replace("-", "_")
        parser.add_argument(flag, type=int, metavar="N", help=f"{text} (default {DEFAULTS[key]}; "
                            f"{QUICK[key]} with --quick)")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="loader worker processes, for both loaders (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="data, shuffling, augmentation and "
                        "initial weights (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a tiny run, for tests")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def report(args, folder: ImageFolder, device: torch.device, steps: int, trained: dict,
           alone: dict) -> None:
    print(f"\nshmseq demo: {len(folder)} images in {len(folder.classes)} classes ({folder.root}), "
          f"{args.image_size}x{args.image_size} crops, batch {args.batch_size}, "
          f"{args.workers} workers, {steps} steps ({args.epochs} epoch{'s' * (args.epochs != 1)}), "
          f"{device}")
    print(f"{'loader':<17}{'train img/s':>12}{'stall':>8}{'loader-only img/s':>19}"
          f"{'loss':>8}{'accuracy':>10}")
    for name, result in trained.items():
        print(f"{name:<17}{result.images_per_s:>12.0f}{result.stall_fraction:>8.0%}"
              f"{alone[name].images_per_s:>19.0f}{result.loss:>8.3f}{result.accuracy:>10.1%}")

    def ratio(results: dict) -> str:
        return f"{results['shmseq'].images_per_s / results['torch DataLoader'].images_per_s:.2f}x"
    print(f"shmseq / DataLoader: training {ratio(trained)}, loader only {ratio(alone)}")
    print("(stall: the share of the training phase spent waiting for a batch, start-up "
          "included; loss and accuracy: over the last epoch's training batches; figures from "
          "one run: compare the ratios)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = args.data or make_dataset(args.workdir / f"synthetic-{args.images}-{args.classes}",
                                     args.images, args.classes, seed=args.seed)
    try:
        folder = ImageFolder.scan(root)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"shmseq.demo: {exc}") from exc
    args.classes = len(folder.classes)
    worker = ImageFolderWorker(folder, args.image_size, seed=args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The loader's workers need their cores: torch's threads spinning against busy cores
    # slow every training step down many times over.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - args.workers))
    per_epoch = math.ceil(len(folder) / args.batch_size)
    steps = per_epoch * args.epochs
    warm_up(args, device)
    feeds = {"shmseq": lambda: shmseq_feed(worker, args, device),
             "torch DataLoader": lambda: dataloader_feed(worker, args, device)}
    trained = {name: train(name, feed_of, args, device, steps, per_epoch)
               for name, feed_of in feeds.items()}
    alone = {name: run(f"{name} (loader only)", feed_of, steps, lambda images, labels: None)
             for name, feed_of in feeds.items()}
    report(args, folder, device, steps, trained, alone)


if __name__ == "__main__":
    main()
