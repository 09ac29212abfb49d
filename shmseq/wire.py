"""What crosses the pipes between the consumer and its workers, and how it is read and written.

The two messages every batch costs travel as fixed binary records: ``("task", seq, slot,
indices)`` to a worker, ``("done", seq, slot, size, seconds)`` back. The rare ones (the
ring, stop, errors, overflow batches, multi-shard tasks) are pickled. Messages are framed as
``multiprocessing.Connection`` frames them (a big-endian length first), so either side may
use a ``Connection``; both read with ``FrameReader``, every complete message in one read.
"""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np

_TASK = struct.Struct("<qq")          # seq, slot (-1: none yet, the probe that sizes the ring)
_DONE = struct.Struct("<qqqd")        # seq, slot, bytes written, seconds spent
_TASK_TAG, _DONE_TAG, _PICKLE_TAG = b"T", b"D", b"P"
_FRAME = struct.Struct("!i")          # Connection's message header,
_LARGE = struct.Struct("!Q")          # and its second one, for messages of 2 GiB or more
_READ_BYTES = 1 << 16


def encode(message) -> bytes:
    """A message as bytes: ``("task", seq, slot, indices)``, ``("done", seq, slot, size,
    seconds)``, or anything picklable."""
    if message is not None and message[0] == "task":
        return encode_task(*message[1:])
    if message is not None and message[0] == "done":
        return _DONE_TAG + _DONE.pack(*message[1:])
    return _PICKLE_TAG + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def encode_task(seq: int, slot: int | None, indices) -> bytes:
    """A task; pickled when ``indices`` is not one array (a multi-shard batch's list)."""
    if not isinstance(indices, np.ndarray):
        return _PICKLE_TAG + pickle.dumps(("task", seq, slot, indices), pickle.HIGHEST_PROTOCOL)
    return _TASK_TAG + _TASK.pack(seq, -1 if slot is None else slot) + indices.tobytes()


def decode(data) -> object:
    tag = data[:1]
    if tag == _TASK_TAG:
        seq, slot = _TASK.unpack_from(data, 1)
        indices = np.frombuffer(data, np.int64, offset=1 + _TASK.size).copy()
        return ("task", seq, None if slot < 0 else slot, indices)
    if tag == _DONE_TAG:
        return ("done", *_DONE.unpack_from(data, 1))
    return pickle.loads(memoryview(data)[1:])


def frame(data: bytes) -> bytes:
    """``data`` with its header, ready for one write."""
    return _FRAME.pack(len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    """Write a whole framed message to a blocking pipe."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """One end of a pipe, read without blocking: every complete message in one read.

    A message still coming (a large overflow batch) waits in the buffer for the rest; a done
    reply, the common message, is decoded in place."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._buffer = bytearray()
        self._wanted = _READ_BYTES  # the whole message being read, when it is larger

    def read(self) -> list:
        """The messages complete so far, decoded. Raises EOFError once the writer is gone."""
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
            if buffer[start] == _DONE_TAG[0]:
                messages.append(("done", *_DONE.unpack_from(buffer, start + 1)))
            else:
                messages.append(decode(bytes(buffer[start:start + size])))
            at = start + size
        del buffer[:at]
        return messages
