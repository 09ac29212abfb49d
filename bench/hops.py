"""How many times the consumer's step crosses between shmseq's modules to take one batch.

    python bench/hops.py           # ShmSequence, 2 process workers, out_type='cpu'
    python bench/hops.py --torch   # shmseq.torch.DataLoader: a TensorDataset, 2 workers

A *hop* is a Python call into a function of shmseq made in the consumer's process. A
*back-and-forth*: for each calling frame, the modules of the shmseq functions it calls (other
than its own), consecutive repeats collapsed, and each return to a module it called before
counts one: a step that reads as one pass calls each module once. Both are averaged over the
batches of a steady window (after the ring is made and full); the worst callers are listed.
"""
import collections
import os
import sys

import numpy as np

import shmseq

ROOT = os.path.dirname(shmseq.__file__)
WARMUP, COUNT = 50, 100


def module_of(code) -> str | None:
    """``code``'s module within shmseq (``ring``, ``engine/pool``...); None outside it."""
    path = code.co_filename
    return os.path.relpath(path, ROOT)[:-3] if path.startswith(ROOT) else None


def trace(it, count: int) -> list[tuple]:
    """The shmseq calls made while ``count`` batches are taken from ``it``: (serial, caller's
    serial, module, function, caller's module, caller's function); the caller is the nearest
    frame within shmseq."""
    calls, serials, counter = [], {}, iter(range(1 << 62))

    def profile(frame, event, arg):
        module = module_of(frame.f_code)
        if module is None:
            return
        if event == "return":
            serials.pop(id(frame), None)
        elif event == "call":
            serial = serials[id(frame)] = next(counter)
            caller = frame.f_back
            while caller is not None and module_of(caller.f_code) is None:
                caller = caller.f_back
            if caller is None:
                calls.append((serial, None, module, frame.f_code.co_name, None, None))
            else:
                calls.append((serial, serials.get(id(caller)), module, frame.f_code.co_name,
                              module_of(caller.f_code), caller.f_code.co_name))

    sys.setprofile(profile)
    try:
        for _ in range(count):
            next(it)
    finally:
        sys.setprofile(None)
    return calls


def report(calls: list[tuple], count: int) -> None:
    modules = collections.Counter(call[2] for call in calls)
    callees = collections.defaultdict(list)  # (caller's serial, module, function) -> modules
    for _, caller, module, _, caller_module, caller_name in calls:
        if caller_module is None or module == caller_module:
            continue
        called = callees[(caller, caller_module, caller_name)]
        if not called or called[-1] != module:
            called.append(module)
    back, worst = 0, collections.Counter()
    for (_, caller_module, caller_name), called in callees.items():
        for at, module in enumerate(called):
            if module in called[:at]:
                back += 1
                worst[f"{caller_module}.{caller_name}: {' -> '.join(called)}"] += 1
    print(f"hops per batch {len(calls) / count:.1f}, modules {len(modules)}: "
          f"{', '.join(f'{m} {n / count:.1f}' for m, n in modules.most_common())}")
    print(f"back-and-forths per batch {back / count:.2f}")
    for line, n in worst.most_common(6):
        print(f"  {n / count:.2f}  {line}")
    functions = collections.Counter(f"{call[2]}.{call[3]}" for call in calls)
    print("calls:", ", ".join(f"{f} {n / count:.1f}" for f, n in functions.most_common(40)))


class Worker:
    def __getitem__(self, indices):
        return np.zeros((len(indices), 32, 32, 3), np.uint8), indices.astype(np.int64)


def default_path() -> None:
    seq = shmseq.ShmSequence(Worker, 64 * (WARMUP + COUNT + 50), batch_size=64, num_workers=2,
                             out_type="cpu", seed=0, buffer=10)
    with seq.start():
        it = iter(seq)
        for _ in range(WARMUP):
            next(it)
        report(trace(it, COUNT), COUNT)


def torch_path() -> None:
    import torch

    from shmseq.torch import DataLoader

    n = 64 * (WARMUP + COUNT + 50)
    dataset = torch.utils.data.TensorDataset(torch.zeros(n, 32, 32, 3, dtype=torch.uint8),
                                             torch.arange(n))
    with DataLoader(dataset, batch_size=64, num_workers=2) as loader:
        it = iter(loader)
        for _ in range(WARMUP):
            next(it)
        report(trace(it, COUNT), COUNT)


if __name__ == "__main__":
    torch_path() if "--torch" in sys.argv[1:] else default_path()
