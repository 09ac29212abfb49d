"""Loader statistics a training loop can log: is the input pipeline keeping up, and if not,
where does the time go?

The counters only add up (one add per batch, or per event). Where the time went over the last
``window_length_s`` comes from snapshots of them that ``tick(now)`` takes, every half second
or so, from the consumer's thread: the only periodic cost, a tuple in a small deque.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from ..common.errors import SkippedSamplesWarning, warn_user
from .tuning import INPUT_BOUND, RING_MOSTLY_FULL, idle_share

SNAPSHOTS = 60          # snapshots a window keeps at most: closer ticks replace the newest
STORAGE_BOUND = 0.5     # workers waited on storage this share of their busy time: remote-bound
STAGE_BOUND = 0.25      # a decode or the copies busy this share of a window the trainer waited
STAGE_SATURATED = 0.8   # ... or of any window: that stage bounds the rate
WORKERS_BUSY = 0.8      # workers busy this share of their time: the trainer waits for them
CPU_HEAVY = 0.8         # a busy worker on a CPU this share of the time: cores, not workers
MIN_JUDGED_S = 1.0      # a window shorter than this is too short to judge: the first batches,
                        # the workers' start, a tick's worth of counts


class _Totals(NamedTuple):
    """The counters the window reads, at one time (or, subtracted, over a span)."""

    at: float
    batches: float
    consumer_wait_s: float
    worker_busy_s: float
    worker_cpu_s: float
    worker_idle_s: float
    decode_s: float
    copy_s: float
    storage_wait_s: float  # remote reads and shard fetches waited for
    worker_s: float        # wall time of the workers, summed over them

    def until(self, later: _Totals) -> _Totals:
        return _Totals(*(b - a for a, b in zip(self, later)))


class Breakdown(NamedTuple):
    """Where the time went over a window; fractions are of its wall time unless said."""

    window_s: float
    batches_per_s: float
    trainer_wait_fraction: float   # the consumer waited for a batch
    worker_busy_fraction: float    # of the workers' time, building batches
    worker_cpu_fraction: float     # of that busy time, on a CPU
    ring_full_fraction: float      # of the workers' reported time, idle for want of a task: no
                                   # slot free (``tuning.idle_share``)
    decode_fraction: float         # a decode stage busy (its threads' mean, or the GPU's)
    copy_fraction: float           # host-to-device copies running (their streams', summed)
    remote_wait_fraction: float    # of the workers' busy time, waiting on remote storage
    mean_workers: float            # workers running, on average over the window
    workers_limit: str = ""        # 'auto' held at its most workers by this bound, at the end
    workers_growing: bool = False  # 'auto' may still add workers, at the end

    def verdict(self) -> str:
        """One line a person reads: what bounds the rate, and the fix."""
        if self.window_s <= 0:
            return "no time measured yet"
        if self.window_s < MIN_JUDGED_S:
            return (f"too short to judge: {self.window_s:.2g} s measured, a verdict needs "
                    f"{MIN_JUDGED_S:g} s")
        span = f"the last {self.window_s:.3g} s"
        waited = self.trainer_wait_fraction > INPUT_BOUND
        full = self.ring_full_fraction >= RING_MOSTLY_FULL
        if self.batches_per_s == 0 and not waited:
            return f"no batches asked for in {span}"
        if stage := self._stage_bound(span, waited):
            return stage
        if not waited:
            if full:
                fewer = ", fewer workers would too" if self.mean_workers >= 1.5 else ""
                return (f"trainer-bound: the ring was full {_pct(self.ring_full_fraction)} of "
                        f"{span}; the loader keeps up{fewer}")
            return (f"trainer-bound: the trainer waited {_pct(self.trainer_wait_fraction)} "
                    f"of {span}; the loader keeps up")
        waited_for = f"the trainer waited {_pct(self.trainer_wait_fraction)} of {span}"
        if full:
            return (f"slot-bound: {waited_for}, yet the ring was full "
                    f"{_pct(self.ring_full_fraction)}; give the ring more slots (buffer) or "
                    f"let go of batches sooner")
        if self.remote_wait_fraction >= STORAGE_BOUND:
            return (f"remote reads: {waited_for}; workers waited on storage "
                    f"{_pct(self.remote_wait_fraction)} of their time; add workers (reads "
                    f"overlap) or cache the shards nearer")
        busy = f"workers busy {_pct(self.worker_busy_fraction)}"
        if self.workers_limit:  # each growth that brought it there raised the rate
            return (f"input-bound: {waited_for}; {busy}; num_workers='auto' runs all that "
                    f"{self.workers_limit} allows: raise it, or make each batch cheaper")
        if self.workers_growing:  # its next growth answers 'add workers', cores or not
            return (f"input-bound: {waited_for}; {busy}; num_workers='auto' is still adding "
                    f"workers ({self.mean_workers:.3g} on average over the window): look again "
                    "once it has settled")
        if self.worker_busy_fraction < WORKERS_BUSY:
            return (f"input-bound: {waited_for}, yet workers were busy only "
                    f"{_pct(self.worker_busy_fraction)}; the training process is slow to "
                    f"hand out work or take batches: profile it")
        if self.worker_cpu_fraction >= CPU_HEAVY:
            return (f"input-bound: {waited_for}; {busy}, on a CPU "
                    f"{_pct(self.worker_cpu_fraction)} of it; add cores, or workers if "
                    f"cores are free, or make each batch cheaper")
        return f"input-bound: {waited_for}; {busy}; add workers or cores"

    def _stage_bound(self, span: str, waited: bool) -> str | None:
        """A stage of the training process that holds the rate back: busy ``STAGE_BOUND`` of
        a window in which the trainer waited, or nearly always (``STAGE_SATURATED``) in any: on
        a GPU the trainer's wait for it is the GPU's, unseen by the host. None if neither
        stage is."""
        share = STAGE_BOUND if waited else STAGE_SATURATED
        also = f", and the trainer waited {_pct(self.trainer_wait_fraction)}" if waited else ""
        for stage, fraction, what, fix in (
                ("decode", self.decode_fraction, "decoding", "decode on the GPU or in more "
                 "threads"),
                ("copy", self.copy_fraction, "host-to-device copies", "send fewer bytes "
                 "(uint8 images, converted on the GPU) or copy on more streams")):
            if fraction >= share:
                return f"{stage}-bound: {what} ran {_pct(fraction)} of {span}{also}; {fix}"
        return None


PEAK_COUNTS = frozenset({"cache_peak_bytes", "worker_private_bytes", "node_fetch_bytes",
                         "node_share_bytes"})  # kept as the largest (or the last, if they grow)


def added_count(name: str, before: float, value: float) -> float:
    """Count ``name`` once ``value`` more of it came (from a worker, a stage, a process of
    its own): added, or a peak kept as the largest."""
    return max(before, value) if name in PEAK_COUNTS else before + value


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f} %"


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


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
    shard_repairs: int = 0        # cached shards that no longer matched their index, fetched again
    shard_read_bytes: int = 0     # bytes of the samples read from cached shards
    shard_wait_s: float = 0.0     # time workers waited for a shard not cached yet, summed
    shard_early_reads: int = 0    # samples read before their shard was whole (its fetch under way)
    shard_early_bytes: int = 0    # bytes of the range requests that read some of them
    cache_peak_bytes: int = 0     # the most the node's cache held, as this rank's fetches saw it
    node_fetch_bytes: int = 0     # the bytes the node's cache fetched for the job, all its ranks'
    node_share_bytes: int = 0     # the bytes of the shards the plan deals this rank's node
    worker_private_bytes: int = 0  # the most memory a worker process held alone (measured by
    # each every 10 s or so; not the pages it shares with the trainer, nor the ring)
    # where the time goes (breakdown()):
    worker_cpu_s: float = 0.0     # CPU time of the workers, summed
    worker_idle_s: float = 0.0    # time workers waited for a task (no slot was free for one),
    # summed over workers
    decode_s: float = 0.0         # time spent decoding batches in the training process
    copy_s: float = 0.0           # time spent on host-to-device copies of batches
    workers: int = 0              # workers running now: the time since the last tick counts at it
    workers_limit: str = ""       # 'auto' at its most workers: the bound that holds it there
    workers_growing: bool = False  # 'auto' below that bound and free to add workers
    started: float = field(default_factory=time.perf_counter)
    window_length_s: float = 30.0  # the span ``breakdown()`` and ``summary()`` look back on
    clock: Callable[[], float] = field(default_factory=lambda: time.perf_counter, repr=False,
                                       compare=False)  # the time ``started`` and ticks are of
    _snapshots: deque[_Totals] = field(init=False, repr=False, compare=False)
    _worker_s: float = field(default=0.0, init=False, repr=False, compare=False)
    _worker_s_at: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._worker_s_at = self.started
        self._snapshots = deque([self._totals(self.started)])

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

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

    def tick(self, now: float) -> None:
        """Snapshot the counters at ``now`` (``time.perf_counter()``), for the window: from
        the consumer's thread, every half second or so, never per batch."""
        self._worker_s += self.workers * (now - self._worker_s_at)
        self._worker_s_at = now
        snapshots = self._snapshots
        if len(snapshots) > 1 and now - snapshots[-2].at < self.window_length_s / SNAPSHOTS:
            snapshots[-1] = self._totals(now)
        else:
            snapshots.append(self._totals(now))
        while snapshots[1].at <= now - self.window_length_s:
            snapshots.popleft()

    def breakdown(self) -> Breakdown:
        """Where the time went from the last ``window_length_s`` as of the last tick up to
        now (a run shorter than a tick, or the batches taken since the last one, count); the
        decode and copy fractions up to the last tick, when their device's counts came in."""
        snapshots = self._snapshots
        span = snapshots[0].until(self._totals(max(self.clock(), snapshots[-1].at)))
        ticked = snapshots[0].until(snapshots[-1])  # a device's counts come in at ticks only
        return Breakdown(
            window_s=span.at, batches_per_s=_ratio(span.batches, span.at),
            trainer_wait_fraction=_ratio(span.consumer_wait_s, span.at),
            worker_busy_fraction=_ratio(span.worker_busy_s, span.worker_s),
            worker_cpu_fraction=_ratio(span.worker_cpu_s, span.worker_busy_s),
            ring_full_fraction=idle_share(span.worker_idle_s, span.worker_busy_s),
            decode_fraction=_ratio(ticked.decode_s, ticked.at),
            copy_fraction=_ratio(ticked.copy_s, ticked.at),
            remote_wait_fraction=_ratio(span.storage_wait_s, span.worker_busy_s),
            mean_workers=_ratio(span.worker_s, span.at), workers_limit=self.workers_limit,
            workers_growing=self.workers_growing)

    def summary(self) -> str:
        """One line on the last window: what bounds the rate, and the fix."""
        return self.breakdown().verdict()

    def _totals(self, now: float) -> _Totals:
        return _Totals(now, self.batches, self.consumer_wait_s, self.worker_busy_s,
                       self.worker_cpu_s, self.worker_idle_s, self.decode_s, self.copy_s,
                       self.remote_wait_s + self.shard_wait_s,
                       self._worker_s + self.workers * (now - self._worker_s_at))

    def report_skipped(self, skipped: Sequence[str], where: str) -> None:
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
            setattr(self, name, added_count(name, getattr(self, name), value))

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
                "shard_refetches": self.shard_refetches, "shard_repairs": self.shard_repairs,
                "shard_read_bytes": self.shard_read_bytes, "shard_wait_s": self.shard_wait_s,
                "shard_early_reads": self.shard_early_reads,
                "shard_early_bytes": self.shard_early_bytes,
                "cache_peak_bytes": self.cache_peak_bytes,
                "node_fetch_bytes": self.node_fetch_bytes,
                "node_share_bytes": self.node_share_bytes,
                "worker_private_bytes": self.worker_private_bytes,
                "read_amplification": self.read_amplification,
                "elapsed_s": self.elapsed_s, "stall_fraction": self.stall_fraction,
                "worker_cpu_s": self.worker_cpu_s, "worker_idle_s": self.worker_idle_s,
                "decode_s": self.decode_s, "copy_s": self.copy_s, "workers": self.workers,
                **self.breakdown()._asdict()}
