"""Where a ``shmseq.torch.DataLoader`` stopped, as a plain dict, and how a pass resumes there.

A pass's order is drawn from random generators as its sampler is first read: torch's global
one (a ``RandomSampler`` without a generator seeds its own from it), the sampler's own
``generator``, the loader's. ``PassStart`` notes their states just before that first read;
with the batches handed over since (``num_yielded``) that is where the pass stands, whatever
the workers (their number does not change which samples form a batch). A resumed pass sets
the generators back to those states, draws the pass again, and skips the indices of the
batches handed over before (no batch is built for them); then torch's global generator gets
the state it had before the resume, which the training loop's own checkpoint restores.
Generators given to the samplers are left where the uninterrupted pass left them.

A sampler (or batch sampler) with ``state_dict()``/``load_state_dict()`` has its state noted
with the others, and loaded before the pass is drawn again; one with ``set_epoch`` (torch's
``DistributedSampler``) has its epoch noted, and set again: a trainer that resumes sets it
after it made the iterator, or not at all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler

from .sampler_state import is_stateful, keeps_epoch, torch_state_of, torch_state_text
from .torch_dataset_state import empty_record, has_state
from .torch_spread import Spread

VERSION = 2


def _encoded(generator: torch.Generator | None) -> str:
    """A generator's state (None: torch's global one's) as text."""
    return torch_state_text(torch.get_rng_state() if generator is None else
                            generator.get_state())


def generators_of(*owners: object) -> list[torch.Generator]:
    """The generators the loader, its sampler and batch sampler (and a batch sampler's sampler)
    draw from, each once."""
    found: dict[int, torch.Generator] = {}
    for owner in owners:
        for holder in (owner, getattr(owner, "sampler", None)):
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator):
                found.setdefault(id(generator), generator)
    return list(found.values())


class Samplers:
    """The index sampler, and the sampler it batches: which keeps a state of its own, which
    draws by epoch (``set_epoch``)."""

    def __init__(self, index_sampler: object) -> None:
        holders: tuple[Any, ...] = (index_sampler, getattr(index_sampler, "sampler", None))
        self.stateful: Any = next(filter(is_stateful, holders), None)
        self.by_epoch: Any = next(filter(keeps_epoch, holders), None)

    def state(self) -> dict:
        return {"sampler": None if self.stateful is None else self.stateful.state_dict(),
                "epoch": None if self.by_epoch is None else self.by_epoch.epoch}

    def restore(self, state: dict) -> None:
        if self.stateful is not None and state.get("sampler") is not None:
            self.stateful.load_state_dict(state["sampler"])
        if self.by_epoch is not None and state.get("epoch") is not None:
            self.by_epoch.set_epoch(state["epoch"])


def draws_now(generators: list[torch.Generator], samplers: Samplers) -> dict:
    """The states a pass is drawn from (JSON-serialisable)."""
    return {"torch": _encoded(None), "generators": [_encoded(g) for g in generators],
            **samplers.state()}


def restore_generators(generators: list[torch.Generator], states: list[str]) -> None:
    if len(states) != len(generators):
        raise ValueError(f"the state names {len(states)} random generators of the samplers, this "
                         f"loader has {len(generators)}: build the loader as the saved one was")
    for generator, state in zip(generators, states):
        generator.set_state(torch_state_of(state))


class PassStart:
    """The index sampler's iterator, read through: the generators' states are noted just
    before its first item is drawn. Holds the generators only (not the loader: the pipeline
    holds this iterator, and nothing in it may refer back to the loader)."""

    def __init__(self, items: Iterator, generators: list[torch.Generator], samplers: Samplers,
                 states: dict | None = None) -> None:
        self._items = items
        self._generators = generators
        self._samplers = samplers
        self.states = states  # noted at the first item (or given: a resumed pass's)

    def __iter__(self) -> PassStart:
        return self

    def __next__(self) -> Any:
        if self.states is None:
            self.states = draws_now(self._generators, self._samplers)
        return next(self._items)


@contextlib.contextmanager
def drawn_as_saved(generators: list[torch.Generator], states: dict,
                   samplers: Samplers) -> Iterator[None]:
    """Inside: the generators and samplers as they were when the saved pass was drawn. After:
    torch's global generator as it was before."""
    before = torch.get_rng_state()
    torch.set_rng_state(torch_state_of(states["torch"]))
    restore_generators(generators, states["generators"])
    samplers.restore(states)
    try:
        yield
    finally:
        torch.set_rng_state(before)


@contextlib.contextmanager
def kept_torch_rng(keep: bool = True) -> Iterator[None]:
    """Torch's global generator as it was before, after (``keep``): a resumed iterator's own
    draws (its base seed) were made before the checkpoint the training loop restored."""
    before = torch.get_rng_state() if keep else None
    try:
        yield
    finally:
        if before is not None:
            torch.set_rng_state(before)


def passed_over(index_sampler: Iterable, count: int, also: frozenset[int]) -> Iterator:
    """The index sampler's pass past its first ``count`` items and those at positions ``also``,
    its next item drawn now. A torch ``BatchSampler`` chunks its sampler's items in order, so
    its first ``count`` batches are passed over as their samples, no batch made of them."""
    if type(index_sampler) is BatchSampler and not also:
        size = index_sampler.batch_size
        rest = itertools.islice(iter(index_sampler.sampler), count * size, None)
        return skipped(iter(BatchSampler(rest, size, index_sampler.drop_last)), 0)
    return skipped(iter(index_sampler), count, also)


def skipped(items: Iterator, count: int, also: frozenset[int] = frozenset()) -> Iterator:
    """``items`` past its first ``count`` and those at positions ``also``, its next one drawn
    now (so that the draw happens where the caller has set the generators)."""
    rest = (item for position, item in enumerate(items)
            if position >= count and position not in also)
    try:
        first = next(rest)
    except StopIteration:
        return iter(())
    return itertools.chain((first,), rest)


def loader_state(began: bool, num_yielded: int, finished: bool, base_seed: int | None,
                 pass_states: dict | None, ahead: list[int], now: dict, datasets: dict) -> dict:
    """The state ``DataLoader.state_dict()`` gives: whether an iterator began a pass, where the
    pass stands (``pass_states``: None until its first batch is drawn; ``ahead``: batches
    handed over before their turn), the generators and samplers as they are ``now`` (what a
    resume between passes draws the next pass from), and where each worker's dataset stands
    (``WorkerRecords.state``)."""
    return {"version": VERSION, "began": began, "num_yielded": num_yielded, "finished": finished,
            "base_seed": base_seed, "pass": pass_states, "ahead": ahead, "now": now, **datasets}


def restore_now(state: dict, generators: list[torch.Generator], samplers: Samplers,
                mid_pass: bool) -> None:
    """At ``load_state_dict``: the samplers' generators as they were when the state was taken;
    between passes also torch's and the samplers' own states, which the next pass is drawn
    from as the uninterrupted run drew it (a pass resumed mid-way draws from its start's)."""
    restore_generators(generators, state["now"]["generators"])
    if not mid_pass:
        torch.set_rng_state(torch_state_of(state["now"]["torch"]))
        samplers.restore(state["now"])


class WorkerRecords:
    """Where each worker's dataset stands, as of the batches handed over: its latest record
    (``torch_dataset_state``) and its batches handed over in the pass, from the notes that come
    with them; and the worker whose turn is next. Kept as torchdata keeps its workers'
    snapshots (``_snapshot``, ``_worker_snapshots``, ``worker_<id>``): code that reads a
    dataset's state there finds it. Without workers, the one record is taken when asked."""

    def __init__(self, num_workers: int, iterable: bool, loaded: dict | None = None,
                 take: Callable[[], dict] | None = None) -> None:
        self.num_workers = num_workers
        self.take = take  # without workers: the record as it is now
        records = None if loaded is None else records_in(loaded)
        self.records: dict[int, dict] = records or {
            worker: empty_record(worker, iterable) for worker in range(max(num_workers, 1))}
        self.next_worker = 0 if loaded is None else loaded.get("next_worker", 0)

    def noted(self, note: object) -> None:
        """A batch handed over (or a worker's end of stream met), with its worker's note
        (``Fetcher.pop_state``; None: nothing to keep). A record is replaced, never changed:
        a state given before stays as it was."""
        if not isinstance(note, dict):
            return
        worker = note["worker_id"]
        record = dict(self.records[worker])
        if note["snapshot"] is not None:
            record.update(note["snapshot"], fetched=note["fetched"])
        if not note["ended"]:
            record["handed"] = note["fetched"]
            self.next_worker = (worker + 1) % max(self.num_workers, 1)
        self.records[worker] = record

    def next_pass(self) -> WorkerRecords:
        """The records a new pass starts from when the datasets carry their states over
        (persistent workers, or none): their datasets' states, no stream's."""
        following = WorkerRecords(self.num_workers, False)
        following.records = {worker: {**record, "fetched": 0, "handed": 0, "fetcher_state":
                                      record["fetcher_state"] and {"dataset_iter_state": None,
                                                                   "fetcher_ended": False}}
                             for worker, record in self.records.items()}
        return following

    def state(self) -> dict:
        if self.num_workers == 0:
            return {"num_workers": 0, **(self.records[0] if self.take is None else self.take())}
        return {"num_workers": self.num_workers, "next_worker": self.next_worker,
                "_snapshot": {"_worker_snapshots": {
                    f"worker_{worker}": record for worker, record in self.records.items()}}}


def records_in(state: dict) -> dict[int, dict]:
    """The workers' records a state holds, by worker id (one, saved without workers)."""
    if "_snapshot" in state:
        return {record["worker_id"]: record
                for record in state["_snapshot"]["_worker_snapshots"].values()}
    return {0: {key: state[key] for key in ("dataset_state", "fetcher_state", "fetched",
                                            "handed")} | {"worker_id": 0}}


def check_workers(state: dict, num_workers: int, iterable: bool) -> None:
    """A state resumes with another number of workers only for a map-style dataset without a
    state of its own: a stream is split among the workers, and a dataset's state (its
    randomness, say) is one worker's."""
    saved = state["num_workers"]
    stateful = any(has_state(record) for record in records_in(state).values())
    if saved == num_workers or not (stateful or iterable and state["num_yielded"]):
        return
    why = ("its stream is split among the workers" if iterable else
           "each worker's dataset has a state of its own")
    raise ValueError(f"the state was saved with num_workers={saved}, this loader has "
                     f"num_workers={num_workers}, and the dataset's {why}: resume with "
                     f"num_workers={saved}")


@dataclasses.dataclass
class PassRecord:
    """Where an iterator's pass stands, kept by its loader: a loop left with ``break`` drops
    the iterator, and ``state_dict()`` must still describe its pass."""
    start: PassStart
    base_seed: int
    workers: WorkerRecords
    spread: Spread | None = None  # a DistributedSampler's pass, as all the ranks read it
    num_yielded: int = 0
    finished: bool = False
    ahead: list[int] = dataclasses.field(default_factory=list)  # handed before their turn

    def state(self, now: dict) -> dict:
        distributed = None if self.spread is None else self.spread.state(self.num_yielded)
        return loader_state(True, self.num_yielded, self.finished, self.base_seed,
                            self.start.states, self.ahead, now,
                            {**self.workers.state(), "distributed": distributed})
