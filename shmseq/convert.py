"""Converter threads, the releaser of copied slots, and the output reorder buffer.

A converter takes ``(seq, slot, payload)`` from the middle queue, leases the slot
from the ring (``ring.lease``), decodes the batch into views of it
(``layout.read_batch``) and hands it to the device (``devices.py``):

* a host device returns views: the delivered arrays keep the lease, so the slot
  stays busy until the consumer drops them;
* a copying device (CUDA) returns a completion: the ``Releaser`` keeps the lease
  until the copy has completed, and only then can the slot be written again.

Converted batches wait in ``OrderedOutput`` until the consumer asks for their seq.
"""
from __future__ import annotations

import queue
import threading
from typing import NamedTuple

from .errors import ShmSeqError
from .layout import iter_arrays, read_batch


class Delivery(NamedTuple):
    batch: object         # what the consumer gets
    views: object         # the same batch as numpy views of its slot, if it stays in the slot
    slot: int | None      # the ring slot the batch's views live in, if any
    completion: object    # the device's copy still in flight, if any
    payload_bytes: int    # size of an out-of-ring payload (overflow), else 0
    nbytes: int           # the batch's array bytes


class OrderedOutput:
    """Converted batches keyed by seq, taken strictly in order by the consumer."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: dict[int, object] = {}
        self._failure: BaseException | None = None
        self.floor = 0

    def put(self, seq: int, item) -> None:
        with self._cond:
            if seq >= self.floor:
                self._items[seq] = item
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    def take(self, seq: int, timeout: float):
        """The item for ``seq``; ``None`` after ``timeout`` s. A pipeline failure wins over
        batches still waiting: once the pipeline is broken or closed, every take raises."""
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._items or self._failure, timeout):
                return None
            if self._failure is not None:
                raise self._failure
            item = self._items.pop(seq)
        if isinstance(item, BaseException):
            raise item
        return item

    def drop_below(self, seq: int) -> None:
        """Forget batches before ``seq`` (an epoch left early); their slots come back."""
        with self._cond:
            self.floor = max(self.floor, seq)
            stale = [self._items.pop(key) for key in list(self._items) if key < seq]
        del stale


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
    """``count`` threads turning middle-queue items into deliveries."""

    def __init__(self, count: int, middle: queue.SimpleQueue, output: OrderedOutput, pool, device):
        self.middle = middle
        self.output = output
        self.pool = pool
        self.device = device
        self.releaser = None if device.keeps_slot else Releaser(device)
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
        if self.releaser is not None:
            self.releaser.stop()

    def _run(self) -> None:
        try:
            while (item := self.middle.get()) is not None:
                self._route(*item)
                del item
        except BaseException as exc:  # noqa: BLE001 - a dead converter must not hang the consumer
            self.output.fail(exc)

    def _route(self, seq: int, slot: int | None, payload) -> None:
        if isinstance(payload, BaseException):
            self.output.put(seq, payload)
        elif seq < self.output.floor:
            if slot is not None:
                self.pool.release(slot)
        else:
            self.output.put(seq, self._convert(seq, slot, payload))

    def _convert(self, seq: int, slot: int | None, payload):
        try:
            region = self.pool.ring.lease(slot) if payload is None else payload
            views = read_batch(region)
            batch, completion = self.device.convert(views)
        except Exception as exc:  # noqa: BLE001 - surfaces in the consumer, in order
            error = ShmSeqError(f"converting batch {seq} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return error
        if completion is not None:
            self.releaser.hold(completion, region)
        in_slot = payload is None and self.device.keeps_slot
        return Delivery(batch, views if in_slot else None, slot if in_slot else None, completion,
                        0 if payload is None else len(payload),
                        sum(array.nbytes for array in iter_arrays(views)))
