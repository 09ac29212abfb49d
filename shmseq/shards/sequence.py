"""``ShardSequence``: a ``ShmSequence`` over a shard index, with its plan and worker, and for
remote shards the node's shard cache and this rank's prefetcher.
"""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

from ..checks import check_bool, check_int
from ..engine.trainer.stats import LoaderStats
from ..remote import RemotePolicy, fit_to_timeout, is_remote
from ..sequence import ShmSequence
from .cache import ShardCache
from .index import ShardIndex, as_shard_index
from .plan import ShardPlan
from .prefetch import Prefetcher, check_room
from .worker import ShardWorker

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from typing_extensions import Self


SHUFFLE_WINDOW = 1000  # samples: the default of local shards, read where their samples lie
SHUFFLE_SHARDS = 8     # shards: the default of remote ones, read from the node's shard cache


CACHED_RING_SLOTS = 10  # a cached sequence's ring without a buffer given: the cache's room is
# checked for what so many slots may be reading, which a ring counted as it runs would not bound


def batches_in_flight(buffer: int, num_workers: int) -> int:
    """How many batches in a row a sequence's workers may be reading at once (``buffer`` slots,
    one being built by each worker, and one more): what its shard cache must hold room for."""
    return (buffer + num_workers if num_workers else 0) + 1


class ShardSequence(ShmSequence):
    """A ``ShmSequence`` over tar shards: ``decode(sample)`` turns each sample (a dict of its
    members' bytes by field, e.g. ``sample["jpg"]``, plus ``__key__``, ``__url__`` and
    ``__offset__``, ``__id__``) into an array or a tuple/dict of arrays (or ``bytes``), stacked
    into the batch (``bytes`` as one ragged leaf, see ``shmseq.engine.common.ragged``).

    Args:
        shards: an index file (``shards.json`` from ``write_shards`` or ``ShardIndex.save``),
            shard paths or URLs (scanned when the sequence is made), or a ``ShardIndex``.
        decode: called in the workers, once per sample.
        shuffle_window: how many places a sample may move from its shard's order (with
            ``shuffle``); 1 keeps the shard's order. The default for local shards (1000).
        shuffle_shards: instead, over how many shards a shard's samples are spread (see
            ``ShardPlan``): the default for remote shards (8), whose cache holds that many.
        cache: read the shards from the node's shard cache (``shmseq.shards.cache``), each
            fetched whole once per node; None: for remote shards, unless ``shuffle_window``
            is given (a window of samples reads them where they lie).
        cache_dir: where the cache's folders go (default ``$TMPDIR``, else /var/tmp).
        cache_bytes: the cache's budget (default: the whole data set, at most half of the free
            space of ``cache_dir``'s file system); one that cannot hold what ``buffer +
            num_workers + 1`` batches in a row read is refused at ``start()`` (``buffer``
            defaults to 10 with the cache, ``num_workers`` counts as ``max_workers`` with
            ``'auto'``).
        job: the job the cache belongs to (default: ``SLURM_JOB_ID``, else torchrun's
            ``TORCHELASTIC_RUN_ID``, else "default").
        on_error: ``'raise'`` a ``ShardError`` naming the shard, sample and offset, or
            ``'skip'`` the sample with a ``SkippedSamplesWarning``, counted in ``stats``.
        storage_options: passed to fsspec for URLs (credentials, ...).
        remote: a ``shmseq.remote.RemotePolicy``: the timeout of each remote request and the
            retries of transient failures (default ``RemotePolicy()``: 30 s, 5 attempts, with a
            ``deadline`` of a third of ``timeout``, so that a server that stalls is named before
            a batch times out; one given whose ``worst_case()`` is longer is refused: see
            ``remote.fit_to_timeout``); ``stats`` counts the requests, bytes, retries and time
            spent waiting on them.
        options: ``ShmSequence``'s (``batch_size``, ``num_workers``, ``seed``, ``rank``, ...).
            Every rank gets as many batches: ``last_batch='discard'`` cuts the epoch to a
            multiple of the world size, otherwise it is padded with its first samples.
    """

    worker: ShardWorker
    _plan: ShardPlan

    def __init__(self, shards: ShardIndex | str | os.PathLike | Iterable[str | os.PathLike],
                 decode: Callable[[dict], object], *,
                 shuffle_window: int | None = None, shuffle_shards: int | None = None,
                 cache: bool | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | None = None, job: str | None = None, on_error: str = "raise",
                 storage_options: dict | None = None, remote: RemotePolicy | None = None,
                 **options: Any) -> None:
        check_int("shuffle_window", shuffle_window, 1, optional=True)
        check_int("shuffle_shards", shuffle_shards, 1, optional=True)
        check_bool("cache", cache, optional=True)
        check_int("cache_bytes", cache_bytes, 1, optional=True)
        if shuffle_window is not None and shuffle_shards is not None:
            raise ValueError(f"shuffle_window={shuffle_window} and shuffle_shards={shuffle_shards} "
                             "are two ways to bound the shuffle: give one of them")
        index = as_shard_index(shards, storage_options)
        far = any(is_remote(shard.url) for shard in index.shards)
        if shuffle_window is None and shuffle_shards is None:
            shuffle_window, shuffle_shards = ((None, SHUFFLE_SHARDS) if far else
                                              (SHUFFLE_WINDOW, None))
        self.shuffle_window, self.shuffle_shards = shuffle_window, shuffle_shards
        if cache is None:
            cache = far and shuffle_window is None
        if not cache:
            given = [name for name, value in (("cache_dir", cache_dir), ("cache_bytes", cache_bytes),
                                              ("job", job)) if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} set the shard cache, which is off for these "
                                 f"shards ({'a window of samples' if far else 'local files'}): "
                                 "pass cache=True to read them through it")
        self.cache = ShardCache(index, cache_dir, job, cache_bytes, storage_options=storage_options,
                                policy=remote) if cache else None
        worker = ShardWorker(index, decode, on_error=on_error, storage_options=storage_options,
                             remote=remote, cache=self.cache)
        self._prefetcher: weakref.finalize | None = None
        if cache and options.get("buffer") is None:
            options["buffer"] = CACHED_RING_SLOTS
        super().__init__(worker, len(index), **options)
        policy = fit_to_timeout(remote, self.timeout)  # a stalled server named before the timeout
        self.worker.reader.policy = policy
        if self.cache is not None:
            self.cache.timeout, self.cache.policy = self.timeout, policy

    def _make_plan(self, dset_size: ArrayLike, batch_size: int, shuffle: bool, last_batch: str,
                   rank: int | None, world_size: int | None) -> ShardPlan:
        return ShardPlan(self.worker.reader.index, batch_size,
                         shuffle_window=self.shuffle_window or SHUFFLE_WINDOW,
                         shuffle_shards=self.shuffle_shards, shuffle=bool(shuffle), seed=self._seed,
                         last_batch=last_batch, rank=rank, world_size=world_size,
                         seed_given=self._seed_given)

    def start(self, compat: object = None) -> Self:
        """As ``ShmSequence.start``; with the cache, its room is checked first (a budget too
        small for what the batches in flight read is refused here), and this rank's prefetcher
        starts with the workers."""
        if self.cache is None:
            return super().start(compat)
        depth = self._prepare_cache()
        prefetcher = Prefetcher(self.cache, self._plan, self.epoch, self._resume_at, depth,
                                self.worker.reader.counters)
        try:
            super().start(compat)
        except BaseException:
            prefetcher.close()
            raise
        # closed by finish(), or with the sequence if nobody references it any more
        self._prefetcher = weakref.finalize(self, prefetcher.close)
        prefetcher.start()
        self.cache.count_held()
        return self

    def start_test(self, test_mode: str = "default") -> Self:
        if self.cache is None:
            return super().start_test(test_mode)
        self._prepare_cache()
        super().start_test(test_mode)
        self.cache.count_held()
        return self

    def _prepare_cache(self) -> int:
        """The cache's folder and budget, its room checked; how many batches may be in flight."""
        self.finish()
        assert self.cache is not None  # read through the cache
        self.cache.prepare()
        self._plan.refresh()
        assert self.buffer is not None  # a cached sequence's ring has a buffer (__init__)
        workers = self.max_workers if self.max_workers is not None else self.num_workers
        depth = batches_in_flight(self.buffer, cast(int, workers))
        check_room(self.cache, self._plan, self.epoch, self._resume_at, depth,
                   f"batch_size={self.batch_size}, buffer={self.buffer}, "
                   f"num_workers={self.num_workers}, " + (
                       f"shuffle_shards={self.shuffle_shards}" if self.shuffle_shards else
                       f"shuffle_window={self.shuffle_window}"))
        return depth

    @property
    def stats(self) -> LoaderStats:
        """``ShmSequence``'s, with the shard cache's counts (``shard_fetches``, ...)."""
        stats = super().stats
        if self.cache is not None:
            stats.add_counts(self.worker.pop_counts())  # this process's: the prefetcher's
        return stats

    def finish(self) -> None:
        super().finish()
        closer, self._prefetcher = self._prefetcher, None
        if closer is not None:
            closer()
        if self.cache is not None:
            self._stats.add_counts(self.worker.pop_counts())
            self.cache.release()
        self.worker.reader.close()  # the files read in this process, by num_workers=0 or threads

    def state_dict(self) -> dict:
        """``ShmSequence``'s state, plus the window and the samples of the epoch that runs
        before a resume on another world size had taken."""
        state = super().state_dict()
        return {**state, "shuffle_window": self.shuffle_window,
                "shuffle_shards": self.shuffle_shards,
                "consumed_before": self._plan.consumed(state["epoch"])}

    def load_state_dict(self, state: dict) -> None:
        """As ``ShmSequence``'s; a state saved on another world size resumes too: every rank
        had taken the epoch's first ``position x world_size`` batches, and the rest of the
        epoch is dealt over this run's ranks (the global sample order is kept)."""
        for name in ("shuffle_window", "shuffle_shards"):
            if state.get(name, getattr(self, name)) != getattr(self, name):
                raise ValueError(f"state {name}={state[name]!r} does not match this sequence's "
                                 f"{name}={getattr(self, name)!r}: build the sequence as the "
                                 "saved one was")
        self._plan.refresh()
        consumed, saved_ranks = state.get("consumed_before", 0), state.get("world_size", 1)
        if saved_ranks != self._plan.world_size:
            consumed += state["position"] * saved_ranks * state["batch_size"]
            state = {**state, "world_size": self._plan.world_size, "position": 0}
        self._plan.resume_after(int(state["epoch"]), consumed)
        super().load_state_dict(state)
