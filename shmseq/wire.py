"""What crosses the pipes between the consumer and its workers, and how it is read and written.

The two messages every batch costs travel as fixed binary records: ``("task", number, slot,
indices)`` to a worker, ``("done", number, slot, size, seconds)`` back. The rare ones (the
ring, stop, errors, overflow batches, multi-shard tasks) are pickled. Messages are framed as
``multiprocessing.Connection`` frames them (a big-endian length first), so either side may
use a ``Connection``; both read with ``FrameReader``, every complete message in one read.
"""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np

_TASK = struct.Struct("!qq")          # number, slot (-1: none, a batch built before the ring)
_DONE = struct.Struct("<qqqd")        # number, slot, bytes written, seconds spent
_TASK_TAG, _DONE_TAG, _PICKLE_TAG = b"T", b"D", b"P"
_FRAME = struct.Struct("!i")          # Connection's message header,
_LARGE = struct.Struct("!Q")          # and its second one, for messages of 2 GiB or more
_TASK_HEAD = struct.Struct("!icqq")   # a task's frame header, tag, number and slot in one
_DONE_HEAD = _FRAME.pack(1 + _DONE.size) + _DONE_TAG
_READ_BYTES = 1 << 16


def encode(message) -> bytes:
    """A message as bytes: ``("task", number, slot, indices)``, ``("done", number, slot, size,
    seconds)``, or anything picklable."""
    if message is not None and message[0] in ("task", "done"):
        maker = task_frame if message[0] == "task" else done_frame
        return maker(*message[1:])[_FRAME.size:]
    return _PICKLE_TAG + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def framed(message) -> bytes:
    """``encode(message)`` with its frame header, ready for one write."""
    return frame(encode(message))


def task_frame(number: int, slot: int | None, indices) -> bytes:
    """A task, framed; pickled when ``indices`` is not one array (a multi-shard batch's list)."""
    if not isinstance(indices, np.ndarray):
        return frame(_PICKLE_TAG + pickle.dumps(("task", number, slot, indices),
                                                pickle.HIGHEST_PROTOCOL))
    indices = indices.astype(np.int64, copy=False)
    head = _TASK_HEAD.pack(1 + _TASK.size + indices.nbytes, _TASK_TAG, number,
                           -1 if slot is None else slot)
    return head + indices.tobytes()


def done_frame(number: int, slot: int, size: int, seconds: float) -> bytes:
    """A done reply, framed."""
    return _DONE_HEAD + _DONE.pack(number, slot, size, seconds)


def decode(data) -> object:
    return _decode_at(data, 0, len(data))


def _decode_at(data, start: int, size: int) -> object:
    """The message of ``size`` bytes at ``start``: the common ones read in place, no copy."""
    tag = data[start]
    if tag == _DONE_TAG[0]:
        return ("done", *_DONE.unpack_from(data, start + 1))
    if tag == _TASK_TAG[0]:
        number, slot = _TASK.unpack_from(data, start + 1)
        count = (size - 1 - _TASK.size) // 8
        indices = np.frombuffer(data, np.int64, count, start + 1 + _TASK.size).copy()
        return ("task", number, None if slot < 0 else slot, indices)
    return pickle.loads(memoryview(data)[start + 1:start + size])  # no copy of an overflow batch


def frame(data: bytes) -> bytes:
    """``data`` with its header, ready for one write."""
    return _FRAME.pack(len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    """Write a whole framed message to a blocking pipe."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """One end of a pipe: every complete message in one read.

    Read without blocking by the consumer, which waits on many pipes at once; a worker, with
    one pipe to wait on, blocks in the read itself. A message still coming (a large overflow
    batch) waits in the buffer for the rest; a done reply, the common message, is decoded in
    place."""

    def __init__(self, fd: int, *, blocking: bool = False):
        self.fd = fd
        os.set_blocking(fd, blocking)
        self._buffer = bytearray()
        self._wanted = _READ_BYTES  # the whole message being read, when it is larger

    def read(self) -> list:
        """The messages complete so far, decoded (blocking: once anything came, which may be
        part of a message). Raises EOFError once the writer is gone."""
        try:
            chunk = os.read(self.fd, max(_READ_BYTES, self._wanted - len(self._buffer)))
        except BlockingIOError:
            return []
        if not chunk:
            raise EOFError
        buffer = self._buffer
        buffer += chunk
        messages, at, end = [], 0, len(buffer)
        while end - at >= _FRAME.size:
            size, start = _FRAME.unpack_from(buffer, at)[0], at + _FRAME.size
            if size == -1:
                if end - start < _LARGE.size:
                    break
                size, start = _LARGE.unpack_from(buffer, start)[0], start + _LARGE.size
            if end - start < size:
                self._wanted = start - at + size
                break
            messages.append(_decode_at(buffer, start, size))
            at = start + size
        del buffer[:at]
        return messages
