"""The node's shard cache, by its former name: it lives in ``shmseq.shards`` now (``cache``,
``store``, ``prefetch``, ``place``, ``ledger``); these names stay importable from here."""
from .shards.cache import (DamagedShardWarning, ShardCache, ShardCacheFull, StaleShardError,
                           estimated_bytes)
from .shards.place import cache_folder, default_cache_dir, job_name, remove_abandoned, user_root
from .shards.prefetch import FETCH_THREADS, Prefetcher, check_room, room_needed

__all__ = ["FETCH_THREADS", "DamagedShardWarning", "Prefetcher", "ShardCache", "ShardCacheFull",
           "StaleShardError", "cache_folder", "check_room", "default_cache_dir", "estimated_bytes",
           "job_name", "remove_abandoned", "room_needed", "user_root"]
