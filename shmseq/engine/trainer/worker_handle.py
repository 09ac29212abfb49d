"""One worker as the consumer sees it: how it starts, its pipes, its open tasks, how it ends.

A worker's life in the pool, one state at a time (``WorkerHandle.move``; a move not drawn
here raises ``IllegalMove``)::

    STARTING -Ready-> READY -Attached-> MAPPED
       |                |                 |
       +----------------+-----------------+--resize--> LEAVING
       |                |                 |               |
       +----------------+-----------------+---------------+--> GONE (left, retired, replaced,
                                                                     stopped)
"""
from __future__ import annotations

import enum
import multiprocessing.process
import os
import pickle
import sys
import threading
import weakref
from multiprocessing import connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Iterable

from ..common.board import BoardSpec
from ..common.errors import ShmSeqError, warn_user
from ..common.hooks import WorkerStart
from ..common.lifeline import ProcessId, start_process
from ..common.protocol import Hooks
from ..common.wire import FrameReader
from ..worker.loop import ProcessTies, WorkerInfo, worker_loop

JOIN_SECONDS = 3.0

_started_here: weakref.WeakSet = weakref.WeakSet()  # the worker processes this process started


def _disown_inherited_workers() -> None:
    """In a forked child, leave the parent's worker processes out of ``multiprocessing``'s
    children, which the child inherited. Its exit hook (``multiprocessing.util._exit_function``)
    would take them for the child's own (``poll()`` gets ECHILD and calls them alive) and send
    them SIGTERM: a trainer's forked helper that merely exits would kill the parent's workers."""
    for process in _started_here:  # the type ignored: a private set, not in the stubs
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
    _started_here.clear()


os.register_at_fork(after_in_child=_disown_inherited_workers)


class WorkerState(enum.Enum):
    STARTING = "starting"  # building its worker object (or running worker_init_fn)
    READY = "ready"        # built it: takes tasks
    MAPPED = "mapped"      # maps the ring too
    LEAVING = "leaving"    # told to leave (the pool shrank): no new task; Stop once it has none
    GONE = "gone"          # left, retired after its death, replaced, or stopped


STARTING, READY, MAPPED, LEAVING, GONE = WorkerState
_MOVES = {STARTING: {READY, LEAVING, GONE}, READY: {MAPPED, LEAVING, GONE},
          MAPPED: {LEAVING, GONE}, LEAVING: {GONE}, GONE: set()}


class IllegalMove(ShmSeqError):
    """A worker was asked to move from one state of its life to another it never goes to."""


class TaskPipe:
    """The consumer's end of a worker's task pipe, which never blocks: what the pipe cannot
    take now (Linux may give a busy user's pipes one page) waits here and goes out as the
    worker reads. Messages are framed as ``Connection.send_bytes`` frames them."""

    def __init__(self, writer: connection.Connection) -> None:
        self._writer = writer
        self.fd = writer.fileno()
        os.set_blocking(self.fd, False)
        self._pending = bytearray()
        self.open = True  # until closed, or found broken (the worker is gone)

    @property
    def waiting(self) -> bool:
        """Whether bytes wait for the pipe to have room."""
        return bool(self._pending)

    def send(self, message: bytes) -> None:
        """Send a framed message. Raises OSError when the worker is gone."""
        if not self._pending:
            try:
                written = os.write(self.fd, message)
            except BlockingIOError:
                written = 0
            if written == len(message):
                return
            message = message[written:]
        self._pending += message

    def flush(self) -> None:
        """Write what the pipe takes now. Raises OSError when the worker is gone."""
        while self._pending:
            try:
                written = os.write(self.fd, self._pending)
            except BlockingIOError:
                return
            del self._pending[:written]

    def close(self) -> None:
        self._writer.close()
        self.fd = -1
        self.open = False


class WorkerHandle:
    """A worker process or thread, its pipes, and the tasks it has not finished."""

    def __init__(self, info: WorkerInfo, tasks: TaskPipe, replies: connection.Connection,
                 runner: threading.Thread | BaseProcess, imports_main: bool = False) -> None:
        self.info = info
        self.tasks = tasks
        self._replies = replies
        self.replies = FrameReader(replies.fileno())
        self.runner = runner
        self.open: dict[int, tuple[object, int | None]] = {}  # number -> (indices, slot), as sent
        self.state = STARTING
        self.replacement = False  # started in a dead worker's place: a death while starting is
        # a death like any other, not a worker that cannot start
        self.imports_main = imports_main  # started by spawn or forkserver: it imports __main__

    def move(self, to: WorkerState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalMove(f"{self.describe()} is {self.state.value}: it never becomes "
                              f"{to.value} from there")
        self.state = to

    @property
    def started(self) -> bool:
        """Whether it built its worker object (a leaving worker is not asked)."""
        return self.state is READY or self.state is MAPPED

    @property
    def leaving(self) -> bool:
        return self.state is LEAVING

    @property
    def accepting(self) -> bool:
        """Whether its task pipe takes messages: open, and not found broken (it died: its
        sentinel, or its last message, tells why)."""
        return self.tasks.open

    @property
    def wid(self) -> int:
        return self.info.id

    @property
    def pid(self) -> int | None:
        return getattr(self.runner, "pid", None)

    @property
    def sentinel(self) -> int | None:
        return getattr(self.runner, "sentinel", None)

    def describe(self) -> str:
        return f"worker {self.wid}" + (f" (pid {self.pid})" if self.pid else "")

    def starting_stage(self, exitcode: int | None) -> str:
        """What a worker process that died while starting was doing, for ``WorkerDied``. One
        started by spawn or forkserver that exited with 1 and sent no error died in
        multiprocessing's bootstrap (importing the main module, unpickling its arguments),
        before shmseq's code ran."""
        if self.imports_main and exitcode == 1:
            return ("in multiprocessing's bootstrap, before shmseq's code ran in it; the error "
                    "it printed is above. A worker started by spawn or forkserver first imports "
                    "the main module: if that starts shmseq's workers at import, put that code "
                    'under if __name__ == "__main__":')
        return "building its worker object or running worker_init_fn"

    def send(self, message: bytes) -> None:
        try:
            self.tasks.send(message)
        except OSError:
            self.tasks.open = False

    def flush(self) -> None:
        """Write what waits for the task pipe, as far as it takes it now."""
        try:
            self.tasks.flush()
        except OSError:
            self.tasks.open = False

    def closed(self, number: int) -> object:
        """The task ``number`` is done (or failed): its indices."""
        indices, _ = self.open.pop(number, (None, None))
        return indices

    def close_replies(self) -> None:
        if self.replies.fd >= 0:
            self._replies.close()
            self.replies.fd = -1

    def close_pipes(self) -> None:
        if self.tasks.fd >= 0:
            self.tasks.close()
        self.close_replies()


def preload_in_fork_server(context: BaseContext) -> None:
    """Have the fork server import shmseq's worker side (numpy with it) before it forks a worker,
    when it is not running yet: a worker then starts in 20 ms instead of 180 ms (measured), the
    time each forked child took to import them. Modules asked for already (``__main__``, by
    default) stay in the list."""
    if context.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver
    server = forkserver._forkserver
    modules = list(getattr(server, "_preload_modules", ["__main__"]))
    if getattr(server, "_forkserver_pid", None) is None and __name__ not in modules:
        context.set_forkserver_preload([*modules, __name__])


def start_worker(worker: object, info: WorkerInfo, backend: str, context: BaseContext,
                 start: WorkerStart, consumer: ProcessId, other_ends: list[int],
                 board: BoardSpec | None = None) -> WorkerHandle:
    """A new worker thread or process. A process follows ``consumer`` (lifeline.py), and
    marks on ``board`` the batch it is building; forked, it closes the consumer's descriptors
    it inherits: its own pipes' consumer ends and ``other_ends``."""
    task_reader, task_writer = connection.Pipe(duplex=False)
    result_reader, result_writer = connection.Pipe(duplex=False)
    name = f"shmseq-worker-{info.id}"
    method = None
    runner: threading.Thread | BaseProcess
    if backend == "thread":
        args: tuple = (worker, task_reader, result_writer, info, start, None)
        runner = threading.Thread(target=worker_loop, name=name, daemon=True, args=args)
        runner.start()
    else:
        method = context.get_start_method()
        _leave_if_bootstrapping()
        ties = ProcessTies(
            consumer, inherited_fds=((task_writer.fileno(), result_reader.fileno(), *other_ends)
                                     if method == "fork" else None), board=board)
        args = (worker, task_reader, result_writer, info, start, ties)
        # the type ignored: the stubs give BaseContext no Process, which every start method's has
        process: BaseProcess = context.Process(  # type: ignore[attr-defined]
            target=worker_loop, name=name, daemon=True, args=args)
        runner = process
        _started_here.add(process)  # before it is one of multiprocessing's children: no fork between
        try:
            start_process(process, method)
        except BaseException:
            _discard(process)  # a Ctrl-C that came while it started: no worker behind our back
            raise
        finally:
            task_reader.close()
            result_writer.close()
    return WorkerHandle(info, TaskPipe(task_writer), result_reader, runner,
                        imports_main=method in ("spawn", "forkserver"))


def _leave_if_bootstrapping() -> None:
    """In a worker still importing the main module (spawn and forkserver run the script again
    in each worker: one without the main guard starts workers again), multiprocessing refuses
    to start a process, with 40 lines in every worker. Say it in one line and exit: the process
    could do nothing else, and the consumer's ``WorkerDied`` says what to change
    (``WorkerHandle.starting_stage``). Printed here, not by ``SystemExit``: a fork server's
    child exits without printing it."""
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        main = getattr(sys.modules.get("__mp_main__"), "__file__", "the main module")
        print(f"shmseq: this worker is importing {main}, which starts shmseq's workers at "
              'import: put that code under if __name__ == "__main__":', file=sys.stderr, flush=True)
        raise SystemExit(1)


def _discard(runner: BaseProcess) -> None:
    """End a worker process that started while its start was being given up."""
    if getattr(runner, "_popen", None) is not None:
        runner.kill()
        runner.join(JOIN_SECONDS)


def consumer_ends(handles: Iterable[WorkerHandle]) -> list[int]:
    """The descriptors of the consumer's pipe ends to these workers."""
    return [fd for handle in handles for fd in (handle.tasks.fd, handle.replies.fd) if fd >= 0]


def end_workers(handles: Iterable[WorkerHandle]) -> None:
    """Kill every process that did not leave in time, then reap them; a thread cannot be
    killed, so say so. A process object is not closed: whoever holds it (torch's iterator lists
    them in ``_workers``) can still ask for its exit code; its last descriptor goes with it."""
    handles = list(handles)
    for handle in handles:
        if not isinstance(handle.runner, threading.Thread) and handle.runner.is_alive():
            handle.runner.kill()
    for handle in handles:
        if isinstance(handle.runner, threading.Thread):
            if handle.runner.is_alive():
                warn_user(f"worker thread {handle.wid} is still inside the worker's code and "
                          "cannot be stopped (a thread cannot be killed): it leaves once that "
                          "code returns")
            continue
        handle.runner.join(JOIN_SECONDS)


def pickled_for(what: str, given: Hooks, start_method: str, fix: str) -> bytes | None:
    """``given.obj`` pickled once, as spawn or forkserver must send it (None under fork, which
    pickles nothing); fails at start when it cannot be, naming ``what`` or, when it lists its
    ``pickled_parts()``, the part that cannot be. One with an ``unpicklable(what, part, exc,
    start_method)`` hook makes the error itself (a front end words it for its own arguments)."""
    if start_method == "fork" or given.obj is None:
        return None
    try:
        return pickle.dumps(given.obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same fix
        what, value = _culprit(what, given)
        if given.unpicklable is not None:
            raise given.unpicklable(what, value, exc, start_method) from exc
        raise TypeError(
            f"{what} {value!r} cannot be pickled, which start_method={start_method!r} needs "
            f"({type(exc).__name__}: {exc}): define it at module level, {fix}") from exc


def _culprit(what: str, given: Hooks) -> tuple[str, object]:
    """The part of ``given.obj`` that cannot be pickled (tried only once pickling it failed)."""
    for name, part in given.pickled_parts().items():
        try:
            pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            return name, part
    return what, given.obj
