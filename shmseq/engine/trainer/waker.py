"""What the consumer's thread waits on: one epoll over every worker's pipes and sentinel, and
the waker, by which other threads cut that wait short (a slot came free, ``finish()``)."""
from __future__ import annotations

import os
import select
import threading


class Waker:
    """Cuts the consumer's wait short from any thread: a slot came free, ``finish()`` was called."""

    def __init__(self) -> None:
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._reader, False)
        os.set_blocking(self._writer, False)
        self._lock = threading.Lock()  # never held where a weakref callback could run
        self.waiting = False

    def fileno(self) -> int:
        return self._reader

    def fds(self) -> tuple[int, int]:
        return self._reader, self._writer

    def wake(self) -> None:
        with self._lock:
            if self._writer >= 0:
                try:
                    os.write(self._writer, b"\0")
                except BlockingIOError:
                    pass  # already woken

    def wake_if_waiting(self) -> None:
        if self.waiting:
            self.wake()

    def drain(self) -> None:
        try:
            while os.read(self._reader, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            for fd in (self._reader, self._writer):
                os.close(fd)
            self._reader = self._writer = -1


class Events:
    """One epoll for the whole run: what to do when each descriptor is ready. (Not
    ``selectors``: its Python layer cost more, a batch, than everything else here.)"""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, tuple] = {}

    def watch(self, fd: int, handler: tuple, write: bool = False) -> None:
        self._epoll.register(fd, select.EPOLLOUT if write else select.EPOLLIN)
        self._handlers[fd] = handler

    def unwatch(self, fd: int | None) -> None:
        if fd is not None and self._handlers.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def watching(self, fd: int) -> bool:
        return fd in self._handlers

    def wait(self, timeout: float | None) -> list[tuple[int, tuple]]:
        """The ready descriptors and their handlers, as registered when they were found."""
        handlers = self._handlers
        return [(fd, handlers[fd]) for fd, _ in self._epoll.poll(-1 if timeout is None else timeout)
                if fd in handlers]

    def current(self, fd: int, handler: tuple) -> bool:
        """Whether ``handler`` still handles ``fd`` (not replaced meanwhile by a new worker's)."""
        return self._handlers.get(fd) is handler

    def close(self) -> None:
        self._epoll.close()
        self._handlers.clear()
