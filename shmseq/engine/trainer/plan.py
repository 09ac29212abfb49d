"""Epoch index plans: which sample indices go into which batch, epoch after epoch.

Two plans with one contract (``protocol.Plan``: who calls what, and when):

* ``EpochPlan``: a pure function of (indices, batch_size, shuffle, seed, last_batch,
  rank, world_size, epoch), so the pipeline, ``start_test()`` and a resumed run all
  see exactly the same batches, and any epoch can be planned ahead of the consumer.
  Ranks not given are read from ``torch.distributed`` when an epoch starts, not when
  the plan is made: a loader may be built before the process group exists.
* ``SamplerPlan``: batches drawn from a user's batch sampler, a new pass each time the
  consumer opens an epoch (after its ``set_epoch``), never ahead of it, and within the pass
  only as the dispatcher needs them (a sampler may never end).

``BatchStream`` walks a plan for the dispatcher, as a node of ``torchdata.nodes`` does
(``next``, ``state``, ``reset`` from a state), numbering batches in the order
they are dispatched, across epochs.
"""
from __future__ import annotations

import collections
import math
import numbers
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Sequence, Sized

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from ..common.protocol import Plan

LAST_BATCH_POLICIES = ("keep", "discard", "rollover")


def as_index_array(dset_size: ArrayLike) -> np.ndarray:
    """The dataset's sample indices from an int size or a 1-D index array."""
    if isinstance(dset_size, numbers.Integral) and not isinstance(dset_size, bool):
        if dset_size < 0:
            raise ValueError(f"dset_size must be >= 0, got {dset_size}; "
                             "pass the number of samples or a 1-D array of sample indices")
        try:
            return np.arange(int(dset_size), dtype=np.int64)
        except (MemoryError, ValueError, OverflowError):
            raise ValueError(f"dset_size={dset_size:,} is more samples than can be indexed: "
                             f"their int64 indices would take {8 * dset_size:,} bytes") from None
    if np.ndim(dset_size) == 0:
        raise TypeError(f"dset_size must be an int (the number of samples) or a 1-D array of "
                        f"sample indices, got {type(dset_size).__name__} {dset_size!r}")
    try:
        indices = np.asarray(dset_size)
    except Exception as exc:  # noqa: BLE001 - reported with the argument's name
        raise TypeError(f"dset_size must be an int or a 1-D array of indices, "
                        f"got {type(dset_size).__name__}") from exc
    if indices.ndim != 1:
        raise ValueError(f"dset_size as an index array must be 1-D, got shape {indices.shape}")
    if indices.size and not np.issubdtype(indices.dtype, np.integer):
        raise TypeError(f"dset_size as an index array must hold integers, got dtype {indices.dtype}")
    return indices.astype(np.int64, copy=True)


def distributed_ranks(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): those given win; else torch.distributed's, once it is initialized;
    else one rank."""
    dist = process_group()
    if dist is not None and (rank is None or world_size is None):
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    rank, world_size = (0 if rank is None else rank), (1 if world_size is None else world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def process_group() -> ModuleType | None:
    """``torch.distributed`` when a process group is up (torch is never imported for this)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


class EpochPlan:
    """Cuts each epoch's sample order into batches.

    Shuffling draws from ``default_rng([seed, epoch])``. With ``world_size > 1`` the
    epoch's order is dealt to the ranks (``order[rank::world_size]``), padded by
    wrapping so that every rank gets as many samples (or cut, with
    ``last_batch='discard'``), as ``torch.utils.data.DistributedSampler`` does.
    ``last_batch='rollover'`` (MXNet's) carries a short last batch into the next
    epoch: the batches are then consecutive chunks of the endless concatenation of
    the epochs' orders, so ``start(e) = floor(e * n / batch_size)``.

    ``rank``/``world_size`` left as None follow ``torch.distributed`` (see ``refresh``). A
    shuffled plan dealt to ranks needs one seed on every rank: unless ``seed_given``, the
    ranks take rank 0's when the first such epoch starts (one broadcast, which every rank
    reaches as it starts iterating).
    """

    def __init__(self, indices: np.ndarray, batch_size: int, *, shuffle: bool, seed: int,
                 last_batch: str = "keep", rank: int | None = None, world_size: int | None = None,
                 seed_given: bool = True) -> None:
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {', '.join(map(repr, LAST_BATCH_POLICIES))}, "
                             f"got {last_batch!r}")
        self.indices = indices
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.last_batch = last_batch
        self._asked = (rank, world_size)
        self.rank, self.world_size = distributed_ranks(rank, world_size)
        self.seed_settled = seed_given or not shuffle
        self.version = 0
        self._planned: dict[tuple[int, int], list[np.ndarray]] = {}  # (version, epoch) -> batches

    def refresh(self) -> None:
        """Follow torch.distributed's rank and world size where none were given."""
        ranks = distributed_ranks(*self._asked)
        if ranks != (self.rank, self.world_size):
            self.rank, self.world_size = ranks
            self.version += 1

    def settle_seed(self, seed: int) -> None:
        """Use ``seed`` from now on, as every rank does (a restored state's, say)."""
        if seed != self.seed:
            self.seed = seed
            self.version += 1
        self.seed_settled = True

    def _agree_on_seed(self) -> None:
        dist = process_group()
        if dist is None:
            raise ValueError(
                f"seed must be given to shuffle for world_size={self.world_size} without "
                "torch.distributed: every rank must shuffle alike for their shares to be disjoint")
        shared = [self.seed]
        dist.broadcast_object_list(shared, src=0)
        self.settle_seed(int(shared[0]))

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank sees in an epoch."""
        total, ranks = len(self.indices), self.world_size
        return total // ranks if self.last_batch == "discard" else -(-total // ranks)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's sample order for ``epoch``."""
        order = self.indices
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        if self.world_size == 1 or not len(order):
            return order
        dealt = np.resize(order, self.samples_per_epoch * self.world_size)  # wraps, or cuts
        return dealt[self.rank::self.world_size]

    def length(self, epoch: int) -> int:
        n, size = self.samples_per_epoch, self.batch_size
        if self.last_batch == "rollover":
            return (epoch + 1) * n // size - epoch * n // size
        return n // size if self.last_batch == "discard" else -(-n // size)

    def start(self, epoch: int) -> int:
        if self.last_batch == "rollover":
            return epoch * self.samples_per_epoch // self.batch_size
        return epoch * self.length(0)

    def open(self, epoch: int, batches: Iterable | None = None) -> None:
        """Nothing to draw (any epoch can be rebuilt, the same however often); the ranks are
        read again, and agree on a seed the first time they shuffle."""
        if batches is not None:
            raise ValueError("an epoch plan makes its own batches: it takes none")
        self.refresh()
        if self.world_size > 1 and not self.seed_settled:
            self._agree_on_seed()

    def is_open(self, epoch: int) -> bool:
        return True

    def batch(self, epoch: int, position: int) -> np.ndarray | None:
        """Batch ``position`` of ``epoch``; None past its last. The two epochs asked for last
        (the consumer's, and the dispatcher's running ahead) are kept planned."""
        key = (self.version, epoch)
        batches = self._planned.get(key)
        if batches is None:
            if len(self._planned) >= 2:
                del self._planned[next(iter(self._planned))]
            batches = self._planned[key] = self.batches(epoch)
        return batches[position] if position < len(batches) else None

    def release(self, epoch: int, position: int) -> None:
        """Nothing to forget: an epoch's batches are made again whenever asked for."""

    def end(self, epoch: int, position: int) -> None:
        raise ValueError("an epoch plan's epochs have the length it planned: only a stream's "
                         "pass ends where its workers' streams end")

    def set_epoch(self, epoch: int) -> None:
        """Nothing to tell: the epoch is an argument of every method."""

    def has_batches(self) -> bool:
        n = self.samples_per_epoch
        return n >= self.batch_size if self.last_batch == "discard" else n > 0

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches, each a contiguous int64 array of sample indices."""
        size = self.batch_size
        if self.last_batch != "rollover":
            order = self.order(epoch)
            return [np.ascontiguousarray(order[at:at + size])
                    for at in range(0, self.length(epoch) * size, size)]
        first = self.start(epoch) * size
        samples = self._stream_slice(first, first + self.length(epoch) * size)
        return [samples[at:at + size] for at in range(0, len(samples), size)]

    def _stream_slice(self, begin: int, end: int) -> np.ndarray:
        """Samples ``begin:end`` of the concatenated epoch orders (rollover)."""
        n = self.samples_per_epoch
        parts = [self.order(epoch)[max(begin - epoch * n, 0):end - epoch * n]
                 for epoch in range(begin // n, -(-end // n))]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def carried(self, epoch: int) -> list[int]:
        """The samples ``epoch`` inherits from the epochs before it (rollover), for a state."""
        if self.last_batch != "rollover" or not self.samples_per_epoch:
            return []
        carried = epoch * self.samples_per_epoch - self.start(epoch) * self.batch_size
        return self.batches(epoch)[0][:carried].tolist() if carried and self.length(epoch) else []


def as_batch(indices: Sequence[Any]) -> np.ndarray | list[np.ndarray]:
    """A batch sampler's item as indices: one int64 array, or a list of them (multi-shard)."""
    if len(indices) and not isinstance(indices[0], numbers.Integral):
        return [np.asarray(part, dtype=np.int64) for part in indices]
    return np.asarray(indices, dtype=np.int64)


class SamplerPlan:
    """Batches from a user's batch sampler (any iterable of index lists), a new pass each time
    the consumer opens an epoch: a sampler told ``set_epoch(e)`` before epoch ``e`` starts is
    drawn after it, as in a serial loop. Within the pass, batches are drawn as the dispatcher
    asks for them, and forgotten once the consumer has them: a sampler may never end.

    ``as_task`` makes each item of the sampler what a worker is sent (``as_batch``: int64
    indices); ``passes(epoch)``, when given, makes each epoch's pass instead of
    ``iter(batch_sampler)`` (a front end's that notes what the pass is drawn from, for its
    state). The sampler decides the batches' size, order and last batch itself, and deals
    them to ranks if it does."""

    batch_size: int | None = None
    seed: int | None = None
    last_batch: str | None = None
    rank, world_size = 0, 1

    def __init__(self, batch_sampler: Iterable, as_task: Callable[[Any], object] = as_batch,
                 passes: Callable[[int], Iterable] | None = None) -> None:
        self.batch_sampler = batch_sampler
        self._as_task = as_task
        self._passes = passes
        self._epoch: int | None = None
        self._pass: Iterator | None = None  # the open pass's iterator, until it ends
        self._drawn: collections.deque[object] = collections.deque()
        self._first = 0                 # the position of _drawn[0]
        self.version = 0

    def open(self, epoch: int, batches: Iterable | None = None) -> None:
        """A new pass of the sampler (or of ``batches``, an iterator of the sampler's items)."""
        if batches is None:
            batches = self.batch_sampler if self._passes is None else self._passes(epoch)
        self._pass = iter(batches)
        self._epoch, self._first = epoch, 0
        self._drawn.clear()
        self.version += 1

    def refresh(self) -> None:
        """The sampler deals to ranks itself, if it does."""

    def settle_seed(self, seed: int) -> None:
        """The sampler's randomness is its own."""

    def carried(self, epoch: int) -> list[int]:
        """Nothing: a pass is what the sampler gives."""
        return []

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the batch sampler and its sampler (a ``DistributedSampler``, say)."""
        told = set()
        for sampler in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch) and id(sampler) not in told:
                told.add(id(sampler))
                set_epoch(epoch)

    def is_open(self, epoch: int) -> bool:
        return epoch == self._epoch

    def has_batches(self) -> bool:
        return True  # known only once drawn: an empty pass simply yields nothing

    def batch(self, epoch: int, position: int) -> object | None:
        """Batch ``position`` of the open pass, drawn now if it was not yet; None past the end."""
        if epoch != self._epoch:
            raise ValueError(f"epoch {epoch} of the batch sampler is not open: a sampler is "
                             "drawn when the consumer starts its epoch")
        if position < self._first:
            raise ValueError(f"batch {position} of epoch {epoch} was already delivered")
        while self._pass is not None and position >= self._first + len(self._drawn):
            try:
                self._drawn.append(self._as_task(next(self._pass)))
            except StopIteration:
                self._pass = None
        at = position - self._first
        return self._drawn[at] if at < len(self._drawn) else None

    def release(self, epoch: int, position: int) -> None:
        """Forget the batches before ``position``: the consumer has them."""
        if epoch == self._epoch:
            while self._first < position and self._drawn:
                self._drawn.popleft()
                self._first += 1

    def end(self, epoch: int, position: int) -> None:
        """The open pass ends before ``position`` (its workers' streams ended)."""
        if epoch == self._epoch:
            self._pass = None
            while self._drawn and self._first + len(self._drawn) > position:
                self._drawn.pop()

    def length(self, epoch: int) -> int:
        if epoch == self._epoch and self._pass is None:
            return self._first + len(self._drawn)
        if isinstance(self.batch_sampler, Sized):
            try:
                return len(self.batch_sampler)
            except TypeError:
                pass
        raise TypeError(f"the batch sampler {type(self.batch_sampler).__name__} has no len(), "
                        "so neither has this loader before its epoch ends")


class Task(NamedTuple):
    """A batch as the dispatcher sends it: its ``number``, its indices, and its position in its
    epoch (which worker builds it, when batches go to the workers in turn)."""
    number: int
    indices: object
    position: int


class BatchStream:
    """The dispatcher's cursor: the plan's batches as ``(number, indices)``, epoch after epoch.

    ``number`` counts batches in the order they are dispatched, so that a consumer going back
    (``set_epoch``, ``load_state_dict``) restarts the cursor with fresh seqs, and whatever
    is still in flight from before is told apart and dropped. The cursor runs ahead into
    epochs the plan has open; ``open(epoch, position)`` tells it where the consumer is.
    """

    def __init__(self, plan: Plan, epoch: int = 0, position: int = 0) -> None:
        self.plan = plan
        self._next_number = 0
        self._segments: list[list[int]] = []  # [first number, epoch, first position, count] taken
        self.reset({"epoch": epoch, "position": position})

    def state(self) -> dict:
        """Where the next batch dispatched comes from."""
        return {"epoch": self._epoch, "position": self._position}

    def reset(self, state: dict) -> None:
        """Go on from ``state`` with fresh seqs; what was taken before is stale."""
        self.plan.refresh()
        self._version = self.plan.version
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._segments = []
        self._epoch_open = False

    def open(self, epoch: int, position: int, batches: Iterable | None = None) -> int:
        """The consumer starts ``epoch`` at ``position`` (the plan's ``batches`` for it, when
        given): the number that batch is dispatched with."""
        self.plan.open(epoch, batches)
        self._epoch_open = False  # the plan may have opened the stream's epoch
        number = self.number_of(epoch, position) if self._version == self.plan.version else None
        if number is None:
            self.reset({"epoch": epoch, "position": position})
            number = self._next_number
        self._segments = [s for s in self._segments if s[0] + s[3] > number]
        return number

    def name(self, number: int) -> str:
        """Batch ``number`` as messages call it, as the user counts: "batch 3 of epoch 1"."""
        for first, epoch, first_position, count in self._segments:
            if first <= number < first + count:
                return f"batch {first_position + number - first} of epoch {epoch}"
        return f"batch {number}"

    def number_of(self, epoch: int, position: int) -> int | None:
        """The number batch ``position`` of ``epoch`` was dispatched as; None if it was not."""
        for first, taken_epoch, first_position, count in self._segments:
            if taken_epoch == epoch and first_position <= position < first_position + count:
                return first + position - first_position
        return None

    def end_of(self, epoch: int) -> float:
        """The first number dispatched for an epoch after ``epoch`` (inf while none is): where
        the numbers of ``epoch``'s pass end."""
        return next((first for first, taken, _, _ in self._segments if taken > epoch), math.inf)

    def peek(self) -> Task | None:
        """The next task, left in the stream; None while the next batch's epoch is not open
        (a user's sampler waits for the consumer) or the plan has none. Whether it is open is
        asked once per epoch, and again after each ``open``: a batch costs one question."""
        while True:
            if not self._epoch_open:
                if not (self.plan.has_batches() and self.plan.is_open(self._epoch)):
                    return None
                self._epoch_open = True
            indices = self.plan.batch(self._epoch, self._position)
            if indices is not None:
                return Task(self._next_number, indices, self._position)
            self._epoch, self._position = self._epoch + 1, 0
            self._epoch_open = False

    def next(self) -> Task | None:
        """The next task, taken out of the stream (None as for ``peek``)."""
        item = self.peek()
        if item is not None:
            self.advance()
        return item

    def end_pass(self) -> None:
        """The pass being dispatched ends here: the batch ``peek()`` would give is not one."""
        self.plan.end(self._epoch, self._position)

    def advance(self) -> None:
        """Take the batch ``peek()`` just returned."""
        last = self._segments[-1] if self._segments else None
        if last and last[1] == self._epoch and last[0] + last[3] == self._next_number:
            last[3] += 1
        else:
            self._segments.append([self._next_number, self._epoch, self._position, 1])
        self._next_number += 1
        self._position += 1
