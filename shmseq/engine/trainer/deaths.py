"""A worker process that ended unasked: how it is told (``WorkerDied``, with the batch it was
building, how it ended, and why it is not replaced), and, while ``restarts`` last, its
replacement, which builds its batches again: every batch still arrives once.

A worker told to leave (``resize``) that ended with no task open left as asked: no death.
"""
from __future__ import annotations

import signal
from multiprocessing.process import BaseProcess
from typing import Callable

import numpy as np

from ..common.errors import WorkerDied, warn_user
from ..common.protocol import Rebuild, Reply
from ..common.wire import framed
from .dispatch import Dispatch, FirstBatches, SlotDispatch
from .roster import Roster
from .stats import LoaderStats
from .worker_handle import JOIN_SECONDS, STARTING, WorkerHandle

Stage = FirstBatches | SlotDispatch


class Deaths:
    """Sees to the workers that die (``died``): ``restarts`` of them may be replaced."""

    def __init__(self, roster: Roster, dispatch: Dispatch, stats: LoaderStats,
                 restarts: int) -> None:
        self._roster = roster
        self._dispatch = dispatch
        self._stats = stats
        self._restarts = restarts
        self._killers: set[int] = set()  # batches a death was charged on once
        self._oom_kills = oom_kills()  # the kernel's count, as of the last death seen
        self.held: list[Reply] = []  # read when a death was raised: for the next exchange

    def pop_held(self) -> list[Reply]:
        held, self.held = self.held, []
        return held

    def died(self, handle: WorkerHandle, received: list[Reply], stage: Stage,
             receive: Callable[[WorkerHandle, list[Reply]], None]) -> None:
        """A worker process ended unasked: replace it, or raise how and on which batch. Its last
        replies (an init error explains more) are read first (``receive``)."""
        while self._roster.reading(handle):
            receive(handle, received)
        if handle.leaving and not handle.open:
            self._roster.left(handle)
            return
        runner = handle.runner
        assert isinstance(runner, BaseProcess)  # a thread has no sentinel
        runner.join(JOIN_SECONDS)  # its sentinel closed: the exit status follows at once
        code = runner.exitcode
        out_of_memory = self._out_of_memory_kill(code)
        died = f"{handle.describe()} {describe_exit(code, out_of_memory)}"
        if handle.state is STARTING and not handle.replacement:
            raise self._retired(handle, received, stage, WorkerDied(
                f"{died} while starting ({handle.starting_stage(code)})", pid=handle.pid,
                exitcode=code, starting=True))
        building = self._building(handle)
        charged = building if its_own_doing(code, out_of_memory) else None
        died += self._what_it_held(handle, building)
        refusal = self._why_not_restart(charged)
        if refusal is None:
            self._restart(handle, died, building, charged, stage)
            return
        stream = self._dispatch.stream
        queued = [stream.name(number) for number in sorted(handle.open) if number != building]
        if queued:
            died += f"; {', '.join(queued)} were queued for it"
        raise self._retired(handle, received, stage, WorkerDied(died + refusal, pid=handle.pid,
                                                                exitcode=code))

    def _retired(self, dead: WorkerHandle, received: list[Reply], stage: Stage,
                 error: WorkerDied) -> WorkerDied:
        """``error``, with the dead worker out of the pool, so that a consumer may go on
        without it, as torch's DataLoader does: it gets no task again (in turn, its turns go
        to the next worker, as if its stream had ended), each of its unfinished batches
        becomes a reply with no batch, and these replies and the others read with its death
        wait for the next exchange."""
        self._roster.ended(dead)
        for number, (_, slot) in sorted(dead.open.items()):
            stage.give_back(slot)
            received.append(Reply(number, None, ended=True))
        dead.open.clear()
        self.held += received
        if self._dispatch.in_turn:
            self._dispatch.stream_ended(dead.wid)
        return error

    def _out_of_memory_kill(self, code: int | None) -> bool | None:
        """Whether a worker killed by SIGKILL was the kernel's out-of-memory killer's doing: its
        count of kills rose since the last death (None where it cannot be read)."""
        seen, self._oom_kills = self._oom_kills, oom_kills()
        if code != -signal.SIGKILL or seen is None or self._oom_kills is None:
            return None
        return self._oom_kills > seen

    def _building(self, handle: WorkerHandle) -> int | None:
        """The batch the dead worker had begun and not finished, by its cell on the board; None
        if it had begun none of its tasks."""
        board = self._roster.board
        number = None if board is None else board.building(handle.wid)
        return number if number in handle.open else None

    def _what_it_held(self, handle: WorkerHandle, building: int | None) -> str:
        if handle.state is STARTING:
            return " while starting, in place of a dead worker"
        if building is not None:
            return (f" while building {self._dispatch.stream.name(building)} "
                    f"(sample indices {brief(handle.open[building][0])})")
        return " between batches"

    def _why_not_restart(self, charged: int | None) -> str | None:
        """None when the dead worker may be replaced, else what to tell the user."""
        if self._restarts <= 0:
            used = self._stats.restarts
            return f" (and worker_restarts={used} were used)" if used else ""
        if charged in self._killers:
            return ("; that batch had already killed a worker: a batch that kills its worker "
                    "twice is not sent again")
        return None

    def _restart(self, dead: WorkerHandle, died: str, building: int | None,
                 charged: int | None, stage: Stage) -> None:
        """A new worker with the same id and seed, given the ring. The dead one's tasks go, in
        order and ahead of its own, to a live worker that has started, before the new one is
        started (the consumer waits for the first of them, and a started worker builds it
        sooner than one still starting: a spawned one takes 0.2 s), or, in turn (``in_turn``)
        or with none started, to the new one: every batch still arrives once. The batch it was
        ``building`` goes first. A worker that was leaving (``resize``) is not replaced: its
        tasks go to a live worker, started or not, and only with none left to one in its place.

        A death is ``charged`` to the batch being built only when the worker died of its own
        doing (see ``its_own_doing``): a batch charged twice is not sent again. A kill from
        outside (a user's ``kill``, a killer of random processes) lands on whatever is being
        built, and charged, it would soon judge an innocent batch poison."""
        self._restarts -= 1
        self._stats.restarts += 1
        if charged is not None:
            self._killers.add(charged)
        heir = None if self._dispatch.in_turn else min(
            (h for h in self._roster.working
             if h.accepting and h is not dead and (h.started or dead.leaving)),
            key=lambda h: (not h.started, len(h.open)), default=None)
        replaced = heir is None or not dead.leaving  # one leaving was not to be replaced
        again = ("a new worker takes its place and builds its batches again" if replaced
                 else "other workers build its batches again")
        warn_user(f"{died}: {again} ({self._restarts} more "
                  f"{'restart' if self._restarts == 1 else 'restarts'} allowed)")
        if heir is not None:
            self._hand_over_tasks(dead, heir, building)
        if not replaced:
            dead.open.clear()
            self._roster.left(dead)
            return
        replacement = self._roster.replace(dead)
        stage.joined(replacement)
        if heir is None:
            self._hand_over_tasks(dead, replacement, building)

    def _hand_over_tasks(self, dead: WorkerHandle, heir: WorkerHandle,
                         first: int | None) -> None:
        """The dead worker's tasks, ahead of the heir's own: ``first`` first, the others in
        order."""
        for number in sorted(dead.open, key=lambda number: (number != first, number)):
            indices, slot = heir.open[number] = dead.open[number]
            self._roster.send(heir, framed(Rebuild(number, slot, indices)))


_FROM_OUTSIDE = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def its_own_doing(code: int | None, out_of_memory: bool | None) -> bool:
    """Whether a worker that ended with exit ``code`` died of what it was doing: it exited, or
    crashed (SIGSEGV, SIGBUS, SIGABRT...), or the kernel killed it for the memory it took
    (``out_of_memory``; None: not known, and then it is assumed). A signal that is only ever
    sent from outside (SIGKILL but for the out-of-memory killer, SIGTERM, SIGINT...) is not."""
    if code is None or code >= 0:
        return True
    if -code == signal.SIGKILL:
        return out_of_memory is not False
    return -code not in _FROM_OUTSIDE


def describe_exit(code: int | None, out_of_memory: bool | None) -> str:
    if code is None or code >= 0:
        return f"exited with code {code}"
    killer = " (the kernel's out-of-memory killer)" if out_of_memory else ""
    return f"was killed by signal {signal.Signals(-code).name}{killer}"


def oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills since boot (Linux 4.13 and later); None where
    it cannot be read."""
    try:
        with open("/proc/vmstat", "rb") as vmstat:
            for line in vmstat:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def brief(indices: object) -> str:
    """Sample indices as an error message shows them: a dozen at most."""
    if indices is None:
        return "unknown"
    if isinstance(indices, np.ndarray):
        if indices.size <= 12:
            return str(indices.tolist())
        return np.array2string(indices, threshold=12, separator=", ")
    text = repr(indices)
    return text if len(text) <= 120 else text[:117] + "..."
