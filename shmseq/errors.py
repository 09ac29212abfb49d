"""Typed failures a user can catch.

Every error says what happened, to which batch, and what to do about it.
"""
from __future__ import annotations


class ShmSeqError(RuntimeError):
    """Base class of every failure raised by shmseq's pipeline."""


class WorkerError(ShmSeqError):
    """The user's worker raised: carries the original type, message, traceback and batch."""

    def __init__(self, message: str, *, exc_type: str, exc_message: str,
                 worker_traceback: str, batch_indices=None, seq: int | None = None):
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.batch_indices = batch_indices
        self.seq = seq


class WorkerDied(ShmSeqError):
    """A worker process ended without being asked to (killed, crashed, exited)."""

    def __init__(self, message: str, *, pid: int | None, exitcode: int | None):
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode


class BatchTimeout(ShmSeqError, TimeoutError):
    """No batch arrived within ``timeout`` seconds."""


class UnsupportedBatch(ShmSeqError, TypeError):
    """The worker returned something that cannot travel in a slot."""


class SharedMemoryFull(ShmSeqError, MemoryError):
    """/dev/shm cannot hold the ring."""


class PipelineClosed(ShmSeqError):
    """The sequence was finished (or restarted) while a consumer was still reading it."""


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn, pointing at the first frame outside shmseq and the standard library (the user's
    line)."""
    import os
    import sys
    import sysconfig
    import warnings

    paths = sysconfig.get_paths()
    installed = (paths["purelib"], paths["platlib"])

    def passed_over(filename: str) -> bool:
        return filename.startswith(os.path.dirname(__file__)) or (
            filename.startswith(paths["stdlib"]) and not filename.startswith(installed))

    frame, level = sys._getframe(1), 2
    while frame is not None and passed_over(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
