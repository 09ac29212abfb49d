"""What each worker is building, on a page of shared memory: the evidence a death is charged on.

A worker writes the batch number of a task into its cell as it begins building it (a store to shared
memory: nothing crosses a pipe). When a worker dies, the pool reads the cell: the batch was
being built only if the cell holds that batch's number. A worker killed between tasks, in its
constructor, or before it read its first task (an out-of-memory kill that takes two workers in
a row, say) leaves a cell that does not name the batch, and the batch is not blamed for it.

The page is made like the ring (ring.py): its name unlinked at once, workers map it through the
consumer's descriptor, so nothing is ever left in /dev/shm.
"""
from __future__ import annotations

import mmap
import os
import secrets
from typing import NamedTuple

import numpy as np

from .segments import owners_segment, unlinked_segment

IDLE = -1


class BoardSpec(NamedTuple):
    """What a worker needs to map the board (picklable)."""
    owner_pid: int
    owner_fd: int
    n_workers: int


def _cells(fd: int, n_workers: int) -> tuple[mmap.mmap, np.ndarray]:
    memory = mmap.mmap(fd, max(n_workers, 1) * 8, flags=mmap.MAP_SHARED)
    return memory, np.frombuffer(memory, np.int64, count=n_workers)


class Board:
    """The consumer's side: reads which batch a worker was building; clears a dead worker's cell."""

    def __init__(self, n_workers: int) -> None:
        segment = unlinked_segment(f"/shmseq-{os.getpid()}-board-{secrets.token_hex(4)}",
                                   size=max(n_workers, 1) * 8)
        self._segment = segment
        self.spec = BoardSpec(os.getpid(), segment.fd, n_workers)
        self._memory, cells = _cells(segment.fd, n_workers)
        self._cells: np.ndarray | None = cells  # None once closed
        cells[:] = IDLE

    def building(self, wid: int) -> int:
        """The number of the batch worker ``wid`` began and did not finish; ``IDLE`` if none."""
        assert self._cells is not None, "the board is closed"
        return int(self._cells[wid])

    def clear(self, wid: int) -> None:
        """Before a replacement starts: nothing is being built in the cell's name."""
        assert self._cells is not None, "the board is closed"
        self._cells[wid] = IDLE

    def close(self) -> None:
        self._cells = None
        self._memory.close()
        self._segment.close_fd()


class WorkerCell:
    """A worker's side: one cell, written as each task begins."""

    def __init__(self, spec: BoardSpec, wid: int) -> None:
        fd = owners_segment(spec.owner_pid, spec.owner_fd)
        try:
            self._memory, cells = _cells(fd, spec.n_workers)
        finally:
            os.close(fd)
        self._cell: np.ndarray | None = cells[wid:wid + 1]  # None once closed

    def begin(self, number: int) -> None:
        assert self._cell is not None, "the cell is closed"
        self._cell[0] = number

    def close(self) -> None:
        self._cell = None
        self._memory.close()
