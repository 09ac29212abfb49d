"""Loader statistics a training loop can log: is the input pipeline keeping up?"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..common.errors import SkippedSamplesWarning, warn_user


@dataclass
class LoaderStats:
    """Counters of one started pipeline (``seq.stats``); read them at any time."""

    batches: int = 0              # batches handed to the consumer
    bytes: int = 0                # payload bytes of those batches
    worker_busy_s: float = 0.0    # time workers spent building batches, summed over workers
    consumer_wait_s: float = 0.0  # time the consumer spent waiting for a batch
    overflow_count: int = 0       # batches too large for their slot (sent through the pipe)
    largest_overflow_bytes: int = 0  # the largest of those
    suggested_slot_bytes: int | None = None  # a slot_bytes that fits them all (with headroom)
    copy_out_count: int = 0       # batches copied out because the consumer held the ring
    restarts: int = 0             # workers that died and were replaced (worker_restarts)
    skipped_samples: int = 0      # samples a worker's opt-in skip policy left out of a batch
    remote_requests: int = 0      # requests to remote storage (reads, fetches), retries included
    remote_bytes: int = 0         # bytes received from remote storage
    remote_retries: int = 0       # remote requests tried again after a transient failure
    remote_wait_s: float = 0.0    # time spent in remote reads and fetches, summed over workers
    # a shard cache's (shmseq.shard_cache), counted by this rank's workers and prefetcher:
    shard_fetches: int = 0        # shards fetched whole into the node's cache
    shard_fetch_bytes: int = 0    # their bytes
    shard_fetch_requests: int = 0  # the requests those fetches took
    shard_refetches: int = 0      # shards fetched again for an epoch they were fetched for
    shard_read_bytes: int = 0     # bytes of the samples read from cached shards
    shard_wait_s: float = 0.0     # time workers waited for a shard not cached yet, summed
    cache_peak_bytes: int = 0     # the most the node's cache held, as this rank's fetches saw it
    started: float = field(default_factory=time.perf_counter)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def stall_fraction(self) -> float:
        """Share of the wall time the consumer spent waiting on the loader."""
        elapsed = self.elapsed_s
        return self.consumer_wait_s / elapsed if elapsed > 0 else 0.0

    @property
    def read_amplification(self) -> float:
        """Bytes fetched per byte of the samples read (1.0: each shard byte once); 0 before any
        read. Several ranks of a node share their fetches: add their counts up for the node's."""
        return self.shard_fetch_bytes / self.shard_read_bytes if self.shard_read_bytes else 0.0

    def report_skipped(self, skipped: list[str], where: str) -> None:
        """Count the samples a worker left out (``skipped``: why, one each), and warn."""
        if skipped:
            self.skipped_samples += len(skipped)
            more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
            warn_user(f"{len(skipped)} sample(s) left out of {where}: {skipped[0]}{more}",
                      SkippedSamplesWarning)

    def add_counts(self, counts: dict) -> None:
        """Add a worker's counts (its ``pop_counts()``: field name -> increment); a peak is kept
        as the largest."""
        for name, value in counts.items():
            if name == "cache_peak_bytes":
                self.cache_peak_bytes = max(self.cache_peak_bytes, value)
            else:
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict:
        return {"batches": self.batches, "bytes": self.bytes, "worker_busy_s": self.worker_busy_s,
                "consumer_wait_s": self.consumer_wait_s, "overflow_count": self.overflow_count,
                "largest_overflow_bytes": self.largest_overflow_bytes,
                "suggested_slot_bytes": self.suggested_slot_bytes,
                "copy_out_count": self.copy_out_count, "restarts": self.restarts,
                "skipped_samples": self.skipped_samples,
                "remote_requests": self.remote_requests, "remote_bytes": self.remote_bytes,
                "remote_retries": self.remote_retries, "remote_wait_s": self.remote_wait_s,
                "shard_fetches": self.shard_fetches,
                "shard_fetch_bytes": self.shard_fetch_bytes,
                "shard_fetch_requests": self.shard_fetch_requests,
                "shard_refetches": self.shard_refetches,
                "shard_read_bytes": self.shard_read_bytes, "shard_wait_s": self.shard_wait_s,
                "cache_peak_bytes": self.cache_peak_bytes,
                "read_amplification": self.read_amplification,
                "elapsed_s": self.elapsed_s, "stall_fraction": self.stall_fraction}
