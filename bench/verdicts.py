"""What ``seq.stats.summary()`` says on workloads whose bound is known, and the fractions it read.

    python bench/verdicts.py             # every workload, 8 s each
    python bench/verdicts.py copy decode # some of them

Each workload runs for ``--seconds`` and prints its one line and the window's fractions. The
copies are a fake GPU's (``shmseq.testing.FakeDevice``: up to 20 ms an array, on a thread of
its own), where there is no CUDA; the decode stage is the CPU one (simplejpeg, 2 threads).
"""
import argparse
import os
import tempfile
import time
from typing import Callable, Iterator

import numpy as np

from shmseq import ShmSequence
from shmseq.testing import FakeDevice

ROWS = 8  # samples per batch of the synthetic workloads


class Cheap:
    """Batches of zeros: nothing to build."""

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((len(indices), 64, 64, 3), np.uint8), indices.astype(np.int64)


class Latency(Cheap):
    """Each batch waits 20 ms first, as a read from object storage does."""

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        time.sleep(0.02)
        return super().__getitem__(indices)


class HoldsMemory(Latency):
    """A latency-bound worker that holds 96 MB of its own once it built a batch."""

    def __init__(self) -> None:
        self.held: np.ndarray | None = None

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.held is None:
            self.held = np.ones(96 << 17)  # every page written
        return super().__getitem__(indices)


def jpeg_folder(root: str, count: int = 256, side: int = 480) -> None:
    """``count`` blocky photo-like JPEGs of ``side`` pixels in two class folders."""
    import simplejpeg
    rng = np.random.default_rng(0)
    for label in range(2):
        os.makedirs(f"{root}/c{label}", exist_ok=True)
    for i in range(count):
        blocks = rng.integers(0, 255, (side // 16, side // 16, 3), np.uint8)
        image = np.kron(blocks, np.ones((16, 16, 1), np.uint8)).astype(np.int16)
        image += rng.integers(-20, 20, image.shape, dtype=np.int16)
        with open(f"{root}/c{i % 2}/{i}.jpg", "wb") as out:
            out.write(simplejpeg.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8), quality=90))


def decode_stage() -> Iterator[tuple[str, ShmSequence, float]]:
    from shmseq.decode import DecodeStage, EncodedImageWorker
    with tempfile.TemporaryDirectory() as root:
        jpeg_folder(root)
        worker = EncodedImageWorker(root)
        yield ("a CPU decode stage (2 threads), 1 worker reading bytes",
               ShmSequence(worker, len(worker), batch_size=32, num_workers=1, out_type="cpu",
                           device=DecodeStage(224, device="cpu", threads=2)), 0.0)


def sequence(worker: object, **options: object) -> ShmSequence:
    return ShmSequence(worker, 1 << 20, batch_size=ROWS, out_type="null", **options)


WORKLOADS: dict[str, Callable[[], Iterator[tuple[str, ShmSequence, float]]]] = {
    "copy": lambda: iter([("copies to a (fake) GPU, up to 20 ms an array, 2 workers",
                           sequence(Cheap(), num_workers=2, buffer=4,
                                    device=lambda: FakeDevice(max_delay=0.02)), 0.0)]),
    "decode": decode_stage,
    "latency": lambda: iter([("latency-bound workers (20 ms a batch), 2 of them",
                              sequence(Latency(), num_workers=2), 0.0)]),
    "trainer": lambda: iter([
        ("a 25 ms trainer step, 4 workers", sequence(Cheap(), num_workers=4), 0.025),
        ("a 25 ms trainer step, 1 worker", sequence(Cheap(), num_workers=1), 0.025)]),
    "memory": lambda: iter([
        ("'auto', latency-bound, 96 MB a worker, memory_budget=512 MB",
         sequence(HoldsMemory(), num_workers="auto", memory_budget=512 << 20), 0.0),
        ("'auto', latency-bound, 96 MB a worker, no memory budget",
         sequence(HoldsMemory(), num_workers="auto"), 0.0)]),
}


def run(name: str, seq: ShmSequence, step_s: float, seconds: float) -> None:
    """Take batches for ``seconds`` (sleeping ``step_s`` a batch, as a trainer's step), then
    print the summary of the last window and its fractions."""
    began = time.perf_counter()
    with seq.start():
        while time.perf_counter() - began < seconds:
            for _ in seq:
                time.sleep(step_s)
                if time.perf_counter() - began >= seconds:
                    break
        stats, window = seq.stats, seq.stats.breakdown()
        print(f"{name}:\n  {stats.summary()}\n  workers {stats.workers}, trainer waited "
              f"{window.trainer_wait_fraction:.2f}, workers busy {window.worker_busy_fraction:.2f}, "
              f"ring full {window.ring_full_fraction:.2f}, decode {window.decode_fraction:.2f}, "
              f"copies {window.copy_fraction:.2f}, a worker's own memory "
              f"{stats.worker_private_bytes / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", help=f"of {', '.join(WORKLOADS)} (all: none)")
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    if unknown := sorted(set(args.workloads) - set(WORKLOADS)):
        parser.error(f"no workload {', '.join(unknown)}: choose of {', '.join(WORKLOADS)}")
    for key in args.workloads or WORKLOADS:
        for name, seq, step_s in WORKLOADS[key]():
            run(name, seq, step_s, args.seconds)


if __name__ == "__main__":
    main()
