"""shmseq: training batches through a shared-memory slot ring, without pickling, without copies.

::

 main thread --(seq, batch indices)--> task pipes --> worker 1..N (processes or threads)
                                                       | worker_obj[bidx] -> batch
                                                       | written into a free slot of the ring
 ring of `buffer` slots x `slot_bytes`  <--------------+ (POSIX shared memory, preallocated)
                                                       | only (seq, slot id) -> middle queue
 converter threads (num_converters) <------------------+
   map slot -> numpy view / torch tensor (zero-copy), or copy to CUDA
                                                       |
 main thread iterator <-- ordered output <-------------+  (in order)

Where to look: ``plan.py`` (which indices), ``workers.py`` (where a batch is written),
``layout.py`` (the bytes of a slot), ``ring.py`` (slots and their leases),
``convert.py`` (where a batch is read), ``sequence.py`` (the lifecycle).
"""
from .compat import MPSequence, MSequence, MTSequence
from .dataloader import DataLoader, default_batchify
from .errors import (BatchTimeout, PipelineClosed, SharedMemoryFull, ShmSeqError,
                     UnsupportedBatch, WorkerDied, WorkerError)
from .layout import SlotAllocator
from .samplers import BatchSampler, RandomSampler, SequentialSampler
from .sequence import ShmSequence
from .stats import LoaderStats
from .workers import WorkerInfo, get_worker_info

__version__ = "0.1.0"
__all__ = ["ShmSequence", "MSequence", "MPSequence", "MTSequence", "DataLoader", "default_batchify",
           "SequentialSampler", "RandomSampler", "BatchSampler", "get_worker_info", "WorkerInfo",
           "SlotAllocator", "LoaderStats",
           "ShmSeqError", "WorkerError", "WorkerDied", "BatchTimeout", "UnsupportedBatch",
           "SharedMemoryFull", "PipelineClosed"]
