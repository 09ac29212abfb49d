"""A front end's place in one pass of a pipeline: which batch comes next, its number, and
where the pass ends.

``Cursor(pipeline, epoch, position)`` opens the pass at ``position`` (the workers start on
it at once); ``next(cursor)`` is its next batch, in order, until ``StopIteration`` past the
last. A front end that words failures its own way, or hands batches over as they come
(torch's ``in_order=False``), takes the deliveries (``next_delivery``) and hands each over
itself (``hand_over``). The numbers the pipeline gives batches, and the batches handed over
ahead of their turn, are the cursor's alone: no front end counts them.
"""
from __future__ import annotations

from typing import Iterable, Protocol

from ..common.protocol import Delivery, Plan


PAST_THE_END = Delivery(None, ended=True)  # what a pass has past its last batch


class Consumer(Protocol):
    """What a cursor asks of its pipeline (``Pipeline``), from the consumer's thread."""
    plan: Plan

    def open(self, epoch: int, position: int = 0, batches: Iterable | None = None,
             first_worker: int = 0) -> int: ...

    def take(self, number: int, epoch: int, position: int) -> object: ...

    def receive(self, number: int, epoch: int, position: int) -> Delivery: ...

    def receive_any(self, first_number: int, epoch: int,
                    position: int) -> tuple[int, Delivery]: ...

    def hand_over(self, number: int, delivery: Delivery) -> object: ...

    def ended_past(self, number: int) -> list[Delivery]: ...

    def release(self, epoch: int, position: int) -> None: ...


class Cursor:
    """One pass (``epoch``) read from ``position`` on; ``batches``: the plan's for it, when the
    plan draws them as it goes (a sampler's iterator); ``first_worker``: with batches dealt in
    turn, the worker that builds the first (a resumed pass's: the one that was next)."""

    def __init__(self, pipeline: Consumer, epoch: int, position: int = 0,
                 batches: Iterable | None = None, first_worker: int = 0) -> None:
        self._pipeline = pipeline
        self.epoch = epoch
        self.position = position  # the first batch of the pass not handed over yet
        self._zero = pipeline.open(epoch, position, batches, first_worker) - position  # the
        # number of batch 0
        self._ahead: set[int] = set()  # positions handed over before their turn

    def __iter__(self) -> Cursor:
        return self

    def __next__(self) -> object:
        """The next batch in order (a worker's exception raised in its place)."""
        if self._ahead:
            self._skip_ahead()
        batch = self._pipeline.take(self._zero + self.position, self.epoch, self.position)
        if batch is PAST_THE_END:
            raise StopIteration
        self.position += 1
        return batch

    def next_delivery(self, in_order: bool = True) -> tuple[int, Delivery]:
        """The next batch's delivery and number, not handed over yet: the next in order, or
        (``in_order=False``) whichever of the rest came first."""
        self._check_more()
        number = self._zero + self.position
        if in_order:
            delivery = self._pipeline.receive(number, self.epoch, self.position)
            self.position += 1
            return number, delivery
        number, delivery = self._pipeline.receive_any(number, self.epoch, self.position)
        self._ahead.add(number - self._zero)
        self._pipeline.release(self.epoch, self.position)
        return number, delivery

    def ahead(self) -> frozenset[int]:
        """The positions handed over before their turn, past ``position``."""
        return frozenset(self._ahead)

    def hand_over(self, number: int, delivery: Delivery) -> object:
        """The batch of a delivery ``next_delivery`` gave, as the consumer gets it."""
        return self._pipeline.hand_over(number, delivery)

    def ended_past_the_end(self) -> list[Delivery]:
        """Once the pass has ended: its workers' ended streams that came after its last batch
        (what those workers noted of their state), each once."""
        return self._pipeline.ended_past(self._zero + self.position)

    def _check_more(self) -> None:
        """Past the batches handed over ahead of their turn; ``StopIteration`` past the last."""
        self._skip_ahead()
        if self._pipeline.plan.batch(self.epoch, self.position) is None:
            raise StopIteration

    def _skip_ahead(self) -> None:
        while self.position in self._ahead:
            self._ahead.remove(self.position)
            self.position += 1
