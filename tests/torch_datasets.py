"""Module-level datasets, samplers and collate functions for the side-by-side tests against
torch's DataLoader (spawn and forkserver workers must be able to pickle them)."""
import collections
import dataclasses
import os
import random
import signal
import time
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class Counting(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i


Named = collections.namedtuple("Named", "left right")


class Fields(Counting):
    """Every kind of field torch's default collation knows."""

    def __getitem__(self, i):
        return {"image": np.full((2, 3), i, np.uint8), "tensor": torch.tensor([i, i + 0.5]),
                "label": i, "weight": i / 4, "flag": i % 2 == 0, "name": f"sample-{i}",
                "scalar": np.float32(i), "pair": (i, [i, -i]), "named": Named(i, np.int16(i)),
                "half": torch.tensor([i], dtype=torch.bfloat16), "none_key": {"deep": [i]}}


class Transformed(Counting):
    """Sample ``i`` is ``transform(i)``."""

    def __init__(self, n: int, transform):
        super().__init__(n)
        self.transform = transform

    def __getitem__(self, i):
        return self.transform(i)


class TokenSequences(Counting):
    """Sequences of 8 token ids below 64 for a causal language model, which learns to repeat
    them (``labels`` are the inputs)."""

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Bulk(Counting):
    """Loads a whole batch at once: ``dataset[list_of_indices]``."""

    def __getitem__(self, indices):
        assert isinstance(indices, (list, tuple)), f"expected a list of indices, got {indices!r}"
        return torch.as_tensor(indices) * 10


class GetItems(Counting):
    """Reads a batch through ``__getitems__``, as torch's fetcher does when it is there."""

    def __getitems__(self, indices):
        return [("bulk", i) for i in indices]


class Keyed(Dataset):
    """A dataset keyed by strings, read through a sampler of keys."""

    def __init__(self):
        self.items = {f"key-{i}": i * 3 for i in range(10)}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key):
        return self.items[key]


class Keys(Sampler):
    def __init__(self, dataset: Keyed):
        self.keys = list(dataset.items)

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class Endless(Sampler):
    """A sampler that never ends, as streaming trainers use."""

    def __iter__(self):
        i = 0
        while True:
            yield i % 7
            i += 1


class Seeds(Counting):
    """What a worker's random generators give: its torch seed and a draw from each."""

    def __getitem__(self, i):
        info = get_worker_info()
        return (torch.initial_seed(), random.randrange(2**30), int(np.random.randint(2**30)),
                torch.randint(2**30, ()).item(), -1 if info is None else info.seed)


class Crops(Counting):
    """A random crop box and flip per sample, as an augmentation draws them."""

    def __getitem__(self, i):
        top, left = torch.randint(0, 100, (2,)).tolist()
        return torch.tensor([i, top, left, int(torch.rand(()) < 0.5)])


class WhoBuilds(Counting):
    def __getitem__(self, i):
        info = get_worker_info()
        return (i, -1, -1) if info is None else (i, info.id, info.num_workers)


class Threads(Counting):
    def __getitem__(self, i):
        return torch.get_num_threads()


class WorkerInfoReport(Counting):
    """What ``get_worker_info()`` tells, and whether it is torch's read-only record (its
    ``dataset`` is the worker's copy: the object whose ``__getitem__`` runs)."""

    def __getitem__(self, i):
        info = get_worker_info()
        try:
            info.id = 99
            frozen = False
        except (AttributeError, RuntimeError, dataclasses.FrozenInstanceError):
            frozen = True
        return (info.id, info.num_workers, info.seed == torch.initial_seed(),
                info.dataset is self, frozen)


def seed_12345(worker_id: int) -> None:
    torch.manual_seed(12345)


class InitialSeed(Counting):
    def __getitem__(self, i):
        return torch.initial_seed()


def fail_init(worker_id: int) -> None:
    raise RuntimeError("Error in worker_init_fn")


def exit_init(worker_id: int) -> None:
    """Ends the worker while it starts, without a word: as it would again in a replacement."""
    os._exit(4)


class Remembers(Counting):
    """Persistent workers keep the dataset they were given: ``start`` set later is not seen."""

    start = 0

    def __getitem__(self, i):
        return i + self.start


class Barrier(Counting):
    """Every worker waits here until all of them have a batch in hand: a loader that builds a
    first batch alone, before the others start, breaks the barrier."""

    def __init__(self, n: int, num_workers: int):
        super().__init__(n)
        import multiprocessing
        self.barrier = multiprocessing.get_context("fork").Barrier(num_workers, timeout=10)

    def __getitem__(self, i):
        self.barrier.wait()
        return torch.initial_seed()


class Convolves(Counting):
    """Runs a multi-threaded torch op in the worker."""

    def __getitem__(self, i):
        x = torch.ones(1, 3, 48, 48) * i
        return torch.nn.functional.conv2d(x, torch.ones(4, 3, 3, 3)).sum()


class SlowFirst(Counting):
    """Sample 0 takes half a second: the other worker's batches are ready first."""

    def __getitem__(self, i):
        if i == 0:
            time.sleep(0.5)
        return i


class Sleepy(Counting):
    def __init__(self, n: int, seconds: float):
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return i


class NeedsArguments(Exception):
    """An exception whose constructor takes two arguments."""

    def __init__(self, path, line):
        super().__init__(f"{path}:{line}")
        self.path, self.line = path, line


class Raises(Counting):
    """Samples of odd batches raise ``kind``."""

    def __init__(self, n: int, kind: str, batch_size: int = 2):
        super().__init__(n)
        self.kind, self.batch_size = kind, batch_size

    def __getitem__(self, i):
        if (i // self.batch_size) % 2:
            if self.kind == "KeyError":
                raise KeyError(f"no sample {i}")
            if self.kind == "NeedsArguments":
                raise NeedsArguments(f"sample-{i}.jpg", i)
            raise ValueError(f"sample {i} is corrupt")
        return i


def _die() -> None:
    """SIGKILL this process: it leaves without a word (no traceback, no fault handler)."""
    import faulthandler
    faulthandler.disable()
    os.kill(os.getpid(), signal.SIGKILL)


def _first_time(marks: str) -> bool:
    """True the first time only (a mark under ``marks`` says it happened, for later workers)."""
    mark = os.path.join(marks, "killed")
    if os.path.exists(mark):
        return False
    open(mark, "w").close()
    return True


class KillsItself(Counting):
    def __init__(self, n: int, at: int):
        super().__init__(n)
        self.at = at

    def __getitem__(self, i):
        if i == self.at:
            _die()
        return i


class KillsOnce(Counting):
    """SIGKILLs its worker at sample ``at`` the first time only (a mark under ``marks`` says it
    happened, for the worker that replaces it)."""

    def __init__(self, n: int, at: int, marks: str):
        super().__init__(n)
        self.at, self.marks = at, marks

    def __getitem__(self, i):
        if i == self.at and _first_time(self.marks):
            _die()
        return i


class KillsOnceStream(IterableDataset):
    """Worker ``k`` of ``w`` yields ``k, k + w, k + 2w, ...`` below ``n`` (torch's documented
    sharding); the worker that reaches ``at`` SIGKILLs itself there, the first time only."""

    def __init__(self, n: int, at: int, marks: str):
        self.n, self.at, self.marks = n, at, marks

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            if i == self.at and _first_time(self.marks):
                _die()
            yield i


class CountingStream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class PerWorkerStream(IterableDataset):
    """Worker ``k`` yields ``range(sizes[k])``."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        return iter(range(self.sizes[get_worker_info().id]))


class BrokenStream(IterableDataset):
    def __iter__(self):
        raise RuntimeError("Error in __iter__")


class RecordStream(IterableDataset):
    """Worker ``k`` yields ``sizes[k]`` records (a dict of a tensor, an array, a number and a
    string); ``bad`` (worker, item): that item raises ``KeyError``, and the stream goes on."""

    def __init__(self, sizes, bad=None):
        self.sizes = sizes
        self.bad = bad

    def __iter__(self):
        return _Records(get_worker_info().id, self.sizes, self.bad)


class _Records:
    def __init__(self, worker: int, sizes, bad):
        self.worker, self.size, self.bad, self.at = worker, sizes[worker], bad, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.at >= self.size:
            raise StopIteration
        self.at += 1
        if (self.worker, self.at - 1) == self.bad:
            raise KeyError(f"item {self.at - 1} of worker {self.worker}")
        return {"image": torch.full((2, 3), self.at - 1), "mask": np.full(4, self.worker),
                "index": self.at - 1, "name": f"w{self.worker}"}


class RangeStream(IterableDataset):
    """``range(start, end)``, split over the workers by ``split_range`` (torch's documented
    ``worker_init_fn`` recipe: each worker narrows its copy of the dataset)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    info = get_worker_info()
    dataset = info.dataset
    share = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start = dataset.start + worker_id * share
    dataset.end = min(dataset.start + share, dataset.end)


# -- what a collate_fn may return ----------------------------------------------------------------
class Encoding(Mapping):
    """A mapping that is not a dict, as transformers' ``BatchEncoding``."""

    def __init__(self, data: dict):
        self.data = data

    def __getitem__(self, key):
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __eq__(self, other) -> bool:
        return type(other) is Encoding and self.data.keys() == other.data.keys() and all(
            torch.equal(self.data[k], other.data[k]) for k in self.data)


@dataclasses.dataclass
class Record:
    inputs: torch.Tensor
    labels: torch.Tensor
    source: str

    def __eq__(self, other) -> bool:
        return type(other) is Record and torch.equal(self.inputs, other.inputs) and torch.equal(
            self.labels, other.labels) and self.source == other.source


class CustomBatch:
    """torch's documented example of a custom batch type."""

    def __init__(self, samples):
        columns = list(zip(*samples))
        self.inp = torch.stack(columns[0], 0)
        self.tgt = torch.stack(columns[1], 0)

    def __eq__(self, other) -> bool:
        return type(other) is CustomBatch and torch.equal(self.inp, other.inp) and torch.equal(
            self.tgt, other.tgt)


def to_encoding(samples):
    ids = torch.stack([torch.arange(3) + i for i in samples])
    return Encoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def to_record(samples):
    return Record(torch.tensor(samples, dtype=torch.float32)[:, None].repeat(1, 4),
                  torch.tensor(samples), f"batch-{samples[0]}")


def to_custom(samples):
    return CustomBatch([(torch.full((2,), float(i)), torch.tensor(i)) for i in samples])


def to_nested(samples):
    return torch.nested.nested_tensor([torch.arange(i + 1, dtype=torch.float32) for i in samples])


def to_sparse(samples):
    dense = torch.zeros(len(samples), 5)
    for row, i in enumerate(samples):
        dense[row, i % 5] = i
    return dense.to_sparse()


def to_packed(samples):
    data = torch.stack([torch.arange(4, dtype=torch.float32) + i for i in samples], 1)
    lengths = torch.tensor([4 - (i % 3) for i in samples])
    return torch.nn.utils.rnn.pack_padded_sequence(data, lengths, enforce_sorted=False)


def to_text(samples):
    return f"batch of {len(samples)} starting at {samples[0]}"


COLLATES = {"mapping": to_encoding, "dataclass": to_record, "custom class": to_custom,
            "nested tensor": to_nested, "sparse tensor": to_sparse, "packed sequence": to_packed,
            "string": to_text}


class NestedSamples(Counting):
    def __getitem__(self, i):
        return torch.nested.nested_tensor([torch.arange(i + 1, dtype=torch.float32)])


def clone_collate(samples):
    return [sample.clone() for sample in samples]
