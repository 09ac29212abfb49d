"""The runtime without workers: every batch built, and delivered, in the calling thread.
``start_test()`` and ``num_workers=0`` run it; it yields the batches a ``Pipeline`` would.
"""
from __future__ import annotations

import itertools
from typing import Iterator

from ..common.layout import encode_batch, read_batch
from ..common.protocol import Hooks, Plan
from ..worker.batch import build_batch, make_worker
from .convert import handed_over
from .devices import make_device
from .spec import PipelineSpec
from .stats import LoaderStats


class Inline:
    """Everything in the calling thread: ``start_test()`` and ``num_workers=0``.

    ``test_mode``: ``'default'`` delivers as a pipeline would (through the slot format, so
    that types and layout match exactly), ``'cpu'`` as torch CPU tensors even where the
    output is CUDA, ``'numpy'`` the worker's output untouched."""

    def __init__(self, spec: PipelineSpec, plan: Plan, test_mode: str = "default") -> None:
        self.plan = plan
        self.worker_obj: Hooks | None = make_worker(spec.worker)  # None once closed
        self.test_mode = test_mode
        cpu_instead = test_mode == "cpu" and spec.out_type.startswith("cuda")
        self.device = make_device("cpu", pin_memory=False) if cpu_instead else spec.make_device()
        self._device = Hooks(self.device)
        self.stats = LoaderStats()

    def batches(self, epoch: int, position: int = 0) -> Iterator[object]:
        self.plan.open(epoch)
        first = position
        for position in itertools.count(first):
            indices = self.plan.batch(epoch, position)
            if indices is None:
                return
            worker = self.worker_obj
            assert worker is not None, "closed"
            batch, _ = build_batch(worker, indices, None, position == first)
            name = f"batch {position} of epoch {epoch}"
            self.stats.report_skipped(worker.pop_skipped(), name)
            self.stats.add_counts(worker.pop_counts())
            if self.test_mode != "numpy":
                views = read_batch(encode_batch(batch), self.device.wrap)
                batch = handed_over(self.device, self._device.pop_skipped,
                                    *self.device.convert(views), lambda: name, self.stats)
                self.stats.add_counts(self._device.pop_counts())
            self.plan.release(epoch, position + 1)
            yield batch

    def replan(self) -> None:
        """Nothing planned ahead."""

    def close(self) -> None:
        self.worker_obj = None
        self.device.close()
