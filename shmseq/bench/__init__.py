"""The benchmark: shmseq against PyTorch's DataLoader, a pickling queue and serial loading.

``workloads`` (what a batch is, and how the consumer checks it), ``systems`` (the
loaders, started and stopped the same way), ``limit`` (building batches with no
transport), ``runner`` (timing, round-robin), ``report`` (table, targets, JSON,
chart). Run it with ``python -m shmseq.bench`` (``--help`` for options).

``--streaming``: ``streaming`` (shmseq's ``ShardSequence`` against torch's ``DataLoader`` over
the same tar shards, with its own limit and report) and ``shard_data`` (the JPEG and raw uint8
shards, written once, and the decoders). ``--streaming --remote``: ``remote_streaming`` (the
same shards over HTTP and S3 from ``servers``, each in a process of its own: shmseq through its
shard cache against torch reading in place, with the servers' traffic and ceilings).
``--autotune``: ``autotune`` (``num_workers='auto'`` and the default ring against sweeps of
fixed settings, and the static rules of torch's DataLoader and Grain, with a trace of auto's
workers over time).
"""
