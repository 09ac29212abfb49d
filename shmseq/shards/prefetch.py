"""This rank's side of a node's shard cache: which batches read which shard (``ShardUses``), the
room a cache needs for the batches in flight (``check_room``), and the ``Prefetcher`` that
fetches the shards the rank's next batches read, ahead of them (in the rank's fetch process).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from .. import remote
from .cache import BUSY, FULL, ShardCache, estimated_bytes
from .index import ShardIndex
from .ledger import CACHED, FETCHING, NEVER, RankProgress, next_read
from .plan import ShardPlan


FETCH_THREADS = 4           # concurrent whole-shard fetches of one rank's prefetcher
PREFETCH_POLL_S = 0.05      # how often the prefetcher looks again at what it could not start
PACE_WINDOW_S = 5.0         # the consumer's pace is measured over this many seconds
LEAD_FETCHES = 2            # a fetch that evicts starts this many fetch times before its read


class ShardUses:
    """For a rank's epoch, the first and last batch position that reads each shard (a shard
    not read: first past the end, last -1), from the plan; the last two epochs asked are kept."""

    def __init__(self, plan: ShardPlan, index: ShardIndex) -> None:
        self.plan = plan
        self.index = index
        self._known: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        key = (self.plan.version, self.plan.rank, self.plan.world_size, epoch)
        if key not in self._known:
            if len(self._known) >= 2:
                del self._known[next(iter(self._known))]
            batches = self.plan.batches(epoch)  # pure: safe beside the dispatcher's plan.batch
            count = len(self.index.shards)
            first, last = np.full(count, len(batches), np.int64), np.full(count, -1, np.int64)
            if batches:
                ids = np.concatenate(batches)
                positions = np.repeat(np.arange(len(batches)), [len(b) for b in batches])
                shards = self.index.locate(ids)[0]
                np.minimum.at(first, shards, positions)
                np.maximum.at(last, shards, positions)
            self._known[key] = first, last
        return self._known[key]

    def reads(self, epoch: int, position: int) -> np.ndarray:
        """When the batches from ``position`` on read each shard next (``next_read``): its
        first batch in this epoch (one being read: before ``position``), else in the next
        one, else ``NEVER``."""
        (first, last), (then_first, then_last) = self.of(epoch), self.of(epoch + 1)
        return np.where(last >= position, next_read(epoch, first),
                        np.where(then_last >= 0, next_read(epoch + 1, then_first), NEVER))

    def upcoming(self, epoch: int, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, epoch, distance) of what the batches from ``position`` on read, in the order
        they first read it (the shards being read first, then this epoch's next, then the next
        epoch's), with the batches from ``position`` to that first read."""
        first, last = self.of(epoch)
        left = np.flatnonzero(last >= position)
        starts = np.maximum(first[left], position)
        order = np.argsort(starts, kind="stable")
        now, now_at = left[order], starts[order] - position
        first, last = self.of(epoch + 1)
        used = np.flatnonzero(last >= 0)
        order = np.argsort(first[used], kind="stable")
        then, then_at = used[order], first[used][order] + self.plan.length(epoch) - position
        return (np.concatenate([now, then]),
                np.concatenate([np.full(len(now), epoch), np.full(len(then), epoch + 1)]),
                np.concatenate([now_at, then_at]))

    def most_held(self, epoch: int, position: int, depth: int, sizes: np.ndarray) -> tuple[int, int]:
        """(bytes, shards) the cache must hold at once at most, from ``position`` of ``epoch``
        through the next epoch: a shard is held from ``depth`` batches before its first read
        (the batches in flight read it) to its last, once per epoch (in one stretch where its
        last read in this epoch and its first in the next are less than ``depth`` apart)."""
        length = self.plan.length(epoch) - position
        horizon = length + self.plan.length(epoch + 1)
        (first, last), (then_first, then_last) = self.of(epoch), self.of(epoch + 1)
        now, then = last >= position, then_last >= 0
        begin, end = np.maximum(first - position, 0), last - position
        then_begin, then_end = then_first + length, then_last + length
        joined = now & then & (then_begin - end <= depth)
        change = np.zeros(horizon + 1, np.int64)
        count = np.zeros(horizon + 1, np.int64)
        for held, start, stop in ((now, begin, np.where(joined, then_end, end)),
                                  (then & ~joined, then_begin, then_end)):
            low = np.clip(start[held] - depth + 1, 0, horizon)
            high = np.clip(stop[held] + 1, 0, horizon)
            for total, amount in ((change, sizes[held]), (count, np.ones(int(held.sum()), np.int64))):
                np.add.at(total, low, amount)
                np.add.at(total, high, -amount)
        if not horizon:
            return 0, 0
        held_bytes = np.cumsum(change)[:horizon]
        at = int(np.argmax(held_bytes))
        return int(held_bytes[at]), int(np.cumsum(count)[at])


def room_needed(index: ShardIndex, plan: ShardPlan, epoch: int, position: int,
                depth: int) -> tuple[int, int, int]:
    """(need, held, shards): the bytes a cache of ``index``'s shards needs from ``position`` of
    ``epoch`` through the next epoch with ``depth`` batches in flight: the ``shards`` (``held``
    bytes) that ``depth`` batches in a row read at most, and one more being fetched; or the
    whole data set, where that is less."""
    sizes = estimated_bytes(index)
    held, shards = ShardUses(plan, index).most_held(epoch, position, depth, sizes)
    return min(held + int(sizes.max()), int(sizes.sum())), held, shards


def check_room(cache: ShardCache, plan: ShardPlan, epoch: int, position: int, depth: int,
               arguments: str) -> None:
    """Refuse a budget that cannot hold what ``depth`` batches in a row read, plus one shard
    being fetched: the ranks would wait for room forever."""
    assert cache.budget is not None  # settled by prepare()
    need, held, shards = room_needed(cache.index, plan, epoch, position, depth)
    if cache.budget < need:
        given = "" if cache.budget_given else " (the default: half the free space there)"
        raise ValueError(
            f"cache_bytes={cache.budget:,}{given} is less than the shard cache needs: {need:,} bytes, "
            f"the {shards} shards ({held:,} bytes) that {depth} batches in a row read at most "
            f"({arguments}) and one more being fetched ({int(cache.estimates.max()):,} bytes). "
            f"Pass cache_bytes >= {need:,}, or read fewer shards at once: a smaller "
            "shuffle_shards, batch_size or buffer")


class Lead:
    """How many batches before its first read a fetch that takes another shard's room may
    start: the batches in flight, twice over, and the batches the consumer takes (at its pace
    of the last ``PACE_WINDOW_S``) in ``LEAD_FETCHES`` times what a fetch takes. The earlier
    a shard's room is taken, the fewer shards there are to choose from (those the ranks are
    done with), and the sooner the one chosen is read again: with 0.75x the data set in the
    cache, fetching as early as the room allowed fetched 0.60-0.68x of it an epoch, and this
    lead 0.30-0.40x (the fewest the order allows: 0.30x). Until the pace and a fetch are
    measured: no bound (an empty cache has room)."""

    def __init__(self, plan: ShardPlan, depth: int) -> None:
        self._plan, self._depth = plan, depth
        self._place: tuple[int, int] | None = None
        self._taken = 0  # batches the consumer took since the first place known
        self._moves: collections.deque[tuple[float, int]] = collections.deque()
        self._fetch_s: float | None = None

    def moved(self, epoch: int, position: int) -> None:
        if self._place is not None:
            was, at = self._place
            self._taken += position - at if epoch == was else self._plan.length(was) - at + position
        self._place = epoch, position
        now = time.monotonic()
        self._moves.append((now, self._taken))
        while len(self._moves) > 2 and now - self._moves[0][0] > PACE_WINDOW_S:
            self._moves.popleft()

    def fetched(self, seconds: float) -> None:
        self._fetch_s = seconds if self._fetch_s is None else 0.7 * self._fetch_s + 0.3 * seconds

    def batches(self) -> float:
        if self._fetch_s is None or len(self._moves) < 2:
            return math.inf
        (began, before), (now, taken) = self._moves[0], self._moves[-1]
        pace = (taken - before) / (now - began) if now > began else math.inf
        return 2 * self._depth + pace * LEAD_FETCHES * self._fetch_s


def in_flight_until(plan: ShardPlan, depth: int, epoch: int, position: int) -> int:
    """Where the batches in flight may reach, ``depth`` batches past the consumer's place, as a
    ``next_read``: a shard they read is not evicted from under the workers building them."""
    length = plan.length(epoch)
    if position + depth <= length:
        return int(next_read(epoch, position + depth))
    return int(next_read(epoch + 1, position + depth - length))


class Prefetcher:
    """In a rank's fetch process (``shmseq.shards.fetch_process``): follows the consumer
    (``follow``), publishes when the rank reads each shard next in its place on the rank
    board (``progress``, which the consumer's process joined), and fetches the shards its next
    batches read, in the order they first read them, ``FETCH_THREADS`` at a time: the shards of
    this epoch first, then the next one's; into free room as far ahead as the budget allows, in
    another shard's room only within the ``Lead`` of their read. A shard another process
    is fetching is skipped; one whose fetch failed is left to the workers for the rest of the
    run (they say why, and a stalling server is not waited for again on their behalf).

    ``start()`` it; ``close()`` stops the fetches started (their requests cancelled: a slow or
    failing server does not hold up ``finish()``). ``depth``: how many batches past the
    consumer's may be in flight (built by the workers); ``counters``: where its fetches'
    remote requests are counted."""

    def __init__(self, cache: ShardCache, plan: ShardPlan, epoch: int, position: int, depth: int,
                 counters: remote.Counters, progress: RankProgress) -> None:
        self.cache = cache
        self.counters = counters
        self.uses = ShardUses(plan, cache.index)
        self._plan = plan
        self._place = (epoch, position)
        self._moved = threading.Condition()
        self._news = True         # the consumer moved, or a fetch ended: look again
        self._stopping = False
        self._stop = threading.Event()  # set by close(): the fetches in flight end early
        self._fetching: dict[tuple[int, int], Future] = {}  # (shard, epoch) -> its fetch
        self._failed: set[int] = set()  # shards whose fetch failed: the workers' from then on
        self._depth = depth
        self._lead = Lead(plan, depth)
        self._lead.moved(epoch, position)
        self._progress = progress
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shmseq-fetch")
        self._thread = threading.Thread(target=self._run, name="shmseq-prefetch", daemon=True)

    def start(self) -> "Prefetcher":
        self._thread.start()
        return self

    def follow(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position``."""
        self._lead.moved(epoch, position)
        self._tell(place=(epoch, position))

    def _timed(self, fetch: Callable[[], None]) -> None:
        began = time.perf_counter()
        fetch()
        self._lead.fetched(time.perf_counter() - began)

    def _fetch_ended(self, _: Future) -> None:
        self._tell()

    def _tell(self, place: tuple[int, int] | None = None) -> None:
        with self._moved:
            self._place = place or self._place
            self._news = True
            self._moved.notify()

    def _run(self) -> None:
        waiting = False
        while True:
            with self._moved:
                while not (self._news or self._stopping):
                    if not self._moved.wait(PREFETCH_POLL_S if waiting else None):
                        break  # time to look again at what others were doing
                if self._stopping:
                    return
                self._news, place = False, self._place
            self._progress.publish(place[0], self.uses.reads(*place))
            waiting = self._fetch_ahead(*place)

    def _fetch_ahead(self, epoch: int, position: int) -> bool:
        """Start what can start, in the order the shards are read, up to the first that cannot
        (no room for it, or another process waits for room for it): what comes after it must
        not take the room. True while something is left for others to finish (a fetch, room)."""
        for key, future in list(self._fetching.items()):
            if future.done():
                del self._fetching[key]
                if future.exception() is not None:
                    self._failed.add(key[0])
        shards, epochs, distances = self.uses.upcoming(epoch, position)
        state, horizon = self.cache.states(), self._lead.batches()
        fetching, waiting = {number for number, _ in self._fetching}, False
        for at in np.flatnonzero(state[shards] != CACHED):
            key = number, wanted = int(shards[at]), int(epochs[at])
            if number in fetching or number in self._failed:
                continue
            if len(self._fetching) >= FETCH_THREADS:
                return waiting  # the end of a fetch of its own wakes it
            try:
                started = self.cache.prefetch(number, wanted, self.counters, self._stop,
                                              evict=bool(distances[at] < horizon))
            except Exception:  # noqa: BLE001 - left to the workers, whose batch says why
                self._failed.add(number)
                continue
            if started is BUSY and state[number] == FETCHING:  # another process fetches it
                waiting = True
                continue
            if started is not BUSY and started is not FULL:
                assert callable(started)  # a fetch, not one of the two words
                self._fetching[key] = self._pool.submit(self._timed, started)
                self._fetching[key].add_done_callback(self._fetch_ended)
                fetching.add(number)
                continue
            return True  # no room, or its fetcher waits for room
        return waiting

    def close(self) -> None:
        """Stop the fetches in flight."""
        self._stop.set()
        with self._moved:
            self._stopping = True
            self._moved.notify()
        if self._thread.ident is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)
