"""Small tar shards for the shard tests, and decode functions the workers can import (they are
pickled by reference, so they live here and not in the test module)."""
from __future__ import annotations

import os
import signal

import numpy as np

from shmseq.shards import write_shards


def payload(number: int) -> bytes:
    """The ``bin`` member of sample ``number``: its length and bytes follow from the number."""
    return bytes((number * 7 + i) % 256 for i in range(number % 13 + 1))


def key(number: int) -> str:
    return f"part{number % 3}/s{number:04d}"  # a folder in the name, as WebDataset keys have


def samples(count: int):
    for number in range(count):
        yield {"__key__": key(number), "cls": number, "bin": payload(number)}


class Samples:
    """``samples(count)`` as a sequence: ``write_shards`` writes it with several processes."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, number: int) -> dict:
        if not 0 <= number < self.count:
            raise IndexError(number)
        return {"__key__": key(number), "cls": number, "bin": payload(number)}


def write(folder, count: int, per_shard: int):
    """``count`` samples in shards of ``per_shard`` under ``folder``; their index."""
    os.makedirs(folder, exist_ok=True)
    return write_shards(samples(count), os.path.join(str(folder), "train-%03d.tar"),
                        samples_per_shard=per_shard)


def number_of(sample: dict) -> int:
    return int(sample["__key__"].rsplit("/s", 1)[1])


def decode(sample: dict) -> np.ndarray:
    """[number from the key, label, payload length, payload sum]: ``consistent`` checks them."""
    data = sample["bin"]
    return np.array([number_of(sample), int(sample["cls"]), len(data), sum(data)], np.int64)


def consistent(rows) -> list[int]:
    """The sample numbers of decoded rows, each checked against what ``samples`` wrote."""
    numbers = []
    for number, label, size, total in np.asarray(rows).reshape(-1, 4).tolist():
        assert label == number and size == len(payload(number)) and total == sum(payload(number)), \
            f"sample {number} decoded wrongly: label {label}, payload of {size} bytes, sum {total}"
        numbers.append(number)
    return numbers


class FailsOn:
    """``decode``, except that samples ``numbers`` raise."""

    def __init__(self, numbers):
        self.numbers = set(numbers)

    def __call__(self, sample: dict) -> np.ndarray:
        if number_of(sample) in self.numbers:
            raise ValueError(f"cannot decode {sample['__key__']} (on purpose)")
        return decode(sample)


class KillsOnce:
    """``decode``, except that the process SIGKILLs itself at sample ``number``, once: a marker
    file under ``marks`` remembers it across the replacement workers."""

    def __init__(self, marks, number: int):
        self.marks, self.number = str(marks), number

    def __call__(self, sample: dict) -> np.ndarray:
        mark = os.path.join(self.marks, f"killed-at-{self.number}")
        if number_of(sample) == self.number and not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return decode(sample)
