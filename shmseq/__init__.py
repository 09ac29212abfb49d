"""shmseq: training batches through a shared-memory slot ring, without pickling, without copies.

::

 consumer thread, while it waits for a batch (pool.py):
   Build(number, free slot, indices) --> task pipe --> worker 1..N (processes or threads)
                                                      | worker_obj[indices] -> batch
                                                      | written once into its slot (workers.py)
 ring of `buffer` slots x `slot_bytes`  <-------------+ (POSIX shared memory, one segment)
                                                      | only Done(number, slot, ...) comes back
 consumer thread: reply pipes + worker sentinels <----+
   every batch, one route (convert.py): slot -> device -> consumer, in order
     numpy / CPU tensors: the device's "copy" completes at once, the batch is views of the slot
     CUDA: a copy on one of its own streams; the slot waits for the copy's event

Where to look: ``protocol.py`` (what crosses between the parts: the messages to and from the
workers, and what each part hands the next), ``plan.py`` (which indices), ``pool.py``
(dispatch and replies), ``workers.py`` (where a batch is written), ``layout.py`` (the bytes
of a slot), ``ring.py`` (the slot state machine: when a slot is freed), ``convert.py`` (where
a batch is read), ``devices.py`` (numpy, torch, CUDA), ``pipeline.py`` (the running pipeline
and its closing), ``sequence.py`` (the public API and its epochs), ``torch.py`` (torch's
DataLoader), ``shards.py`` (tar shards streamed by member offset), ``ragged.py``
(variable-size items), ``decode.py`` (JPEG decode in the trainer).
"""
from .compat import MPSequence, MSequence, MTSequence
from .dataloader import DataLoader, default_batchify
from .errors import (BatchTimeout, PipelineClosed, SharedMemoryFull, ShmSeqError,
                     SkippedSamplesWarning, UnsupportedBatch, WorkerDied, WorkerError)
from .layout import SlotAllocator
from .ragged import Ragged
from .samplers import BatchSampler, RandomSampler, SequentialSampler
from .sequence import ShmSequence
from .stats import LoaderStats
from .workers import WorkerInfo, get_worker_info

__version__ = "0.1.0"
__all__ = ["ShmSequence", "MSequence", "MPSequence", "MTSequence", "DataLoader", "default_batchify",
           "SequentialSampler", "RandomSampler", "BatchSampler", "get_worker_info", "WorkerInfo",
           "SlotAllocator", "Ragged", "LoaderStats",
           "ShmSeqError", "WorkerError", "WorkerDied", "BatchTimeout", "UnsupportedBatch",
           "SharedMemoryFull", "PipelineClosed", "SkippedSamplesWarning"]
