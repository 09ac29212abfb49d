"""Streaming shards: WebDataset-layout tar files read member by member, by byte offset.

A shard is a tar file whose members are grouped into samples by key (``n01/img7.jpg`` and
``n01/img7.cls`` are the sample ``n01/img7``, WebDataset's convention). An index lists each
shard's URL and the byte offset where each of its samples begins; with it every sample has a
global id (shard after shard), and the rest of shmseq treats a stream of shards as it treats
any dataset:

* ``ShardPlan`` (an ``EpochPlan``) orders the ids of an epoch: the shards in an order drawn
  from ``seed + epoch``, each sample moved at most ``shuffle_window`` places (a bounded
  shuffle, like WebDataset's buffer, but a pure function of the seed), then dealt to the ranks
  batch by batch, padded or cut so that every rank gets as many batches. The order does not
  depend on the number of workers, so a run resumes with any number of them.
* ``ShardWorker`` builds a batch from its ids: it reads each sample's bytes at its offset (no
  shard is read from its start to reach a member), hands the sample to the user's ``decode``,
  and stacks the results. A replacement worker rebuilds a dead one's batch from the same ids.
* ``ShardSequence`` is a ``ShmSequence`` over an index with that plan and worker. Remote
  shards are read from the node's shard cache (``cache``): each fetched whole, once per node,
  ahead of need, checked against the index, and read by offset from local disk (a sample
  before its shard is whole, once its own bytes are there and match its digest); their
  shuffle is then bounded in shards (``shuffle_shards``), the cache's unit.

Reading is ``tarfile``'s header format parsed in place, and ``shmseq.remote`` for URLs with a
protocol: range requests (streamed over HTTP and S3, through ``fsspec`` elsewhere), each under
a timeout, transient failures retried (local paths need neither fsspec nor a copy through it).
``webdataset``'s reader streams a shard from its first byte and cannot start at a member,
which exact resume needs; nor is it faster. Every sample of 12 local shards (3,000 samples of
150 kB) read once, samples/s, median (min-max) of 3 interleaved runs of
``bench/tar_readers.py`` on a shared 2-core machine:
webdataset 1.0.2 10,200 (9,900-12,200); by offset in shard order 15,100 (8,200-15,400); by
offset with a 1,000-sample shuffle window 7,300 (5,400-9,400): members out of order are read
one request each.

The package, one module a stage, each importing only those above it in this list:

    files      the cache's files on a shared disk: private folders, no link followed; checksums
    tar        a sample's members parsed in place; WebDataset's names
    progress   progress bars for writing and scanning
    index      Shard, ShardIndex: offsets, sizes, checksums, samples' digests; scan, save, load
    writing    write_shards, image_folder_samples
    early      ShardFiles (a cache as readers use it); EarlyReads: a batch's samples from
               shards still being fetched, checked
    reader     ShardReader: samples by id, from files, ranges or a cache
    nodes      which ranks form a node: those that share a cache folder
    plan       ShardPlan: the epoch's order, dealt to nodes, then to their ranks
    worker     ShardWorker: read, decode, stack into the slot
    locks      flock on the cache's files
    place      where a cache lives, and this user's others beside it
    ledger     what the node's cache holds, where its ranks are
    store      CacheStore: the cache's folder, its reconciling at start, budget, room, eviction
    cache      ShardCache: open (fetch, check, repair) a shard; fetch ahead
    prefetch   this rank's Prefetcher, and the room the batches in flight need
    fetch_process  the Prefetcher in a process of its own, following the consumer
    sequence   ShardSequence: a ShmSequence with a ShardStage (its hooks)
"""
from .cache import DamagedShardWarning, ShardCache, ShardCacheFull, StaleShardError
from .files import UnsafeCacheError
from .index import INDEX_VERSION, Shard, ShardIndex, as_shard_index, open_url
from .plan import ShardPlan
from .reader import ShardReader
from .sequence import CACHED_RING_SLOTS, SHUFFLE_SHARDS, SHUFFLE_WINDOW, ShardSequence, batches_in_flight
from .tar import ShardError
from .worker import ShardWorker, stack
from .writing import image_folder_samples, write_shards

for _public in (DamagedShardWarning, ShardCacheFull, ShardError, StaleShardError, UnsafeCacheError):
    _public.__module__ = __name__  # named as users import them, in messages and tracebacks
del _public

__all__ = ["CACHED_RING_SLOTS", "INDEX_VERSION", "SHUFFLE_SHARDS", "SHUFFLE_WINDOW", "DamagedShardWarning",
           "Shard", "ShardCache", "ShardCacheFull", "ShardError", "ShardIndex", "ShardPlan", "ShardReader",
           "ShardSequence", "ShardWorker", "StaleShardError", "UnsafeCacheError", "as_shard_index",
           "batches_in_flight", "image_folder_samples", "open_url", "stack", "write_shards"]
