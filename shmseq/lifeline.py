"""How a worker process follows its consumer: it never outlives it by more than a second.

A worker process may be anywhere when its consumer dies: between tasks, inside a 30-second
``__getitem__``, in its constructor, hung in a C call that holds the GIL. So the check is not
left to the worker's loop:

* from its first instruction, when its parent is the consumer's main thread or the fork
  server, the kernel is asked to kill it with its parent (``PR_SET_PDEATHSIG``), which covers
  code that holds the GIL. A fork server outlives the consumer only while a process holds the
  write end of its "alive" pipe, which every process it forks inherits: workers close theirs;
* a watchdog thread polls the consumer (its pid *and* its start time, so a recycled pid is
  not taken for it; not the parent pid, which under forkserver is the fork server) every
  ``WATCH_SECONDS`` and ends the process once it is gone (for consumers that started their
  workers from another thread).

Nothing is left to clean: the ring's name is unlinked as soon as it is made (ring.py).

Ctrl-C belongs to the consumer: SIGINT is held back while workers start (a spawned worker
would otherwise print a ``KeyboardInterrupt`` from its bootstrap) and ignored in workers.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Iterator, NamedTuple

WATCH_SECONDS = 0.1
_PR_SET_PDEATHSIG = 1


class ProcessId(NamedTuple):
    """A process as it cannot be mistaken for another: its pid and its start time."""
    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> "ProcessId | None":
        started = _start_time(pid)
        return None if started is None else cls(pid, started)

    def alive(self) -> bool:
        return _start_time(self.pid) == self.started


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while workers start, so that none prints a ``KeyboardInterrupt`` from
    its bootstrap: the signal is blocked (forked workers inherit that) and, in the main
    thread, ignored (what a spawned worker inherits through exec). Blocked, it stays pending
    here on Linux even while ignored: the consumer gets it as soon as the workers started."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if handler is not None:  # None: set outside Python, which could not be put back
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class Lifeline:
    """A worker process's tie to its consumer (created first thing in the worker)."""

    def __init__(self, consumer: ProcessId, die_with_parent: bool):
        self.consumer = consumer
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if die_with_parent:
            _die_with_parent()
        _let_the_fork_server_go()
        if not consumer.alive():  # died before the request took effect
            os._exit(0)
        threading.Thread(target=self._watch, name="shmseq-lifeline", daemon=True).start()

    def _watch(self) -> None:
        while self.consumer.alive():
            time.sleep(WATCH_SECONDS)
        os._exit(0)


def _die_with_parent() -> None:
    """Be killed when the parent (thread) that started this process ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _let_the_fork_server_go() -> None:
    """Close the write end of the fork server's "alive" pipe, which a process the fork server
    forked inherits: the fork server exits once the consumer's end closes, and this process
    with it, instead of the fork server waiting on this process."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(alive)
        except OSError:
            pass
