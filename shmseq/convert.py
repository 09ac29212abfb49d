"""Where a batch is read: slot -> views -> device, in order, and when a copied slot is freed.

The pool hands ``(seq, slot, payload)`` items on (``payload`` is None for a batch
in its slot, the encoded batch for an overflow, or the error to raise for that
batch). ``to_delivery`` leases the slot from the ring (``ring.lease``), decodes the
batch into views of it (``layout.read_batch``) and gives them to the device:

* host devices (numpy, torch CPU) return views: mapping a slot costs a few
  microseconds, less than a thread hand-off, so it happens in the consumer's thread
  as the batch is handed over (``DirectHandOver``); the delivered arrays keep the
  lease, and the slot stays busy until the consumer drops them;
* copying devices (CUDA) need time and a stream: ``Converters`` threads start the
  copies, and the ``Releaser`` keeps each lease until its copy has completed.

Either way, items wait in ``OrderedOutput`` until the consumer asks for their seq.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, NamedTuple

from .errors import ShmSeqError
from .layout import iter_arrays, read_batch


class Delivery(NamedTuple):
    batch: object         # what the consumer gets
    views: object         # the same batch as numpy views of its slot, if it stays in the slot
    slot: int | None      # the ring slot the batch's views live in, if any
    completion: object    # the device's copy still in flight, if any
    payload_bytes: int    # size of an out-of-ring payload (overflow), else 0
    nbytes: int           # the batch's array bytes


def to_delivery(seq: int, slot: int | None, payload, ring, device):
    """The item as a Delivery (or the error to raise for its batch), and the region a
    copy still in flight reads (None when nothing is in flight)."""
    if isinstance(payload, BaseException):
        return payload, None
    try:
        region = ring.lease(slot) if payload is None else payload
        views = read_batch(region)
        batch, completion = device.convert(views)
    except Exception as exc:  # noqa: BLE001 - surfaces in the consumer, in order
        error = ShmSeqError(f"converting batch {seq} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error, None
    in_slot = payload is None and device.keeps_slot
    delivery = Delivery(batch, views if in_slot else None, slot if in_slot else None, completion,
                        0 if payload is None else len(payload),
                        sum(array.nbytes for array in iter_arrays(views)))
    return delivery, (region if completion is not None else None)


MISSING = object()


class OrderedOutput:
    """Items keyed by seq, taken strictly in order by the consumer.

    ``on_drop`` is called (outside the lock) with every item that is dropped unread:
    a stale batch of an epoch left early still owns its slot.
    """

    def __init__(self, on_drop: Callable[[object], None] = lambda item: None):
        self._lock = threading.Lock()
        self._items: dict[int, object] = {}
        self._failure: BaseException | None = None
        self._on_drop = on_drop
        self.floor = 0

    def put(self, seq: int, item) -> None:
        with self._lock:
            stale = seq < self.floor
            if not stale:
                self._items[seq] = item
        if stale:
            self._on_drop(item)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def pop(self, seq: int):
        """The item for ``seq``, or ``MISSING``. A pipeline failure wins over batches still
        waiting: once the pipeline is broken or closed, every pop raises."""
        if self._failure is not None:
            raise self._failure
        with self._lock:
            return self._items.pop(seq, MISSING)

    def drop(self, item) -> None:
        """Let go of an item never put in (a stale batch a converter did not convert)."""
        self._on_drop(item)

    def drop_below(self, seq: int) -> None:
        """Forget items before ``seq`` (an epoch left early)."""
        with self._lock:
            self.floor = max(self.floor, seq)
            stale = [self._items.pop(key) for key in list(self._items) if key < seq]
        for item in stale:
            self._on_drop(item)


class DirectHandOver:
    """The middle queue of host devices: items go straight to the output, unconverted."""

    def __init__(self, output: OrderedOutput):
        self.output = output

    def put(self, item: tuple) -> None:
        self.output.put(item[0], item)


class Releaser:
    """Keeps each slot leased until the device's copy out of it has completed."""

    def __init__(self, device):
        self.device = device
        self._held: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="shmseq-releaser", daemon=True)
        self._thread.start()

    def hold(self, completion, region) -> None:
        self._held.put((completion, region))

    def _run(self) -> None:
        while (item := self._held.get()) is not None:
            self.device.wait(item[0])
            del item  # drops the lease: the slot goes back to the ring

    def stop(self) -> None:
        """Return once every copy still in flight has completed."""
        self._held.put(None)
        self._thread.join()


class Converters:
    """``count`` threads starting the device copies of middle-queue items."""

    def __init__(self, count: int, middle: queue.SimpleQueue, output: OrderedOutput, pool, device):
        self.middle = middle
        self.output = output
        self.pool = pool
        self.device = device
        self.releaser = Releaser(device)
        self._threads = [threading.Thread(target=self._run, name=f"shmseq-converter-{i}", daemon=True)
                         for i in range(count)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        """Stop converting, then wait for the copies in flight."""
        for _ in self._threads:
            self.middle.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)
        self.releaser.stop()

    def _run(self) -> None:
        try:
            while (item := self.middle.get()) is not None:
                self._route(*item)
                del item
        except BaseException as exc:  # noqa: BLE001 - a dead converter must not hang the consumer
            self.output.fail(exc)
            self.pool.wake()

    def _route(self, seq: int, slot: int | None, payload) -> None:
        if seq < self.output.floor:
            self.output.drop((seq, slot, payload))
            return
        delivery, in_flight = to_delivery(seq, slot, payload, self.pool.ring, self.device)
        if in_flight is not None:
            self.releaser.hold(delivery.completion, in_flight)
        self.output.put(seq, delivery)
        self.pool.wake()
