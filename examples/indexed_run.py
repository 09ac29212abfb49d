"""What the Lightning and Accelerate examples share: a dataset whose samples carry their index,
so that every rank can report which samples it trained on, and the command line of a run."""
import argparse
from pathlib import Path

import torch


class Indexed(torch.utils.data.Dataset):
    """Points on a noisy plane; each sample carries its index so that ranks can report it."""

    def __init__(self, count: int):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(count, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="each rank writes its report here")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--save-at", type=int, default=5,
                        help="checkpoint after this optimizer step, then resume from it")
