"""The messages between the consumer and its workers: each kind survives the pipe, framed as
``multiprocessing.Connection`` frames them, whole or in pieces."""
import os
import threading
from multiprocessing import connection

import numpy as np
import pytest

from shmseq.wire import FrameReader, decode, done_frame, encode, framed, task_frame

MESSAGES = [
    ("task", 3, 4, np.arange(5, dtype=np.int64)),
    ("task", 0, None, np.arange(3, dtype=np.int64)),       # built before the ring: no slot
    ("task", 2, 0, np.arange(4, dtype=np.int32)),           # any integer dtype: sent as int64
    ("task", 7, 1, [np.arange(2), np.arange(2, 4)]),        # multi-shard: pickled
    ("done", 9, 2, 4096, 0.25),
    ("ring", {"name": "/x"}),
    None,                                                   # stop
]


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):  # a: as decoded, which is always int64
        return a.dtype == np.int64 and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: "stop" if m is None else m[0])
def test_every_message_round_trips(message):
    assert _same(decode(encode(message)), message)
    assert framed(message)[4:] == encode(message)


def test_fast_frames_are_the_framed_messages():
    indices = np.arange(6, dtype=np.int64)
    assert task_frame(1, 2, indices) == framed(("task", 1, 2, indices))
    assert done_frame(1, 2, 3, 0.5) == framed(("done", 1, 2, 3, 0.5))


def test_a_task_owns_its_indices():
    """Decoded in place from the reader's buffer, the indices must not view it."""
    reader, writer = os.pipe()
    try:
        os.write(writer, task_frame(1, 0, np.arange(4, dtype=np.int64)))
        (message,) = FrameReader(reader).read()
        assert message[3].flags.owndata and message[3].tolist() == [0, 1, 2, 3]
    finally:
        os.close(reader)
        os.close(writer)


def test_reader_takes_every_complete_message_and_waits_for_the_rest():
    reader, writer = os.pipe()
    try:
        frames = FrameReader(reader)
        data = (task_frame(1, 0, np.arange(3, dtype=np.int32)) + done_frame(1, 0, 10, 0.1)
                + framed(("ring", "r")))
        os.write(writer, data[:-5])
        got = frames.read()
        assert [m[0] for m in got] == ["task", "done"] and got[0][3].tolist() == [0, 1, 2]
        assert frames.read() == []  # nothing more yet: no blocking
        os.write(writer, data[-5:])
        assert frames.read() == [("ring", "r")]
    finally:
        os.close(reader)
        os.close(writer)


def test_a_message_larger_than_one_read_arrives_whole():
    payload = np.random.default_rng(0).integers(0, 255, 300_000, dtype=np.uint8)
    receiver, sender = connection.Pipe(duplex=False)
    frames = FrameReader(receiver.fileno())
    writer = threading.Thread(target=sender.send_bytes, args=(encode(("overflow", 5, None, payload, 0.1)),))
    writer.start()
    got = []
    while not got:
        got = frames.read()
    writer.join()
    assert got[0][0] == "overflow" and np.array_equal(got[0][3], payload)
    receiver.close()
    sender.close()


def test_connection_and_reader_speak_the_same_frames():
    receiver, sender = connection.Pipe(duplex=False)
    sender.send_bytes(encode(("done", 1, 2, 3, 0.5)))
    assert FrameReader(receiver.fileno()).read() == [("done", 1, 2, 3, 0.5)]
    os.write(sender.fileno(), task_frame(4, 5, np.arange(2)))
    assert _same(decode(receiver.recv_bytes()), ("task", 4, 5, np.arange(2)))
    receiver.close()
    sender.close()


def test_a_blocking_reader_sleeps_in_the_read_and_sees_the_writer_leave():
    reader, writer = os.pipe()
    frames = FrameReader(reader, blocking=True)
    threading.Timer(0.05, os.write, (writer, done_frame(1, 2, 3, 0.0))).start()
    assert frames.read() == [("done", 1, 2, 3, 0.0)]  # blocked until it came
    os.close(writer)
    with pytest.raises(EOFError):
        frames.read()
    os.close(reader)
