"""A rank's fetch process: its shard cache's ``Prefetcher``, out of the training process.

Every byte fetched costs CPU (received, checked, written to the cache), and in the trainer's
process that CPU competes with the training loop for the interpreter. So each rank runs its
prefetcher in a process of its own, started by fork and exec (never a fork of the trainer, which
holds threads) from the engine's starting thread and tied to the consumer by a ``Lifeline``:
it never outlives the trainer. Who does what:

* The consumer's process joins the rank board (before its workers start: the shards their
  first batches read are then kept) and keeps its place there for as long as the rank runs
  (the progress file's flock, shared with the fetch process): a fetch process that dies leaves
  the rank on the board, said once (``FetchProcessDied``), and the workers fetch what they need
  themselves, as they always may.
* On the consumer's thread, as each batch is handed over (``moved``): where the batches in
  flight may reach (``publish_reach``, before they are dispatched), and the consumer's place
  written into a page both processes map (one 8-byte word: never read half-written). No
  message, no wake-up: a byte sent down a socket at every batch cost the trainer about 0.1 ms
  of CPU a batch on 2 cores (waking the fetch process), a quarter of what it spends on a batch
  from local shards.
* The fetch process looks at that place every ``PLACE_POLL_S`` and follows it: it publishes
  when the rank reads each shard next, fetches ahead, and writes its counts (remote requests
  and bytes, the cache's fetches) into the same page, where the consumer's ``stats`` read them.
  It ends when the consumer marks the page ended (a process forked from the trainer may keep
  the pipe's write end open), closes its end of the pipe, or dies. The consumer looks whether the
  fetch process ended every ``CHECK_EVERY_S``, and once more at the end, without a signal that
  could kill it (a pipe written to after its reader died sends SIGPIPE).
"""
from __future__ import annotations

import mmap
import os
import pickle
import select
import subprocess
import sys
import time
import warnings
from typing import NamedTuple

import numpy as np

from .. import remote
from ..engine import (PEAK_COUNTS, Lifeline, ProcessId, added_count, hold_starting_thread,
                      release_starting_thread, start_helper)
from .cache import CacheCounters, ShardCache
from .ledger import RankProgress, next_read, read_epoch
from .plan import ShardPlan
from .prefetch import Prefetcher, ShardUses, in_flight_until

COUNTED = (*(f"remote_{name}" for name in remote.Counters.FIELDS), *CacheCounters.FIELDS)
PAGE = 8 + 8 * len(COUNTED)  # the consumer's place, then the fetch process's counts
ENDED = -1  # the place that tells the fetch process to end
CLOSE_WAIT_S = 10.0  # a fetch process told to end has its fetches cancelled within 50 ms
PLACE_POLL_S = 0.02  # how often the fetch process looks at the consumer's place and writes counts
CHECK_EVERY_S = 1.0  # how often the consumer looks whether its fetch process ended


class FetchProcessDied(RuntimeWarning):
    """A rank's fetch process ended before its rank did: its workers fetch what they need
    themselves from then on (each batch's shards, as they come)."""


class SharedPage:
    """The page the consumer's process and its fetch process both map (a memfd, handed over
    by descriptor): the consumer's place as one ``next_read`` word, then the fetch process's
    counts so far (``COUNTED``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, PAGE)
        self.place = np.ndarray(1, np.int64, self._map, 0)
        self.counts = np.ndarray(len(COUNTED), np.float64, self._map, 8)

    @classmethod
    def make(cls, epoch: int, position: int) -> "SharedPage":
        fd = os.memfd_create("shmseq-fetch", os.MFD_CLOEXEC)
        os.ftruncate(fd, PAGE)
        page = cls(fd)
        page.move(epoch, position)
        return page

    def move(self, epoch: int, position: int) -> None:
        self.place[0] = next_read(epoch, position)

    def end(self) -> None:
        """Tell the fetch process to end (where no place can be)."""
        self.place[0] = ENDED

    def ended(self) -> bool:
        return int(self.place[0]) == ENDED

    def where(self) -> tuple[int, int]:
        word = self.place[0]
        return int(read_epoch(word)), int(word - next_read(read_epoch(word), 0))

    def close(self) -> None:
        del self.place, self.counts
        self._map.close()
        os.close(self.fd)


class Setup(NamedTuple):
    """What a fetch process is started with (pickled down its standard input)."""
    cache: ShardCache
    plan: ShardPlan
    epoch: int
    position: int
    depth: int
    consumer: ProcessId
    progress: int  # the descriptors it inherits: the rank's progress file,
    page: int      # the shared page,
    end: int       # the read end of the pipe whose closing ends it


def _setup_file(setup: Setup) -> int:
    """A memfd holding the pickled ``setup``, read from its start: the fetch process's standard
    input. Through a pipe, a setup over the pipe's 64 KiB (an index of a few thousand samples
    with their digests) held the trainer until the new process had imported shmseq and read it
    (0.2 s more before the first batch)."""
    fd = os.memfd_create("shmseq-fetch-setup", os.MFD_CLOEXEC)
    plan, hook = setup.plan, setup.plan.on_release
    plan.on_release = None  # the consumer's own: not sent
    try:
        with open(fd, "wb", closefd=False) as file:
            file.write(pickle.dumps(setup, pickle.HIGHEST_PROTOCOL))
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    finally:
        plan.on_release = hook
    return fd


class FetchProcess:
    """In a rank's consumer process: its place on the rank board, and its fetch process (see
    the module's text). Made before the workers start, ``start()`` after; ``close()`` ends the
    fetch process (its fetches cancelled) and leaves the board."""

    def __init__(self, cache: ShardCache, plan: ShardPlan, epoch: int, position: int,
                 depth: int) -> None:
        self._plan, self._depth = plan, depth
        self._progress = cache.board.join(plan.rank, epoch,
                                          in_flight_until(plan, depth, epoch, position),
                                          ShardUses(plan, cache.index).reads(epoch, position))
        self._page = SharedPage.make(epoch, position)
        self._taken = np.zeros(len(COUNTED))
        self._said, self._killed = False, False
        self._checked = time.monotonic()
        self._owner = os.getpid()
        end, self._end = os.pipe()
        consumer = ProcessId.of(os.getpid())
        assert consumer is not None  # this very process
        setup = Setup(cache, plan, epoch, position, depth, consumer, self._progress.fd,
                      self._page.fd, end)
        hold_starting_thread()
        try:
            self._process = self._spawn(setup)
        except BaseException:
            release_starting_thread()
            self._close_descriptors()
            raise
        finally:
            os.close(end)

    @staticmethod
    def _spawn(setup: Setup) -> subprocess.Popen:
        started: list[subprocess.Popen] = []
        command = [sys.executable, "-c", "from shmseq.shards.fetch_process import main; main()"]

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}

        def start() -> None:  # shmseq imported from where this process imports it
            started.append(subprocess.Popen(command, stdin=given, env=env,
                                            pass_fds=(setup.progress, setup.page, setup.end)))

        given = _setup_file(setup)
        try:
            start_helper(start)
        finally:
            os.close(given)
        return started[0]

    @property
    def pid(self) -> int:
        return self._process.pid

    def start(self) -> "FetchProcess":
        self._plan.on_release = self.moved
        return self

    def moved(self, epoch: int, position: int) -> None:
        """The consumer has every batch of ``epoch`` before ``position`` (on its thread: where
        the batches to dispatch next may reach is published here, before they are)."""
        self._progress.publish_reach(in_flight_until(self._plan, self._depth, epoch, position))
        self._page.move(epoch, position)
        if time.monotonic() - self._checked > CHECK_EVERY_S:
            self._checked = time.monotonic()
            self._say_if_died()

    def _say_if_died(self) -> None:
        code = self._process.poll()
        if code is not None and not self._said and not self._killed:
            self._said = True
            warnings.warn(FetchProcessDied(
                f"the shard fetch process of rank {self._plan.rank} (pid {self._process.pid}) "
                f"ended with exit code {code} while the rank runs: its workers fetch the shards "
                "they need themselves from here on (its error, if it had one, is on standard "
                "error above)"), stacklevel=3)

    def pop_counts(self) -> dict[str, float]:
        """What the fetch process counted since the last call, as ``LoaderStats`` fields."""
        now = self._page.counts.copy()
        grown = now - self._taken
        self._taken = now
        return {name: float(now[at] if name in PEAK_COUNTS else grown[at])
                for at, name in enumerate(COUNTED)
                if grown[at] or (name in PEAK_COUNTS and now[at])}

    def close(self) -> dict[str, float]:
        """End the fetch process (its fetches cancelled) and leave the board; what it counted
        since the last ``pop_counts`` (nothing in a forked child: the fetch process is its
        parent's)."""
        if os.getpid() != self._owner:
            return {}
        if self._plan.on_release == self.moved:
            self._plan.on_release = None
        self._page.end()  # seen within PLACE_POLL_S, whoever else holds the pipe (a fork)
        os.close(self._end)  # the fetch process reads the pipe's end: it ends
        try:
            self._process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._killed = True
            self._process.kill()
            self._process.wait()
        finally:
            release_starting_thread()
        if self._process.returncode != 0:
            self._say_if_died()
        counts = self.pop_counts()
        self._close_descriptors(end=False)
        return counts

    def _close_descriptors(self, end: bool = True) -> None:
        if end:
            os.close(self._end)
        self._page.close()
        self._progress.leave()


def main() -> None:
    """The fetch process: its ``Setup`` from standard input, then the prefetcher follows the
    consumer's place until the consumer closes the pipe (or dies)."""
    setup: Setup = pickle.loads(sys.stdin.buffer.read())
    Lifeline(setup.consumer)
    page = SharedPage(setup.page)
    cache, counters = setup.cache, remote.Counters()
    prefetcher = Prefetcher(cache, setup.plan, setup.epoch, setup.position, setup.depth, counters,
                            RankProgress(setup.progress, len(cache.index.shards), fresh=False))
    prefetcher.start()
    totals, place = np.zeros(len(COUNTED)), (setup.epoch, setup.position)
    try:
        while not select.select([setup.end], [], [], PLACE_POLL_S)[0] and not page.ended():
            if (now := page.where()) != place:
                place = now
                prefetcher.follow(*place)
            _count(totals, counters, cache.counters, page)
    finally:
        prefetcher.close()
        _count(totals, counters, cache.counters, page)


def _count(totals: np.ndarray, counters: remote.Counters, cache_counters: CacheCounters,
           page: SharedPage) -> None:
    """Add what the counters took since the last call to ``totals``, written to the page."""
    taken = {f"remote_{name}": value for name, value in counters.take().items()}
    taken.update(cache_counters.take())
    for at, name in enumerate(COUNTED):
        totals[at] = added_count(name, totals[at], taken[name])
    page.counts[:] = totals
