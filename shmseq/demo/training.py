"""A real training run on the same shmseq pipeline: a small CNN learns the synthetic classes.

The batches are views of the slots (uint8 N x H x W x 3); the model averages them down to a
quarter of their side first, so that a CPU trains it in seconds.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass
class Epoch:
    number: int
    loss: float
    accuracy: float
    images_per_s: float


def small_cnn(classes: int) -> nn.Module:
    """A 4x average pool, three conv blocks and a linear head."""
    def block(cin: int, cout: int) -> list:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(nn.AvgPool2d(4), *block(3, 16), nn.MaxPool2d(2), *block(16, 32),
                         nn.MaxPool2d(2), *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, classes))


class Trainer:
    """One optimiser step per batch; the same initial weights for a given seed."""

    def __init__(self, classes: int, device: torch.device, seed: int) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.model = small_cnn(classes).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """Train on one batch: its summed loss and the number of samples right."""
        # uint8 NHWC (a view of the slot) -> float NCHW in [-0.5, 0.5] on the device
        inputs = images.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
        labels = labels.to(self.device, non_blocking=True)
        logits = self.model(inputs.div_(255.0).sub_(0.5))
        loss = nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.item() * len(labels), int((logits.argmax(1) == labels).sum())


def train(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps_per_epoch: int, epochs: int,
          trainer: Trainer, report: Callable[[Epoch], None]) -> list[Epoch]:
    """``epochs`` epochs of ``steps_per_epoch`` batches from ``batches``; one report each."""
    found = []
    for number in range(1, epochs + 1):
        loss_sum, right, seen = 0.0, 0, 0
        began = time.perf_counter()
        for images, labels in itertools.islice(batches, steps_per_epoch):
            loss, correct = trainer.step(images, labels)
            loss_sum, right, seen = loss_sum + loss, right + correct, seen + len(labels)
            del images, labels  # hand the slot back before waiting for the next batch
        found.append(Epoch(number, loss_sum / seen, right / seen,
                           seen / (time.perf_counter() - began)))
        report(found[-1])
    return found
