"""The engine: batches written by workers into a ring of shared-memory slots, read in order.

::

 trainer/  in the training process; the consumer's thread moves every slot
   plan.py           which indices form batch k of epoch e
   pool.py           sends Build(number, free slot, indices) down a task pipe ----+
                     reads the replies and the workers' sentinels  <--------+     |
   ring.py           the slot state machine; every count of slots           |     |
   convert.py        every batch, one route: slot -> device -> consumer     |     |
   devices.py        numpy and torch views, page-locking, CUDA copies       |     |
   pipeline.py       wires them; takes each batch in one pass; closes all   |     |
   worker_handle.py  starts a worker, process or thread                     |     |
   stats.py          the counters a training loop logs                      |     |
   tuning.py         how many workers and slots: pure rules                 |     |
   control.py        applies them every half second, from the step          |     |
                                                                            |     v
 worker/   in each worker (a process or a thread)                           |
   loop.py           takes the task; replies Done(number, slot, ...) -------+
   batch.py          worker_obj[indices], written once into its slot

 common/   what both sides share: protocol.py (every message and hand-over, as types),
   wire.py (how messages cross a pipe), layout.py (the bytes of a slot), segments.py (the
   ring's memory), ragged.py (variable-size items), board.py (which batch a worker builds, the
   evidence a death is charged on), lifeline.py (a worker never outlives its consumer),
   errors.py

Imports run one way: trainer/ -> worker/ (it starts the workers) -> common/. Nothing in the
engine imports the front ends above it (``shmseq.sequence``, ``shmseq.torch``, ...).
The front ends (``shmseq.sequence``, ``shmseq.torch``, ``shmseq.dataloader``, ``shmseq.shards``,
``shmseq.testing``, ...) import the engine from here only: the names below are its front door,
and what a new front end needs. It builds a ``PipelineSpec`` (``shmseq.options.LoaderOptions``
makes one from checked arguments), starts a ``Pipeline`` or an ``Inline`` runtime with a
``Plan``, and reads each epoch through ``runtime.cursor(epoch, position)``; what is its own
(torch's worker info, batches dealt in turn, its wording) it gives as ``FrontEndHooks``.
"""
from .common.errors import (BatchTimeout, PipelineClosed, SharedMemoryFull, ShmSeqError,
                            SkippedSamplesWarning, UnsupportedBatch, WorkerDied, WorkerError,
                            warn_user)
from .common.hooks import FrontEndHooks
from .common.layout import SlotAllocator, Wrap, as_ndarray, map_arrays, stack_into
from .common.protocol import Completion, Delivery, Fence, Plan
from .common.ragged import Ragged, is_tensor, make_leaf
from .common.segments import RingSpec
from .trainer.cursor import Cursor
from .trainer.devices import (OUT_TYPES, CudaDevice, Device, GpuTimer, HostDevice, cuda_available,
                              resolve_out_type, torch_available)
from .trainer.inline import Inline
from .trainer.pipeline import Pipeline, closing_finalizer
from .trainer.plan import LAST_BATCH_POLICIES, EpochPlan, SamplerPlan, as_index_array
from .trainer.ring import Ring
from .trainer.spec import PipelineSpec
from .trainer.stats import LoaderStats
from .trainer.tuning import START_WORKERS, default_max_workers
from .worker.batch import StreamEnded
from .worker.loop import WorkerInfo, get_worker_info

__all__ = [
    "BatchTimeout", "Completion", "CudaDevice", "Cursor", "Delivery", "Device", "EpochPlan",
    "Fence", "FrontEndHooks", "GpuTimer", "HostDevice", "Inline", "LAST_BATCH_POLICIES", "LoaderStats",
    "OUT_TYPES", "Pipeline", "PipelineClosed", "PipelineSpec", "Plan", "Ragged", "Ring",
    "RingSpec", "START_WORKERS", "SamplerPlan", "SharedMemoryFull", "ShmSeqError",
    "SkippedSamplesWarning", "SlotAllocator", "StreamEnded", "UnsupportedBatch", "WorkerDied",
    "WorkerError", "WorkerInfo", "Wrap", "as_index_array", "as_ndarray", "closing_finalizer",
    "cuda_available", "default_max_workers", "get_worker_info", "is_tensor", "make_leaf",
    "map_arrays", "resolve_out_type", "stack_into", "torch_available", "warn_user",
]
