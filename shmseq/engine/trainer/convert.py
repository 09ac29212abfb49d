"""Where a batch is read: every reply takes one route, slot -> device -> consumer, in order.

Before the ring, only replies without a batch come (an error, a stream's end): a ``HandOver``
takes them. Once there is a ring, a ``Converter`` bound to it does: as each reply arrives (in
the consumer's thread, while it waits), ``Converter.arrive`` leases
the batch's slot from the ring, decodes the batch into views of it
(``layout.read_batch``) and gives them to the device. A host device's "copy" completes at
once: the batch *is* the views, and the lease lives as long as they do. A copying device
(CUDA) starts its copy on a stream of its own; the views die at once and the ring keeps
the slot until the copy is done. Either way the ``Delivery`` waits in ``OrderedOutput``
until the consumer asks for its number, and ``Converter.hand_over`` gives it out.

A consumer holding every batch it received (``list(seq)``) would leave the workers no
slot: the batch that would take the last one is handed over as a copy instead (the ring
says which: ``Ring.keep_in_place``).
"""
from __future__ import annotations

import functools
import traceback
from typing import Callable

import numpy as np

from ..common.errors import PipelineClosed, ShmSeqError, add_note, warn_user
from ..common.layout import batch_reader, map_arrays, slot_bytes_for
from ..common.protocol import Delivery, Hooks, Reply
from ..common.ragged import ArrayOrTensor
from .devices import Device
from .ring import Ring
from .stats import LoaderStats


class OrderedOutput:
    """Deliveries keyed by number, taken strictly in order by the consumer.

    Only the consumer's thread puts and pops; ``close`` may come from any thread (a
    ``finish()`` elsewhere), and wins over deliveries still waiting."""

    def __init__(self) -> None:
        self._items: dict[int, Delivery] = {}
        self._closed: str | None = None
        self.floor: float = 0  # infinite once cleared
        self.waiting = 0  # deliveries the consumer has not taken yet (kept: read at every step)

    def put(self, number: int, delivery: Delivery) -> None:
        if number >= self.floor:
            self._items[number] = delivery
            self.waiting = len(self._items)

    def close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason

    def check(self) -> None:
        """Raise ``PipelineClosed`` once closed (a new one each time: see protocol.Reply)."""
        if self._closed is not None:
            raise PipelineClosed(self._closed)

    def pop(self, number: int) -> Delivery | None:
        self.check()
        delivery = self._items.pop(number, None)
        self.waiting = len(self._items)
        return delivery

    def pop_first(self, first_number: int, end: float) -> tuple[int, Delivery] | None:
        """The delivery numbered from ``first_number`` up to ``end`` (excluded) that arrived
        first, with its number."""
        self.check()
        number = next((number for number in self._items if first_number <= number < end), None)
        if number is None:
            return None
        delivery = self.pop(number)
        assert delivery is not None  # it was there
        return number, delivery

    def pop_ended(self, first_number: int) -> list[Delivery]:
        """The ended deliveries (workers' streams that ended) numbered from ``first_number``."""
        numbers = sorted(number for number, delivery in self._items.items()
                         if number >= first_number and delivery.ended)
        ended = [self._items.pop(number) for number in numbers]
        self.waiting = len(self._items)
        return ended

    def drop_below(self, number: float) -> None:
        """Forget deliveries before ``number`` (an epoch left early): their leases die here."""
        self.floor = max(self.floor, number)
        for key in [key for key in self._items if key < number]:
            del self._items[key]
        self.waiting = len(self._items)

    def clear(self) -> None:
        self.drop_below(float("inf"))


def handed_over(device: Device, skipped: Callable[[], list[str]], batch: object, copy: object,
                name: Callable[[], str], stats: LoaderStats) -> object:
    """The device's hand-over of the batch ``name()`` calls (asked only for a message); a
    consumer-side stage that decodes (``shmseq.decode``) may fail here, named with the batch,
    or leave samples out (what its ``skipped``, ``Hooks(device).pop_skipped``, returns)."""
    try:
        delivered = device.hand_over(batch, copy)
    except Exception as exc:
        add_note(exc, f"shmseq: handing over {name()}")
        raise
    if left_out := skipped():
        stats.report_skipped(left_out, name())
    return delivered


class HandOver:
    """Deliveries -> the consumer, and the replies that carry no batch (an error, a stream's
    end) -> deliveries: all there is before the ring, whose first batches wait in their
    workers. ``name`` says how messages call a batch ("batch 3 of epoch 1")."""

    def __init__(self, device: Device, output: OrderedOutput, stats: LoaderStats,
                 name: Callable[[int], str]) -> None:
        self.device = device
        self._device_skipped = Hooks(device).pop_skipped
        self.output = output
        self.stats = stats
        self.name = name

    def arrive(self, reply: Reply) -> None:
        """A reply without a batch: its delivery waits for the consumer."""
        if reply.number >= self.output.floor:
            self.output.put(reply.number, without_batch(reply))

    def hand_over(self, number: int, delivery: Delivery) -> object:
        """The batch as the consumer gets it; raises the batch's error in its place. The batch
        is named (``name``) only for a message."""
        if delivery.error is not None:
            raise delivery.error()
        self.stats.batches += 1
        self.stats.bytes += delivery.nbytes
        if delivery.skipped:
            self.stats.report_skipped(delivery.skipped, self.name(number))
        return self._handed(number, delivery)

    def _handed(self, number: int, delivery: Delivery) -> object:
        return handed_over(self.device, self._device_skipped, delivery.batch, delivery.copy,
                           functools.partial(self.name, number), self.stats)


def without_batch(reply: Reply) -> Delivery:
    """The delivery of a reply that carries no batch: a stream's end, or the error to raise."""
    if reply.ended:
        return Delivery(None, ended=True, noted=reply.noted)
    assert reply.error is not None, "a reply with a batch"
    return Delivery(None, error=reply.error)


class Converter(HandOver):
    """Replies -> deliveries through the device, their batches read from ``ring``'s slots (or
    from the payload of one too large for its slot); deliveries -> the consumer, copied out of
    the ring when keeping them in place would starve it."""

    def __init__(self, device: Device, ring: Ring, output: OrderedOutput,
                 stats: LoaderStats, name: Callable[[int], str]) -> None:
        super().__init__(device, output, stats, name)
        self.ring = ring
        self._warned: set[str] = set()

    def arrive(self, reply: Reply) -> None:
        """Convert a reply as soon as it is there (a copy starts while the consumer works)."""
        if reply.number < self.output.floor:
            if reply.slot is not None:
                self.ring.discard(reply.slot)  # stale: its epoch was left
            return
        if reply.ended or reply.error is not None:
            delivery = without_batch(reply)
        else:
            try:
                delivery = self._convert(reply)
            except Exception as exc:  # noqa: BLE001 - surfaces in the consumer, in order
                delivery = Delivery(None, error=_conversion_failed(self.name(reply.number), exc))
        self.output.put(reply.number, delivery)

    def _convert(self, reply: Reply) -> Delivery:
        slot, payload = reply.slot, reply.payload
        region = payload if slot is None else self.ring.lease(slot)
        assert region is not None  # a reply without a slot carries its batch
        reader = batch_reader(region, self.device.wrap)
        batch, copy = self.device.convert(reader.build(region))
        if copy is not None and slot is not None:
            self.ring.track_copy(slot, functools.partial(self.device.wait, copy))
        in_slot = slot is not None and copy is None and reader.arrays > 0
        return Delivery(batch, copy, slot if in_slot else None,
                        len(region) if reply.overflowed else 0, reader.nbytes,
                        skipped=reply.skipped, noted=reply.noted)

    def _handed(self, number: int, delivery: Delivery) -> object:
        if delivery.payload_bytes:
            self._overflowed(self.name(number), delivery.payload_bytes)
        if delivery.slot is not None and not self.ring.keep_in_place(delivery.slot):
            return self._copied_out(delivery.batch)
        return super()._handed(number, delivery)

    def _copied_out(self, batch: object) -> object:
        n_slots = self.ring.active
        self._warn_once("copy-out", (
            f"the consumer holds {n_slots - 1} earlier batches of a ring of {n_slots} "
            "slots, so handing over this one in place would leave the workers no free slot: "
            "batches are copied out of the ring instead. To stay zero-copy, keep copies of what "
            "you store across steps (batch.clone() or .copy(): a metric's targets, a list of "
            "outputs), or raise buffer (prefetch_factor) above the batches you hold; see "
            "docs/reference.md, 'Keeping batches'"))
        self.stats.copy_out_count += 1
        copied = map_arrays(batch, _copy_array, _array_types())
        return self.device.hand_over(copied, None)

    def _overflowed(self, batch: str, payload_bytes: int) -> None:
        """Count it, keep the slot size that fits every batch so far, and warn at the first."""
        stats = self.stats
        stats.overflow_count += 1
        if payload_bytes <= stats.largest_overflow_bytes:
            return
        stats.largest_overflow_bytes = payload_bytes
        if stats.suggested_slot_bytes is None or payload_bytes > stats.suggested_slot_bytes:
            stats.suggested_slot_bytes = slot_bytes_for(payload_bytes)
        self._warn_once("overflow", (
            f"{batch} needed {payload_bytes:,} bytes but slot_bytes is "
            f"{self.ring.spec.slot_bytes:,}: it came through the overflow path, with a copy, as "
            "will any batch larger than a slot (this warning is not repeated). Pass "
            f"slot_bytes={stats.suggested_slot_bytes} or more; the loader's "
            ".stats.suggested_slot_bytes follows the largest batch so far, and "
            ".stats.overflow_count counts them"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_user(message)


def _conversion_failed(batch: str, exc: Exception) -> Callable[[], ShmSeqError]:
    """What makes the consumer's error. The failure's traceback travels as text: its frames
    (and the frames that called them) hold the slot's views, and the delivery itself."""
    text = "".join(traceback.format_exception(exc))
    exc.__traceback__ = None
    return functools.partial(_raised_in_conversion, batch, exc, text)


def _raised_in_conversion(batch: str, exc: Exception, text: str) -> ShmSeqError:
    error = ShmSeqError(f"converting {batch} failed: {type(exc).__name__}: {exc}\n\n"
                        f"Conversion traceback:\n{text}")
    error.__cause__ = exc
    return error


def _array_types() -> tuple[type, ...]:
    import sys
    torch = sys.modules.get("torch")
    return (np.ndarray, torch.Tensor) if torch is not None else (np.ndarray,)


def _copy_array(array: ArrayOrTensor) -> ArrayOrTensor:
    return array.copy() if isinstance(array, np.ndarray) else array.clone()
