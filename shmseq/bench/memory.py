"""The memory a loader takes: the proportional set size (PSS) of the training process and of
every process under it (its workers), sampled while the loader runs.

PSS counts a page once over the processes that map it (a page three of them map is a third in
each), so the sum over the tree counts once what they share: the ring, which the trainer and
the workers all map, and the pages forked workers still share with their trainer. Library
pages are shared with every other process on the machine that maps them too, so the figure
moves a little with what else runs: compare systems measured side by side.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Collection, Iterator

SAMPLE_SECONDS = 0.1  # reading one process's smaps_rollup took 2.6 ms (a trainer with torch)


def children(pid: int | None = None) -> set[int]:
    """Live child processes of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found.update(int(child) for child in listed.read().split())
        except OSError:
            pass
    return found


def descendants(pid: int, apart: Collection[int] = ()) -> list[int]:
    """Every live process under ``pid``, but those in ``apart`` and theirs."""
    return [each for child in children(pid) if child not in apart
            for each in (child, *descendants(child, apart))]


def pss_bytes(pid: int) -> int:
    """The process's PSS; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def tree_pss_bytes(pid: int | None = None) -> int:
    """The PSS of ``pid`` (this process by default) and of every process under it, but those
    left ``apart``."""
    pid = os.getpid() if pid is None else pid
    return sum(pss_bytes(each) for each in [pid, *descendants(pid, _APART)])


_APART: set[int] = set()


@contextlib.contextmanager
def apart(pid: int) -> Iterator[None]:
    """Within the block, leave process ``pid`` out of every tree's PSS: a process the bench runs
    beside the loaders (a server), not theirs."""
    _APART.add(pid)
    try:
        yield
    finally:
        _APART.discard(pid)


class PeakPss:
    """While entered, samples this process tree's PSS every ``every`` seconds on a thread of
    its own (None: no thread), on entering and on leaving too, and whenever ``sample()`` is
    called: ``peak`` is the largest sample, in bytes. (Each sample costs the CPU a few
    milliseconds a process: keep it out of windows whose rates are measured, and away from a
    loader that sizes its pool by the CPU it finds free.)"""

    def __init__(self, every: float | None = SAMPLE_SECONDS) -> None:
        self.peak = 0
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmseq-bench-pss", daemon=True)

    def sample(self) -> None:
        self.peak = max(self.peak, tree_pss_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> "PeakPss":
        self.sample()
        if self.every is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()
