"""What a runtime runs, fixed when it starts: ``PipelineSpec``, which a front end makes of its
options (``shmseq.options.LoaderOptions.spec``) and its ``FrontEndHooks``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..common.hooks import FrontEndHooks, WorkerStart
from .devices import Device, make_device


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline runs, fixed when it starts."""
    worker: object                    # a class made in each worker, or an instance copied there
    num_workers: int                  # the workers (tuned: the first count)
    buffer: int | None                # slots in the ring; None: by the tuning rules
    slot_bytes: int | None = None     # None: sized by the first batches
    thread_type: str = "proc"
    start_method: str | None = None
    out_type: str = "null"
    pin_memory: bool | None = None
    pin_device_id: int = 0
    num_converters: int = 1
    timeout: float | None = None      # seconds to wait for a batch (and for the workers to start)
    base_seed: int = 0                # worker k's seed is base_seed + k
    worker_init_fn: Callable | None = None
    restarts: int = 0
    hooks: FrontEndHooks = FrontEndHooks()  # what the front end asks beyond its options
    device: Callable[[], Device] | None = None  # makes the device instead of out_type's
    max_workers: int | None = None    # the worker count is tuned up to this; None: fixed
    cpu_budget: float | None = None   # cores the tuned workers and the trainer may use
    memory_budget: int | None = None  # bytes the ring (sized by the tuning rules) and, with
    # 'auto', the workers' own memory may take

    def make_device(self) -> Device:
        if self.device is not None:
            return self.device()
        return make_device(self.out_type, self.pin_memory, self.pin_device_id, self.num_converters)

    @property
    def worker_start(self) -> WorkerStart:
        """What each worker runs once seeded: the front end's hook, then ``worker_init_fn``."""
        return WorkerStart(self.hooks.on_worker_start, self.worker_init_fn)
