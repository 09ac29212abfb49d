"""The engine: batches written by workers into a ring of shared-memory slots, read in order.

::

 trainer/  in the training process; the consumer's thread moves every slot
   spec.py           PipelineSpec: what a runtime runs, fixed when it starts
   plan.py           which indices form batch k of epoch e; the stream of numbered batches
   cursor.py         a front end's place in a pass: next batch, its number, the pass's end
   pipeline.py       wires the rest; its phases (sizing, running, closed); closes all
   pool.py           each step's exchange with the workers; what each reply means
   dispatch.py       Build(number, free slot, indices) down a task pipe ------------+
   roster.py         the workers: started, sent messages, leaving, replaced        |
   worker_handle.py  one worker: its pipes, its open tasks, its state (an enum)    |
   deaths.py         a worker that died: named, or replaced                         |
   waker.py          one epoll over every pipe and sentinel  <-----------------+    |
   ring.py           the slot state machine; every count of slots              |    |
   convert.py        every batch, one route: slot -> device -> consumer        |    |
   devices.py        numpy and torch views, page-locking, CUDA copies          |    |
   inline.py         the runtime without workers (start_test, num_workers=0)   |    |
   stats.py          the counters a training loop logs                         |    |
   tuning.py         how many workers and slots: pure rules                    |    |
   control.py        applies them every half second, from the step            |    v
 worker/   in each worker (a process or a thread)                              |
   loop.py           takes the task; replies Done(number, slot, ...) ----------+
   batch.py          worker_obj[indices], written once into its slot

 common/   what both sides share: protocol.py (every message and hand-over, as types),
   wire.py (how messages cross a pipe), slot.py, layout.py and unpack.py (a slot's format,
   its writing, its reading as views), segments.py (the ring's memory), ragged.py
   (variable-size items), board.py (which batch a worker builds, the evidence a death is
   charged on), lifeline.py (a worker never outlives its consumer), hooks.py (what a front end
   asks of the engine), errors.py

Imports run one way: trainer/ -> worker/ (it starts the workers) -> common/. Nothing in the
engine imports the front ends above it, which import the engine from here only: the names
below are its front door. A front end makes a ``PipelineSpec`` (``shmseq.options.LoaderOptions``
checks its arguments and builds it), starts a ``Pipeline`` or an ``Inline`` runtime with a
``Plan``, and reads each pass through a ``Cursor``; what is its own (torch's worker info,
batches dealt in turn, how a forked child is told to start its own) it gives as
``FrontEndHooks``. docs/architecture.md says how to add one.
"""
from .common.errors import (BatchTimeout, PipelineClosed, SharedMemoryFull, ShmSeqError,
                            SkippedSamplesWarning, UnsupportedBatch, WorkerDied, WorkerError,
                            warn_user)
from .common.hooks import FrontEndHooks
from .common.layout import SlotAllocator, Wrap, as_ndarray, map_arrays, stack_into
from .common.lifeline import (Lifeline, ProcessId, hold_starting_thread, release_starting_thread,
                              start_helper)
from .common.protocol import Completion, Delivery, Fence, Plan
from .common.ragged import Ragged, is_tensor, make_leaf
from .common.segments import RingSpec
from .trainer.cursor import Cursor
from .trainer.devices import (OUT_TYPES, CudaDevice, Device, GpuTimer, HostDevice, cuda_available,
                              resolve_out_type, torch_available)
from .trainer.inline import Inline
from .trainer.pipeline import Pipeline, closing_finalizer
from .trainer.plan import (LAST_BATCH_POLICIES, EpochPlan, SamplerPlan, as_index_array,
                           process_group)
from .trainer.ring import Ring
from .trainer.spec import PipelineSpec
from .trainer.stats import PEAK_COUNTS, LoaderStats, added_count
from .trainer.tuning import START_WORKERS, default_max_workers
from .worker.batch import StreamEnded
from .worker.loop import WorkerInfo, get_worker_info

__all__ = [
    "BatchTimeout", "Completion", "CudaDevice", "Cursor", "Delivery", "Device", "EpochPlan",
    "Fence", "FrontEndHooks", "GpuTimer", "HostDevice", "Inline", "LAST_BATCH_POLICIES", "Lifeline",
    "LoaderStats", "OUT_TYPES", "PEAK_COUNTS", "Pipeline", "PipelineClosed", "PipelineSpec", "Plan", "ProcessId", "Ragged", "Ring",
    "RingSpec", "START_WORKERS", "SamplerPlan", "SharedMemoryFull", "ShmSeqError",
    "SkippedSamplesWarning", "SlotAllocator", "StreamEnded", "UnsupportedBatch", "WorkerDied",
    "WorkerError", "WorkerInfo", "Wrap", "added_count", "as_index_array", "as_ndarray", "closing_finalizer",
    "cuda_available", "default_max_workers", "get_worker_info", "hold_starting_thread",
    "is_tensor", "make_leaf", "map_arrays", "process_group", "release_starting_thread",
    "resolve_out_type", "stack_into", "start_helper", "torch_available", "warn_user",
]
