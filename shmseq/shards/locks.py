"""Locks of the shard cache: ``fcntl.flock`` on files of its folder, released by the kernel when
their process dies (a crashed process leaves no lock behind); a forked child lets go of its
parent's.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator

from .files import open_private


_held: set[int] = set()  # this process's lock descriptors, which a forked child must not keep


def _let_go_after_fork() -> None:
    """In a forked child: close the parent's lock descriptors, whose copies would otherwise
    keep the parent's locks held for as long as the child lives."""
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()

os.register_at_fork(after_in_child=_let_go_after_fork)


def lock(path: str, *, exclusive: bool = True, wait: bool = True) -> int | None:
    """A descriptor of ``path`` holding its flock; None if ``wait`` is False and it is held."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    _held.add(fd)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) |
                    (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        unlock(fd)
        return None
    except BaseException:
        unlock(fd)
        raise
    return fd


def unlock(fd: int) -> None:
    _held.discard(fd)
    os.close(fd)  # the lock goes with the last descriptor of its open file


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """``path``'s flock, held for the block."""
    fd = lock(path)
    assert fd is not None  # waited for
    try:
        yield
    finally:
        unlock(fd)


def is_held(path: str, *, shared: bool = False) -> bool:
    """Whether a live process holds ``path``'s lock (a dead one's is released by the kernel);
    ``shared``: a shared hold counts too."""
    fd = lock(path, exclusive=shared, wait=False)
    if fd is not None:
        unlock(fd)
    return fd is None
