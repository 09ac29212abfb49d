"""How the messages of protocol.py cross a pipe: framed, written and read.

``Build`` and ``Done``, the two messages every batch costs, travel as fixed binary records
(``build_frame``, ``done_frame``: their fast path, with no message object made to send
them); the others (the ring, stop, errors, overflow batches, counts, multi-shard tasks) are
pickled as a plain tuple, their kind's number first (a message pickled as itself would cost
six times as much: its class is looked up by name at each end). Messages are framed as
``multiprocessing.Connection`` frames them (a big-endian length first), so either side may
use a ``Connection``; both read with ``FrameReader``, every complete message in one read.
"""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np

from .protocol import (Attached, Build, Built, Counted, Done, Ended, Failed, FromWorker, InitFailed,
                       MapRing, Noted, Overflow, Place, Ready, Rebuild, Skipped, Stop,
                       TakeWorker, ToWorker)

_BUILD = struct.Struct("!qq")         # number, slot (-1: none, a batch built before the ring)
_DONE = struct.Struct("<qqqddd")      # number, slot, bytes written, seconds spent, on a CPU,
# and idle before it
_BUILD_TAG, _DONE_TAG, _PICKLE_TAG = b"T", b"D", b"P"
_BUILD_BYTE, _DONE_BYTE = _BUILD_TAG[0], _DONE_TAG[0]  # as decode finds them, looked up once
_unpack_done, _unpack_build = _DONE.unpack_from, _BUILD.unpack_from
_FRAME = struct.Struct("!i")          # Connection's message header,
_LARGE = struct.Struct("!Q")          # and its second one, for messages of 2 GiB or more
_BUILD_HEAD = struct.Struct("!icqq")  # a Build's frame header, tag, number and slot in one
_DONE_HEAD = _FRAME.pack(1 + _DONE.size) + _DONE_TAG
_READ_BYTES = 1 << 16
_new = tuple.__new__  # a message made from its fields, as NamedTuple's _make but without its checks

Message = ToWorker | FromWorker
_KINDS: tuple[type[Message], ...] = (Build, Rebuild, MapRing, Place, TakeWorker, Stop,
          Ready, Attached, Built, Done, Overflow, Failed, Ended, Skipped, Counted, InitFailed,
          Noted)
_NUMBERS = {kind: number for number, kind in enumerate(_KINDS)}


def framed(message: Message) -> bytes:
    """A message with its frame header, ready for one write."""
    kind = type(message)
    if kind is Build:
        return build_frame(*message)
    if kind is Done:
        return done_frame(*message)
    return _pickled(message)


def encode(message: Message) -> bytes:
    """A message as ``Connection.send_bytes`` takes it (no frame header)."""
    return framed(message)[_FRAME.size:]


def build_frame(number: int, slot: int | None, indices: object) -> bytes:
    """``Build(number, slot, indices)``, framed; pickled when ``indices`` is not one array (a
    multi-shard batch's list, a torch sampler's item)."""
    if not isinstance(indices, np.ndarray):
        return _pickled(Build(number, slot, indices))
    indices = indices.astype(np.int64, copy=False)
    head = _BUILD_HEAD.pack(1 + _BUILD.size + indices.nbytes, _BUILD_TAG, number,
                            -1 if slot is None else slot)
    return head + indices.tobytes()


def done_frame(number: int, slot: int, size: int, seconds: float, cpu_seconds: float,
               idle_seconds: float) -> bytes:
    """``Done(number, slot, size, seconds, cpu_seconds, idle_seconds)``, framed."""
    return _DONE_HEAD + _DONE.pack(number, slot, size, seconds, cpu_seconds, idle_seconds)


def _pickled(message: Message) -> bytes:
    return frame(_PICKLE_TAG + pickle.dumps((_NUMBERS[type(message)], *message),
                                            protocol=pickle.HIGHEST_PROTOCOL))


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message ``encode`` made."""
    return _decode_at(data, 0, len(data))


def _decode_at(data: bytes | bytearray | memoryview, start: int, size: int) -> Message:
    """The message of ``size`` bytes at ``start``: the common ones read in place, no copy."""
    tag = data[start]
    if tag == _DONE_BYTE:
        return _new(Done, _unpack_done(data, start + 1))
    if tag == _BUILD_BYTE:
        number, slot = _unpack_build(data, start + 1)
        count = (size - 1 - _BUILD.size) // 8
        indices = np.frombuffer(data, np.int64, count, start + 1 + _BUILD.size).copy()
        return _new(Build, (number, None if slot < 0 else slot, indices))
    fields = pickle.loads(memoryview(data)[start + 1:start + size])  # no copy of an overflow batch
    return _new(_KINDS[fields[0]], fields[1:])


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
    batch) waits in the buffer for the rest; a ``Done``, the common message, is decoded in
    place."""

    def __init__(self, fd: int, *, blocking: bool = False) -> None:
        self.fd = fd
        os.set_blocking(fd, blocking)
        self._buffer = bytearray()
        self._wanted = _READ_BYTES  # the whole message being read, when it is larger

    def read(self) -> list[Message]:
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
