"""Loader statistics a training loop can log: is the input pipeline keeping up?"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import SkippedSamplesWarning, warn_user


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
    remote_requests: int = 0      # requests to remote storage (shard reads), retries included
    remote_bytes: int = 0         # bytes received from remote storage
    remote_retries: int = 0       # remote requests tried again after a transient failure
    remote_wait_s: float = 0.0    # time workers spent in remote reads, summed over workers
    started: float = field(default_factory=time.perf_counter)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def stall_fraction(self) -> float:
        """Share of the wall time the consumer spent waiting on the loader."""
        elapsed = self.elapsed_s
        return self.consumer_wait_s / elapsed if elapsed > 0 else 0.0

    def report_skipped(self, skipped: list[str], where: str) -> None:
        """Count the samples a worker left out (``skipped``: why, one each), and warn."""
        if skipped:
            self.skipped_samples += len(skipped)
            more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
            warn_user(f"{len(skipped)} sample(s) left out of {where}: {skipped[0]}{more}",
                      SkippedSamplesWarning)

    def add_counts(self, counts: dict) -> None:
        """Add a worker's counts (its ``pop_counts()``: field name -> increment)."""
        for name, value in counts.items():
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
                "elapsed_s": self.elapsed_s, "stall_fraction": self.stall_fraction}
