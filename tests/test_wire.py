"""The messages between the consumer and its workers (protocol.py): each kind survives the pipe,
framed as ``multiprocessing.Connection`` frames them, whole or in pieces, and comes back as its
type."""
import os
import threading
from multiprocessing import connection

import numpy as np
import pytest

from shmseq.engine.common.protocol import Build, Done, ErrorReport, Failed, MapRing, Overflow, Stop
from shmseq.engine.common.wire import FrameReader, build_frame, decode, done_frame, encode, framed

MESSAGES = [
    Build(3, 4, np.arange(5, dtype=np.int64)),
    Build(0, None, np.arange(3, dtype=np.int64)),       # built before the ring: no slot
    Build(2, 0, np.arange(4, dtype=np.int32)),           # any integer dtype: sent as int64
    Build(7, 1, [np.arange(2), np.arange(2, 4)]),        # multi-shard: pickled
    Done(9, 2, 4096, 0.25, 0.125, 0.0625),
    MapRing({"name": "/x"}),
    Failed(4, None, ErrorReport("builtins.KeyError", "3", "Traceback...", None)),
    Stop(),
]


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):  # a: as decoded, which is always int64
        return a.dtype == np.int64 and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert _same(decode(encode(message)), message)
    assert framed(message)[4:] == encode(message)


def test_fast_frames_are_the_framed_messages():
    indices = np.arange(6, dtype=np.int64)
    assert build_frame(1, 2, indices) == framed(Build(1, 2, indices))
    assert done_frame(1, 2, 3, 0.5, 0.25, 0.125) == framed(Done(1, 2, 3, 0.5, 0.25, 0.125))


def test_a_task_owns_its_indices():
    """Decoded in place from the reader's buffer, the indices must not view it."""
    reader, writer = os.pipe()
    try:
        os.write(writer, build_frame(1, 0, np.arange(4, dtype=np.int64)))
        (message,) = FrameReader(reader).read()
        assert message.indices.flags.owndata and message.indices.tolist() == [0, 1, 2, 3]
    finally:
        os.close(reader)
        os.close(writer)


def test_reader_takes_every_complete_message_and_waits_for_the_rest():
    reader, writer = os.pipe()
    try:
        frames = FrameReader(reader)
        data = (build_frame(1, 0, np.arange(3, dtype=np.int32))
                + done_frame(1, 0, 10, 0.1, 0.05, 0.0)
                + framed(MapRing("r")))
        os.write(writer, data[:-5])
        got = frames.read()
        assert [type(m) for m in got] == [Build, Done] and got[0].indices.tolist() == [0, 1, 2]
        assert frames.read() == []  # nothing more yet: no blocking
        os.write(writer, data[-5:])
        assert _same(frames.read(), [MapRing("r")])
    finally:
        os.close(reader)
        os.close(writer)


def test_a_message_larger_than_one_read_arrives_whole():
    payload = np.random.default_rng(0).integers(0, 255, 300_000, dtype=np.uint8)
    receiver, sender = connection.Pipe(duplex=False)
    frames = FrameReader(receiver.fileno())
    writer = threading.Thread(target=sender.send_bytes,
                              args=(encode(Overflow(5, None, payload, 0.1, 0.05)),))
    writer.start()
    got = []
    while not got:
        got = frames.read()
    writer.join()
    assert type(got[0]) is Overflow and np.array_equal(got[0].payload, payload)
    receiver.close()
    sender.close()


def test_connection_and_reader_speak_the_same_frames():
    receiver, sender = connection.Pipe(duplex=False)
    sender.send_bytes(encode(Done(1, 2, 3, 0.5, 0.25, 0.0)))
    assert _same(FrameReader(receiver.fileno()).read(), [Done(1, 2, 3, 0.5, 0.25, 0.0)])
    os.write(sender.fileno(), build_frame(4, 5, np.arange(2)))
    assert _same(decode(receiver.recv_bytes()), Build(4, 5, np.arange(2)))
    receiver.close()
    sender.close()


def test_a_blocking_reader_sleeps_in_the_read_and_sees_the_writer_leave():
    reader, writer = os.pipe()
    frames = FrameReader(reader, blocking=True)
    threading.Timer(0.05, os.write, (writer, done_frame(1, 2, 3, 0.0, 0.0, 0.0))).start()
    assert _same(frames.read(), [Done(1, 2, 3, 0.0, 0.0, 0.0)])  # blocked until it came
    os.close(writer)
    with pytest.raises(EOFError):
        frames.read()
    os.close(reader)
