"""How a worker process follows its consumer: it never outlives it by more than a second.

A worker process may be anywhere when its consumer dies: between tasks, inside a 30-second
``__getitem__``, in its constructor, hung in a C call that holds the GIL. So the check is not
left to the worker's loop:

* from its first instruction, the kernel is asked to kill it with its parent
  (``PR_SET_PDEATHSIG``), which covers code that holds the GIL. That "parent" is the *thread*
  that forked it, so every worker process is started from one thread of shmseq's own that lives
  as long as any pool's workers (``start_process``), never from the thread that called
  ``start()``: a prefetch thread, a server's or a notebook's may end long before the trainer.
  Under forkserver the parent is the fork server, which outlives the consumer only while a
  process holds the write end of its "alive" pipe, which every process it forks inherits:
  workers close theirs;
* a watchdog thread polls the consumer (its pid *and* its start time, so a recycled pid is
  not taken for it; not the parent pid, which under forkserver is the fork server) every
  ``WATCH_SECONDS`` and ends the process once it is gone: a second guard, for what the kernel's
  does not cover (a worker that set its own ``PR_SET_PDEATHSIG``, say).

Nothing is left to clean: the ring's name is unlinked as soon as it is made (ring.py).

Ctrl-C belongs to the consumer: SIGINT is blocked in the thread that starts workers, which they
inherit (a spawned worker would otherwise print a ``KeyboardInterrupt`` from its bootstrap),
and ignored in workers.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Callable, NamedTuple

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


class _StartingThread:
    """The one thread that starts every worker process of this process, while any pool holds
    it, so that a worker's ``PR_SET_PDEATHSIG`` fires with the trainer's process and not with
    whichever thread asked for the worker. It ends with the last pool that held it, once that
    pool's workers are gone. SIGINT is blocked in it, which the workers inherit: a Ctrl-C is
    never its, nor a starting worker's, to take."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """As made: in a forked child too, where the parent's thread is not."""
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._holders = 0

    def hold(self) -> None:
        with self._lock:
            self._holders += 1
            if self._thread is None:
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(target=_serve, args=(self._requests,),
                                                name="shmseq-worker-starter", daemon=True)
                self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            assert self._requests is not None  # made with the thread
            self._requests.put(None)
        thread.join()

    def run(self, start: Callable[[], None], execs: bool) -> None:
        """``start()`` on the thread, once it returned (raising what it raised); ``execs``: it
        starts a process by exec (spawn, forkserver). A Ctrl-C while the consumer waits here is
        raised once the process has started, so that no worker is started behind its back."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        assert self._requests is not None, "the starting thread is not held"
        self._requests.put((start, execs, done))
        interrupted = None
        while True:
            try:
                done.result()
                break
            except KeyboardInterrupt as exc:  # noqa: PERF203 - the start goes on: wait for it
                interrupted = exc
        if interrupted is not None:
            raise interrupted


def _serve(requests: queue.SimpleQueue) -> None:
    while (request := requests.get()) is not None:
        start, execs, done = request
        try:
            _block_sigint(execs)
            start()
        except BaseException as exc:  # noqa: BLE001 - raised in the thread that asked
            done.set_exception(exc)
        else:
            done.set_result(None)
        del request, start, done


def _block_sigint(execs: bool) -> None:
    """Block SIGINT in this thread; where processes are started by exec (spawn, forkserver),
    multiprocessing's resource tracker running first: multiprocessing starts it on the first of
    them, and then unblocks SIGINT in the calling thread, before the process is started."""
    if execs:
        resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


_starting_thread = _StartingThread()
os.register_at_fork(after_in_child=_starting_thread.reset)  # the parent's thread is not here


def hold_starting_thread() -> None:
    """A pool will start worker processes (see ``_StartingThread``): until ``release``."""
    _starting_thread.hold()


def release_starting_thread() -> None:
    """The pool's workers are gone."""
    _starting_thread.release()


def start_process(process: BaseProcess, start_method: str) -> None:
    """Start a worker process from the starting thread, which a pool holds."""
    _starting_thread.run(process.start, execs=start_method != "fork")


def start_helper(start: Callable[[], None]) -> None:
    """Run ``start()``, which starts a helper process by fork and exec (``subprocess``), from
    the starting thread, held meanwhile: the helper's ``Lifeline`` then ends it with the
    consumer's process, as a worker's does. Its owner ``hold_starting_thread()`` first, and
    releases it once the helper is gone."""
    _starting_thread.run(start, execs=False)


class Lifeline:
    """A worker process's tie to its consumer (created first thing in the worker)."""

    def __init__(self, consumer: ProcessId) -> None:
        self.consumer = consumer
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
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
    """Be killed when the parent (thread) that started this process ends: shmseq's starting
    thread, which ends with the consumer's process, or the fork server."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _let_the_fork_server_go() -> None:
    """Close the write end of the fork server's "alive" pipe, which a process the fork server
    forked inherits: the fork server exits once the consumer's end closes, and this process
    with it, instead of the fork server waiting on this process."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and alive is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(alive)
        except OSError:
            pass
