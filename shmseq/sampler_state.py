"""Where a user's sampler stood, as a plain dict, and how its pass is drawn again on a resume.

A pass's order is drawn from random generators as the batch sampler is first read: those its
sampler and it hold (torch's ``Generator``, numpy's ``Generator`` or ``RandomState``, as
shmseq's ``RandomSampler``), and torch's and numpy's global ones (a torch ``RandomSampler``
without a generator seeds its own from torch's; MXNet's shuffles with numpy's). A sampler with
``state_dict()``/``load_state_dict()`` keeps its own state, as torchdata's loader reads it, and
one with ``set_epoch`` (torch's ``DistributedSampler``) its epoch. ``SamplerPasses`` notes all of
them just before each pass is drawn. A state taken inside the pass drawn last (or at its last
batch) carries those notes: loaded, they are set again just before that pass is drawn again (the
plan then draws past the batches handed over, and builds none of them), then the global
generators get back the state they had, which the training loop's own checkpoint restores. A
state of an epoch not drawn yet (taken after the loop ended) carries the samplers as they are
then, and no global generator: the training loop's are its own.

torch is never imported here: a torch generator exists only where torch was.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import sys
from typing import Any, Iterable, Iterator

import numpy as np

_END = object()


def _torch() -> Any:
    """torch, when something imported it (None otherwise, or where it was made unimportable)."""
    return sys.modules.get("torch")


def jsonable(value: Any) -> Any:
    """``value`` (a numpy generator's state) with its arrays and numpy numbers as lists and
    Python numbers: what ``json`` writes, and what numpy's setters read back."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def _is_torch_generator(value: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Generator)


def _is_generator(value: object) -> bool:
    return isinstance(value, (np.random.Generator, np.random.RandomState)) or \
        _is_torch_generator(value)


def torch_state_text(state: Any) -> str:
    """A torch generator's state (a uint8 tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def torch_state_of(text: str) -> Any:
    """The uint8 tensor ``torch_state_text`` wrote."""
    return _torch().frombuffer(bytearray(base64.b64decode(text)), dtype=_torch().uint8)


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` saves and loads a state of its own (torchdata's ``Stateful``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def keeps_epoch(obj: object) -> bool:
    """Whether ``obj`` draws by epoch (``set_epoch``, as torch's ``DistributedSampler``)."""
    return callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None),
                                                                     int)


def generator_state(generator: Any) -> str | dict:
    """A generator's state, JSON-serialisable: base64 text for torch's, a dict for numpy's."""
    if isinstance(generator, np.random.Generator):
        return jsonable(generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        return jsonable(generator.get_state(legacy=False))
    return torch_state_text(generator.get_state())


def set_generator_state(generator: Any, state: Any) -> None:
    """Set ``generator`` to ``state`` (``generator_state``'s)."""
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.set_state(torch_state_of(str(state)))


def global_states() -> dict:
    """torch's (when loaded) and numpy's global generators' states."""
    torch = _torch()
    return {"torch": None if torch is None else torch_state_text(torch.get_rng_state()),
            "numpy": jsonable(np.random.get_state(legacy=False))}


def _set_globals(states: dict) -> None:
    torch = _torch()
    if torch is not None and states.get("torch") is not None:
        torch.set_rng_state(torch_state_of(states["torch"]))
    np.random.set_state(states["numpy"])


@contextlib.contextmanager
def globals_as(states: dict | None) -> Iterator[None]:
    """Inside: the global generators as ``states`` has them (None: as they are). After: as
    they were before, for the training loop."""
    if states is None:
        yield
        return
    before = global_states()
    _set_globals(states)
    try:
        yield
    finally:
        _set_globals(before)


class SamplerStates:
    """A batch sampler and the sampler it batches (``.sampler``, as torch's and shmseq's
    ``BatchSampler`` have it): the generators they hold, the state of those with
    ``state_dict()``, the epoch of those with ``set_epoch``. Looked up at each use: a sampler
    may make its generator only when first drawn."""

    def __init__(self, batch_sampler: Iterable) -> None:
        inner = getattr(batch_sampler, "sampler", None)
        self._holders = [batch_sampler] + ([] if inner is None or inner is batch_sampler else [inner])

    def generators(self) -> list:
        """The generators among the samplers' attributes, each once, in a fixed order."""
        found: dict[int, Any] = {}
        for holder in self._holders:
            for value in getattr(holder, "__dict__", {}).values():
                if _is_generator(value):
                    found.setdefault(id(value), value)
        return list(found.values())

    def _stateful(self) -> list:
        return [holder for holder in self._holders if is_stateful(holder)]

    def _by_epoch(self) -> list:
        return [holder for holder in self._holders if keeps_epoch(holder)]

    def now(self) -> dict:
        """Their states now (a sampler's own is copied: it may hand out the dict it keeps)."""
        return {"generators": [generator_state(g) for g in self.generators()],
                "samplers": [copy.deepcopy(h.state_dict()) for h in self._stateful()],
                "epochs": [h.epoch for h in self._by_epoch()]}

    def check(self, states: dict) -> None:
        """``states`` (``now()``'s) names as many of each as these samplers have."""
        for key, what, mine in (("generators", "random generator(s)", self.generators()),
                                ("samplers", "sampler(s) with state_dict()", self._stateful()),
                                ("epochs", "sampler(s) with set_epoch()", self._by_epoch())):
            if len(states[key]) != len(mine):
                raise ValueError(f"the state holds {len(states[key])} {what}, this loader's "
                                 f"samplers hold {len(mine)}: build the loader with the samplers "
                                 "of the one whose state it is")

    def restore(self, states: dict) -> None:
        """Set them to ``states`` (``now()``'s, checked by ``check``)."""
        for generator, state in zip(self.generators(), states["generators"]):
            set_generator_state(generator, state)
        for holder, state in zip(self._stateful(), states["samplers"]):
            holder.load_state_dict(state)
        for holder, epoch in zip(self._by_epoch(), states["epochs"]):
            holder.set_epoch(epoch)


class SamplerPasses:
    """Each pass of a batch sampler, with the states it was drawn from noted just before it is
    drawn; a loaded state's set again before the next pass is drawn. Holds the batch sampler
    only (not the loader: the plan holds ``draw``, and nothing it holds may refer back)."""

    def __init__(self, batch_sampler: Iterable) -> None:
        self.batch_sampler = batch_sampler
        self.samplers = SamplerStates(batch_sampler)
        self._drawn: tuple[int, dict] | None = None  # (epoch, the states) of the last pass drawn
        self._loaded: dict | None = None              # a loaded state's, for the next pass

    def draw(self, epoch: int) -> Iterator:
        """``epoch``'s pass, at the consumer's start of it: drawn at its first item (from a
        loaded state's samplers, if one was loaded since the last pass)."""
        loaded, self._loaded = self._loaded, None
        return self._pass(epoch, loaded)

    def _pass(self, epoch: int, loaded: dict | None) -> Iterator:
        """Runs at the first item asked for: the notes are taken (or set) there, and a loaded
        state's global generators are in place only while that first item is drawn (a torch
        ``RandomSampler`` seeds its own generator then), as in the saved run."""
        if loaded is not None:
            self.samplers.restore(loaded["samplers"])
        states = self.samplers.now() if loaded is None else loaded["samplers"]
        saved_globals = None if loaded is None else loaded["globals"]
        self._drawn = (epoch, {"samplers": states, "globals": saved_globals or global_states()})
        with globals_as(saved_globals):
            items = iter(self.batch_sampler)
            first = next(items, _END)
        if first is not _END:
            yield first
            yield from items

    def state(self, epoch: int, drawn: bool) -> dict:
        """What a state of ``epoch`` carries: the states its pass was drawn from, when it was
        (``drawn``: the state is inside it, or at its end); else the samplers as they are now,
        which draw it next (a loaded state's, until it is used)."""
        if self._loaded is not None:
            return self._loaded
        if drawn and self._drawn is not None and self._drawn[0] == epoch:
            return self._drawn[1]
        return {"samplers": self.samplers.now(), "globals": None}

    def load(self, state: dict) -> None:
        """Draw the next pass from ``state`` (``state()``'s), checked now, set when it is drawn."""
        self.samplers.check(state["samplers"])
        self._loaded = state
