"""How remote requests are made and counted (``shmseq.remote`` makes them): ``RemotePolicy``,
its fit to a sequence's timeout, and ``Counters``. Apart from the requests, since a sequence
and its workers choose and check a policy without making any.

``policy`` (a ``RemotePolicy``; by default ``RemotePolicy()``): each attempt may take
``timeout`` seconds (30; on fsspec's asynchronous file systems: HTTP, S3, GCS, Azure), and a
transient failure is tried again after a back-off drawn between half and all of
``backoff * 2**(retry - 1)`` seconds, at most ``max_backoff`` (0.5 s doubling to 10 s), up to
``attempts`` attempts in all (5: 3.75 to 7.5 s of back-off before giving up; 157.5 s at worst,
``worst_case()``). The jitter comes from the system's random source, so workers and ranks
seeded alike do not retry in step. ``deadline`` (None by default) bounds one request, its
attempts and back-offs together (a fetch: each of its ranges): the last attempt is cut to what
is left of it, and no back-off runs past it. ``fit_to_timeout`` gives a sequence's policy the
deadline its batch timeout leaves, so that a server that stalls is reported by ``shmseq.remote``,
naming its URL, before the sequence gives up on the batch.

``counters`` (a ``Counters``) adds up what the calls did: requests (every attempt), bytes
received, retries, and the seconds spent waiting in them (back-offs included). A ``ShardWorker``
keeps one, and its ``pop_counts()`` hands the counts to the worker loop, which sends them to the
consumer with each batch: ``seq.stats.remote_requests``, ``remote_bytes``, ``remote_retries``,
``remote_wait_s``.
"""
from __future__ import annotations

import dataclasses
import numbers
import random
import threading
from dataclasses import dataclass

from .checks import check_int, check_timeout

SEQUENCE_SHARE = 3  # a sequence gives one request, its retries included, this part of its timeout
_jitter = random.SystemRandom()


@dataclass(frozen=True)
class RemotePolicy:
    """How remote requests are made (see the module's docstring): ``attempts`` in all, each
    within ``timeout`` seconds (None: as long as it takes), a retry after a back-off doubling
    from ``backoff`` seconds up to ``max_backoff``, and all of them within ``deadline`` seconds
    of the first attempt (None: no bound but theirs)."""
    attempts: int = 5
    timeout: float | None = 30.0
    backoff: float = 0.5
    max_backoff: float = 10.0
    deadline: float | None = None

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, 1)
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        for name in ("backoff", "max_backoff"):
            _check_seconds(name, getattr(self, name), ">= 0")
        if self.deadline is not None:
            _check_seconds("deadline", self.deadline, "> 0, or None for no deadline")

    def _ceiling(self, retry: int) -> float:
        return min(self.max_backoff, self.backoff * 2 ** (retry - 1))

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        ceiling = self._ceiling(retry)
        return _jitter.uniform(ceiling / 2, ceiling)

    def worst_case(self) -> float | None:
        """The longest one request may take, its attempts and back-offs included (None: no
        bound): what a caller that waits for it must allow."""
        if self.timeout is None:
            return self.deadline
        longest = self.attempts * self.timeout + sum(map(self._ceiling, range(1, self.attempts)))
        return longest if self.deadline is None else min(longest, self.deadline)


def _check_seconds(name: str, value: object, wanted: str) -> None:
    """Raise naming ``name`` unless ``value`` is a number of seconds ``wanted`` says (">= 0",
    "> 0, ...": its first word is the bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds {wanted}, got {value!r} "
                        f"({type(value).__name__})")
    seconds = float(value)
    if not (seconds >= 0 if wanted.startswith(">=") else seconds > 0):  # NaN is neither
        raise ValueError(f"{name} must be a number of seconds {wanted}, got {value!r}")


DEFAULT_POLICY = RemotePolicy()


def fit_to_timeout(policy: RemotePolicy | None, timeout: float | None) -> RemotePolicy:
    """The policy of a sequence that waits ``timeout`` seconds for a batch (None: as long as it
    takes). A request, its retries included, must end within a third of it: a server that
    stalls is then reported here, naming its URL, the attempts and the time, before the
    sequence gives up on the batch with a timeout that cannot name them. A third, because a
    worker may wait for another process's fetch of a shard before it fetches the shard itself
    (two requests in a row), and the rest of the batch needs time too.

    ``policy`` None (the default) gets that ``deadline``. A policy given that may take longer
    is refused, naming what would fit: it was chosen, so it is not cut behind its chooser's
    back, and a sequence that would time out before its own remote errors is a mistake to
    catch before the run rather than at its first stall."""
    if timeout is None:
        return policy or DEFAULT_POLICY
    budget = timeout / SEQUENCE_SHARE
    if policy is None:
        return dataclasses.replace(DEFAULT_POLICY, deadline=budget)
    worst = policy.worst_case()
    if worst is not None and worst <= budget:
        return policy
    takes = "as long as it takes" if worst is None else f"up to {worst:g} s"
    longer = "" if worst is None else f" (at least {worst * SEQUENCE_SHARE:g} s)"
    raise ValueError(
        f"remote={policy!r} may wait {takes} for one request (its attempts, their timeout and "
        f"back-offs), longer than {budget:g} s, a third of the sequence's timeout={timeout:g} "
        "s: a server that stalls would not be reported, naming its URL, before the batch times "
        f"out. Give the policy deadline={budget:g} (its attempts end there), or fewer attempts "
        f"or a shorter timeout, or give the sequence a longer timeout={longer}")


class Counters:
    """What remote calls did, added up (thread-safe): ``requests`` (attempts), ``bytes``
    received, ``retries``, ``wait_s`` (seconds spent in the calls). A copy sent to another
    process starts at zero: each process counts its own."""

    FIELDS: tuple[str, ...] = ("requests", "bytes", "retries", "wait_s")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def __reduce__(self) -> tuple:
        return Counters, ()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def take(self) -> dict:
        """The counts so far, and start again from zero."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self.FIELDS, 0)
        return counts

    def __repr__(self) -> str:
        return f"Counters({', '.join(f'{k}={v}' for k, v in self.snapshot().items())})"
