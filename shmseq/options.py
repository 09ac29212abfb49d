"""The options every front end gives the engine, checked in one place and turned into the
pipeline's spec in one place.

``ShmSequence`` (and the loaders built on it: ``shmseq.DataLoader``, ``ShardSequence``) and
``shmseq.torch.DataLoader`` take the same ~16 arguments about workers, the ring and delivery
under their own names and defaults. Each front end makes one ``LoaderOptions`` of them: its
checks run as it is made (an error names the argument, the value and what to pass instead),
and ``spec()`` is the only builder of a ``PipelineSpec``. A new front end adds its own
arguments and makes a ``LoaderOptions`` of the rest.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
from typing import Callable, Literal, cast

from .checks import (check_auto_bounds, check_bool, check_choice, check_int, check_num_workers,
                     check_out_type, check_timeout)
from .engine import (START_WORKERS, Device, FrontEndHooks, PipelineSpec, default_max_workers,
                     resolve_out_type)

THREAD_TYPES = ("proc", "thread")


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """How batches are built and delivered, whatever the front end (``ShmSequence``'s names)."""
    num_workers: int | Literal["auto"] = 4
    max_workers: int | None = None      # None with 'auto': 16, or the usable cores if more
    cpu_budget: float | None = None
    memory_budget: int | None = None
    buffer: int | None = None
    slot_bytes: int | None = None
    thread_type: str = "proc"
    start_method: str | None = None
    out_type: str = "cuda"
    pin_memory: bool | None = None
    pin_device_id: int = 0
    num_converters: int | None = None   # None: MDNC's default for the workers
    timeout: float | None = 120.0
    worker_init_fn: Callable[[int], object] | None = None
    worker_restarts: int = 0
    device: Callable[[], Device] | None = None

    def __post_init__(self) -> None:
        check_int("buffer", self.buffer, 1, optional=True)
        check_num_workers(self.num_workers)
        check_auto_bounds(self.num_workers, self.max_workers, self.cpu_budget,
                          self.memory_budget, self.buffer)
        check_int("num_converters", self.num_converters, 1, optional=True)
        check_int("slot_bytes", self.slot_bytes, 1, optional=True)
        check_int("pin_device_id", self.pin_device_id, 0)
        check_int("worker_restarts", self.worker_restarts, 0)
        check_bool("pin_memory", self.pin_memory, optional=True)
        if self.worker_restarts and self.thread_type == "thread":
            raise ValueError(f"worker_restarts={self.worker_restarts} replaces worker processes "
                             "that die, but thread_type='thread' runs none: use thread_type='proc'")
        check_choice("thread_type", self.thread_type, THREAD_TYPES)
        check_choice("start_method", self.start_method,
                     (None, *multiprocessing.get_all_start_methods()))
        check_out_type(self.out_type)
        settle = object.__setattr__  # frozen: each derived value set once, here
        settle(self, "timeout", check_timeout(self.timeout))
        settle(self, "out_type", resolve_out_type(self.out_type))
        if self.num_workers == "auto":
            settle(self, "max_workers", self.max_workers or default_max_workers())
        most = cast(int, self.num_workers) if self.max_workers is None else self.max_workers
        # MDNC's default: for CUDA output, the number of streams batches are copied on
        settle(self, "num_converters", self.num_converters or max(most // 4, min(most, 4), 1))

    @property
    def first_workers(self) -> int:
        """The workers a pipeline starts with: all of them, or the tuning's first count."""
        if self.max_workers is None:
            return cast(int, self.num_workers)
        return min(START_WORKERS, self.max_workers)

    def spec(self, worker: object, base_seed: int, hooks: FrontEndHooks) -> PipelineSpec:
        """What a pipeline started now runs: ``worker`` in each worker, seeded from
        ``base_seed`` (worker k's seed is ``base_seed + k``), with the front end's ``hooks``."""
        assert self.num_converters is not None  # settled when made
        return PipelineSpec(
            worker, self.first_workers, self.buffer, slot_bytes=self.slot_bytes,
            thread_type=self.thread_type, start_method=self.start_method,
            out_type=self.out_type, pin_memory=self.pin_memory, pin_device_id=self.pin_device_id,
            num_converters=self.num_converters, timeout=self.timeout, base_seed=base_seed,
            worker_init_fn=self.worker_init_fn, restarts=self.worker_restarts,
            device=self.device, max_workers=self.max_workers, cpu_budget=self.cpu_budget,
            memory_budget=self.memory_budget, hooks=hooks)
