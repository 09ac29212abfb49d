"""Per-stage costs of one batch's trip, with pytest-benchmark: ``python -m pytest bench -q``.

Encode and decode a batch's slot layout, take a slot round its state machine, encode and
decode the messages each batch costs, hand a slot id to another process and back, make the
consumer's view and tensor, and take a whole 0.1 MB batch through shmseq and through the bare
ring (the least a shared-memory ring can cost).
Payload-sized stages run on a cifar and an imagenet64 batch; the others do not
depend on the batch size.
"""
from __future__ import annotations

import multiprocessing
import os
import struct

import numpy as np
import posix_ipc
import pytest

from shmseq import SlotAllocator, wire
from shmseq.bench.systems import SYSTEMS
from shmseq.bench.workloads import WORKLOADS, Workload
from shmseq.engine.common.layout import encode_batch, read_batch, write_batch
from shmseq.engine.trainer.ring import Ring

SLACK = 64 * 1024
VIEW_SHAPE = (256, 32, 32, 3)
VIEW_OFFSET = 64
_SEQ_SLOT = struct.Struct("<qq")
_STOP = b"stop"


def _batch(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    images = np.full((workload.batch_size, *workload.image_shape), 7, np.uint8)
    return images, np.arange(workload.batch_size, dtype=np.int64)


def _region(workload: Workload) -> np.ndarray:
    region = np.empty(workload.batch_bytes + SLACK, np.uint8)
    region.fill(0)  # faulted in, as the ring's slots are
    return region


@pytest.fixture(params=["cifar", "imagenet64"])
def workload(request) -> Workload:
    return WORKLOADS[request.param]


@pytest.fixture
def ring():
    ring = Ring.create(4, 1 << 20, wake=lambda: None)
    yield ring
    ring.close()


def _written(ring: Ring) -> int:
    slot = ring.acquire()
    ring.written(slot)
    return slot


def test_write_batch(benchmark, workload):
    """Worker side, returning worker: the payload copy plus the header."""
    batch, region = _batch(workload), _region(workload)
    benchmark(write_batch, batch, region)


def test_write_batch_in_place(benchmark):
    """Worker side, in-place worker: arrays already in the slot, only the header is written."""
    workload = WORKLOADS["imagenet64"]
    region = _region(workload)
    allocator = SlotAllocator(region)
    images = allocator.empty((workload.batch_size, *workload.image_shape), np.uint8)
    labels = allocator.empty(workload.batch_size, np.int64)
    benchmark(write_batch, (images, labels), region, allocator)


def test_encode_batch(benchmark, workload):
    """The overflow path and sizing probe: the batch into a buffer of its own."""
    benchmark(encode_batch, _batch(workload))


def test_read_batch(benchmark):
    """Consumer side: the skeleton unpickled, the arrays rebuilt as views (size-independent)."""
    workload = WORKLOADS["imagenet64"]
    region = _region(workload)
    write_batch(_batch(workload), region)
    benchmark(read_batch, region)


def _slot_round(ring: Ring) -> None:
    """free -> dispatched -> written -> leased -> free: the lease is dropped at once."""
    ring.lease(_written(ring))
    ring.collect()


def test_slot_round(benchmark, ring):
    benchmark(_slot_round, ring)


@pytest.mark.parametrize("kind", ["build", "done"])
def test_message_encode_decode(benchmark, kind):
    """A ``Build`` of 256 indices or a ``Done``, framed and decoded: the two messages each batch
    costs on the pipes, less the system calls (protocol.py's types, wire.py's fast path)."""
    indices = np.arange(256, dtype=np.int64)
    if kind == "build":
        message = benchmark(lambda: wire.decode(wire.build_frame(7, 3, indices)[4:]))
        assert message.number == 7 and message.indices.tolist() == indices.tolist()
    else:
        message = benchmark(lambda: wire.decode(wire.done_frame(7, 3, 4096, 0.25, 0.125, 0.0)[4:]))
        assert message == (7, 3, 4096, 0.25, 0.125, 0.0)


def _echo(connection) -> None:
    while (message := connection.recv_bytes()) != _STOP:
        connection.send_bytes(message)


@pytest.fixture
def echo():
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(target=_echo, args=(theirs,), daemon=True)
    process.start()
    yield ours
    ours.send_bytes(_STOP)
    process.join(5)
    ours.close()
    theirs.close()


def _round_trip(connection) -> tuple[int, int]:
    connection.send((1234, 5))
    return connection.recv()


def _round_trip_raw(connection) -> tuple[int, int]:
    connection.send_bytes(_SEQ_SLOT.pack(1234, 5))
    return _SEQ_SLOT.unpack(connection.recv_bytes())


def test_handoff_round_trip(benchmark, echo):
    """A (seq, slot) message to another process and back: what crosses instead of a batch."""
    assert benchmark(_round_trip, echo) == (1234, 5)


def test_handoff_round_trip_raw(benchmark, echo):
    """The same as packed bytes: what pickling the message adds to the trip."""
    assert benchmark(_round_trip_raw, echo) == (1234, 5)


def _echo_queue(inbox_name: str, outbox_name: str) -> None:
    inbox, outbox = posix_ipc.MessageQueue(inbox_name), posix_ipc.MessageQueue(outbox_name)
    while (message := inbox.receive()[0]) != _STOP:
        outbox.send(message)


@pytest.fixture
def echo_queue():
    """The same echo through two kernel message queues (posix_ipc), the alternative to pipes."""
    names = [f"/shmseq-bench-{os.getpid()}-{side}" for side in ("to", "from")]
    to_child, from_child = (posix_ipc.MessageQueue(name, posix_ipc.O_CREX, max_messages=8)
                            for name in names)
    process = multiprocessing.get_context("fork").Process(target=_echo_queue, args=names, daemon=True)
    process.start()
    yield to_child, from_child
    to_child.send(_STOP)
    process.join(5)
    for queue in (to_child, from_child):
        queue.close()
        queue.unlink()


def _round_trip_queue(queues) -> tuple[int, int]:
    to_child, from_child = queues
    to_child.send(_SEQ_SLOT.pack(1234, 5))
    return _SEQ_SLOT.unpack(from_child.receive()[0])


def test_handoff_round_trip_message_queue(benchmark, echo_queue):
    """Slot ids through posix_ipc message queues: measured against the pipes shmseq uses."""
    assert benchmark(_round_trip_queue, echo_queue) == (1234, 5)


def test_view(benchmark, ring):
    lease = ring.lease(_written(ring))
    view = benchmark(np.ndarray, VIEW_SHAPE, np.uint8, buffer=lease, offset=VIEW_OFFSET)
    assert view.base is lease
    del view, lease


def test_from_numpy(benchmark, ring):
    torch = pytest.importorskip("torch")
    lease = ring.lease(_written(ring))
    view = np.ndarray(VIEW_SHAPE, np.uint8, buffer=lease, offset=VIEW_OFFSET)
    tensor = benchmark(torch.from_numpy, view)
    assert tensor.data_ptr() == view.ctypes.data
    del tensor, view, lease


# -- a whole batch's trip: shmseq against the bare ring ------------------------------------------
@pytest.fixture(params=["bare-ring", "shmseq-inplace"])
def transport(request):
    """An endless stream of 0.1 MB batches (2 workers, 10 slots) from the system named, as
    ``python -m shmseq.bench`` runs it."""
    with SYSTEMS[request.param](WORKLOADS["cifar32"]) as batches:
        yield batches


def test_batch_trip(benchmark, transport):
    """The per-batch floor: a slot id there and back, the views, the tensors. The bare ring
    shows the least a shared-memory ring can cost; shmseq's figure over it is its overhead."""
    benchmark(next, transport)
