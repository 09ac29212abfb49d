"""``ShardSequence``: a ``ShmSequence`` over a shard index, with its plan and worker, and for
remote shards the node's shard cache and this rank's fetch process.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, cast

from ..checks import check_bool, check_int
from ..engine import added_count
from ..remote import RemotePolicy, fit_to_timeout, is_remote
from ..sequence import Batching, ShmSequence, Stage
from .cache import ShardCache
from .index import ShardIndex, as_shard_index
from .fetch_process import FetchProcess
from .nodes import cache_nodes
from .plan import ShardPlan, as_layout
from .prefetch import check_room
from .worker import ShardWorker


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
        if cache and options.get("buffer") is None:
            options["buffer"] = CACHED_RING_SLOTS
        super().__init__(worker, len(index), stage=ShardStage(worker, self.cache,
                                                              shuffle_window, shuffle_shards),
                         **options)
        policy = fit_to_timeout(remote, self.timeout)  # a stalled server named before the timeout
        self.worker.reader.policy = policy
        if self.cache is not None:
            self.cache.timeout, self.cache.policy = self.timeout, policy


def merged(*counts: dict[str, float]) -> dict[str, float]:
    """Counts of several processes as one: added, a peak kept as the largest."""
    total: dict[str, float] = {}
    for some in counts:
        for name, value in some.items():
            total[name] = added_count(name, total.get(name, 0), value)
    return total


class ShardStage(Stage):
    """What a ``ShardSequence`` adds around its ``ShmSequence``: the shard plan; with the
    cache, its room checked at each start and this rank's fetch process running with the
    workers; each rank's node (the ranks sharing its cache folder) told to the plan; the window,
    the layout and what was consumed in its state."""

    def __init__(self, worker: ShardWorker, cache: ShardCache | None, shuffle_window: int | None,
                 shuffle_shards: int | None) -> None:
        self.worker, self.cache = worker, cache
        self.shuffle_window, self.shuffle_shards = shuffle_window, shuffle_shards
        self._fetcher: FetchProcess | None = None
        self._fetched: dict[str, float] = {}  # what a closed fetch process counted, not yet read
        self._share = 0  # the bytes of the shards this rank's node owns
        self._nodes: dict[tuple[int, int], list | None] = {}  # (rank, world size) -> rank's node

    def plan(self, batching: Batching) -> ShardPlan:
        return ShardPlan(self.worker.reader.index, batching.batch_size,
                         shuffle_window=self.shuffle_window or SHUFFLE_WINDOW,
                         shuffle_shards=self.shuffle_shards, shuffle=batching.shuffle,
                         seed=batching.seed, last_batch=batching.last_batch, rank=batching.rank,
                         world_size=batching.world_size, seed_given=batching.seed_given)

    def starting(self, sequence: ShmSequence, test: bool) -> None:
        """With the cache: its folder and budget, its room checked for the batches in flight
        (a budget too small is refused here), and this rank's fetch process started."""
        if self.cache is None:
            return
        self.cache.prepare()
        plan = cast(ShardPlan, sequence.plan)
        plan.refresh()
        self._find_nodes(plan)
        self._share = sum(self.cache.index.shards[s].size or 0 for s in plan.own_shards().tolist())
        options = sequence.options
        assert options.buffer is not None  # a cached sequence's ring has a buffer
        workers = options.max_workers if options.max_workers is not None else options.num_workers
        depth = batches_in_flight(options.buffer, cast(int, workers))
        epoch, position = sequence.resume_point
        check_room(self.cache, plan, epoch, position, depth,
                   f"batch_size={sequence.batch_size}, buffer={options.buffer}, "
                   f"num_workers={options.num_workers}, " + (
                       f"shuffle_shards={self.shuffle_shards}" if self.shuffle_shards else
                       f"shuffle_window={self.shuffle_window}"))
        if not test:
            self._fetcher = FetchProcess(self.cache, plan, epoch, position, depth)

    def _find_nodes(self, plan: ShardPlan) -> None:
        """Tell the plan each rank's node (the ranks sharing a cache folder: only the cache
        makes nodes), gathered once for this world size: a collective, which every rank reaches
        as it loads a state or starts."""
        if self.cache is None:
            return
        key = (plan.rank, plan.world_size)
        if key not in self._nodes:
            self._nodes = {key: cache_nodes(self.cache.folder) if plan.world_size > 1 else None}
        plan.set_nodes(self._nodes[key])

    def started(self) -> None:
        if self._fetcher is not None:
            self._fetcher.start()
        if self.cache is not None:
            self.cache.count_held()

    def finished(self) -> None:
        fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            self._fetched = fetcher.close()
        if self.cache is not None:
            self.cache.release()
        self.worker.reader.close()  # the files read in this process, by num_workers=0 or threads

    def counts(self) -> dict[str, int | float]:
        """With the cache: the counts of this process (its reads, with ``num_workers=0`` or
        threads) and of the rank's fetch process, and the node's fetches against its share."""
        if self.cache is None:
            return {}
        fetched, self._fetched = self._fetched, {}
        counts = merged(fetched, self._fetcher.pop_counts() if self._fetcher else {},
                        self.worker.pop_counts())
        if self._share:  # started: the ledger is there
            counts.update(node_fetch_bytes=self.cache.fetched_bytes(), node_share_bytes=self._share)
        return counts

    def saved(self, sequence: ShmSequence, state: dict) -> dict:
        """The window, each rank's node, and the runs of the epoch before a resume on another
        layout (each one's layout and steps: what they took is dealt from those again)."""
        plan = cast(ShardPlan, sequence.plan)
        return {**state, "shuffle_window": self.shuffle_window,
                "shuffle_shards": self.shuffle_shards, "nodes": list(plan.layout),
                "consumed_before": [[list(layout), steps]
                                    for layout, steps in plan.history(state["epoch"])]}

    def loading(self, sequence: ShmSequence, state: dict) -> dict:
        """A state saved on another layout (world size, or ranks per node) resumes too: every
        rank of the run that saved it had taken its first ``position`` batches; that run joins
        the epoch's history, and the rest of the epoch is dealt over this run's nodes and ranks.
        (A ``consumed_before`` count, as states before node layouts have it, is the epoch's
        first samples as one rank takes them.)"""
        for name in ("shuffle_window", "shuffle_shards"):
            if state.get(name, getattr(self, name)) != getattr(self, name):
                raise ValueError(f"state {name}={state[name]!r} does not match this sequence's "
                                 f"{name}={getattr(self, name)!r}: build the sequence as the "
                                 "saved one was")
        plan = cast(ShardPlan, sequence.plan)
        self._find_nodes(plan)
        history = state.get("consumed_before") or []
        if isinstance(history, int):
            history = [[[0], history // state["batch_size"]]]
        saved = as_layout(state.get("nodes") or [0] * state.get("world_size", 1))
        if saved != plan.layout:
            history = [*history, [saved, state["position"]]]
            state = {**state, "world_size": plan.world_size, "nodes": list(plan.layout),
                     "position": 0}
        plan.resume_after(int(state["epoch"]), [(as_layout(layout), int(steps))
                                                 for layout, steps in history])
        return state
