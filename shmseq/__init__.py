"""shmseq: training batches through a shared-memory slot ring, without pickling, without copies.

Where to look:

* ``engine/``: the engine (its ``__init__`` draws it). ``engine/trainer/`` runs in the training
  process: ``plan.py`` (which indices), ``pool.py`` (dispatch and replies), ``ring.py`` (the
  slot state machine: when a slot is freed), ``convert.py`` (where a batch is read),
  ``devices.py`` (numpy, torch, CUDA), ``pipeline.py`` (the running pipeline and its closing).
  ``engine/worker/`` runs in each worker: ``batch.py`` (where a batch is written), ``loop.py``.
  ``engine/common/`` is what both share: ``protocol.py`` (what crosses between the parts),
  ``wire.py``, ``layout.py`` (the bytes of a slot), ``segments.py``, ``ragged.py``, ``errors.py``.
* the front ends, here: ``sequence.py`` (``ShmSequence``, its epochs), ``compat.py`` (MDNC's
  names), ``dataloader.py`` (sample-level ``DataLoader``), ``torch.py`` (torch's DataLoader),
  ``transformers.py``; and the data sources and stages: ``shards/`` (tar shards streamed by
  member offset, and the node's shard cache: its ``__init__`` lists its stages), ``remote.py``,
  ``vision.py``, ``decode.py`` (JPEG decode in the trainer).
* the applications: ``bench/`` and ``demo/`` (``python -m shmseq.bench``, ``-m shmseq.demo``).
"""
from .compat import MPSequence, MSequence, MTSequence
from .dataloader import DataLoader, default_batchify
from .engine import (BatchTimeout, LoaderStats, PipelineClosed, Ragged, SharedMemoryFull,
                     ShmSeqError, SkippedSamplesWarning, SlotAllocator, UnsupportedBatch,
                     WorkerDied, WorkerError, WorkerInfo, get_worker_info)
from .samplers import BatchSampler, RandomSampler, SequentialSampler
from .sequence import ShmSequence

__version__ = "0.1.0"
__all__ = ["ShmSequence", "MSequence", "MPSequence", "MTSequence", "DataLoader", "default_batchify",
           "SequentialSampler", "RandomSampler", "BatchSampler", "get_worker_info", "WorkerInfo",
           "SlotAllocator", "Ragged", "LoaderStats",
           "ShmSeqError", "WorkerError", "WorkerDied", "BatchTimeout", "UnsupportedBatch",
           "SharedMemoryFull", "PipelineClosed", "SkippedSamplesWarning"]
