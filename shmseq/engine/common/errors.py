"""Typed failures a user can catch.

Every error says what happened, to which batch, and what to do about it. Every one pickles
(a trainer may send it to another process): the constructors' keywords have defaults, and
the attributes travel in the pickled state.
"""
from __future__ import annotations


class ShmSeqError(RuntimeError):
    """Base class of every failure raised by shmseq's pipeline."""


class WorkerError(ShmSeqError):
    """What a worker's exception left behind: its type's name, message and traceback, and the
    batch. Raised itself only when the exception cannot be rebuilt in the consumer (it does
    not unpickle); otherwise it is the ``__cause__`` of the worker's exception, raised as its
    own type."""

    def __init__(self, message: str, *, exc_type: str = "", exc_message: str = "",
                 worker_traceback: str = "", batch_indices: object = None,
                 batch_number: int | None = None) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.batch_indices = batch_indices
        self.batch_number = batch_number  # the batch's number in the stream the pool dispatched


class WorkerDied(ShmSeqError):
    """A worker process ended without being asked to (killed, crashed, exited). ``starting``:
    it died before its worker object was built (importing the main module, in its constructor
    or ``worker_init_fn``), where a replacement would die the same way."""

    def __init__(self, message: str, *, pid: int | None = None, exitcode: int | None = None,
                 starting: bool = False) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.starting = starting


class BatchTimeout(ShmSeqError, TimeoutError):
    """No batch arrived within ``timeout`` seconds."""


class UnsupportedBatch(ShmSeqError, TypeError):
    """The worker returned something that cannot travel in a slot."""


class SharedMemoryFull(ShmSeqError, MemoryError):
    """/dev/shm cannot hold the ring."""


class PipelineClosed(ShmSeqError):
    """The sequence was finished (or restarted) while a consumer was still reading it."""


class SkippedSamplesWarning(UserWarning):
    """A worker's opt-in skip policy left samples out of a batch (counted in
    ``stats.skipped_samples``)."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no notes, kept in ``__notes__`` only."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # the type ignored: 3.10's BaseException declares no __notes__
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def raised_in_worker(described: tuple, *, what: str, batch_indices: object = None,
                     batch_number: int | None = None) -> BaseException:
    """The exception to raise in the consumer for one a worker raised: the worker's own, of its
    own type (an ``except KeyError`` catches it, as it would without workers), its cause a
    ``WorkerError`` carrying the worker's traceback and the batch, and a note saying ``what``
    failed. A ``WorkerError`` itself when the exception does not unpickle here.

    ``described`` is the worker's ``(type name, message, traceback text, pickled exception)``.
    """
    import pickle

    exc_type, exc_message, text, pickled = described
    record = WorkerError(f"{what}: {exc_type}: {exc_message}\n\nWorker traceback:\n{text}",
                         exc_type=exc_type, exc_message=exc_message, worker_traceback=text,
                         batch_indices=batch_indices, batch_number=batch_number)
    try:
        original = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - any failure to rebuild it means the record is raised
        original = None
    if not isinstance(original, BaseException):
        return record
    original.__cause__ = record
    add_note(original, f"shmseq: {what}")
    return original


_warned_in_process: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``warn_user`` the first time ``key`` comes up in this process: a fact about the machine
    (no CUDA here) is news once, not at every sequence made."""
    if key not in _warned_in_process:
        _warned_in_process.add(key)
        warn_user(message)


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn, pointing at the first frame outside shmseq and the standard library (the user's
    line)."""
    import os
    import sys
    import sysconfig
    import types
    import warnings

    paths = sysconfig.get_paths()
    installed = (paths["purelib"], paths["platlib"])
    package = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # shmseq/engine/common

    def passed_over(filename: str) -> bool:
        return filename.startswith(package) or (
            filename.startswith(paths["stdlib"]) and not filename.startswith(installed))

    frame: types.FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and passed_over(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
