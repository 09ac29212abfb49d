"""What a front end asks of the engine beyond its options, in the engine's own terms.

The engine knows no front end by name: torch's ``DataLoader`` deals batches to its workers in
turn, returns its iterator before the workers started and answers torch's
``get_worker_info()`` in each worker; ``shmseq.torch`` says so here, and the engine does it
for whoever asks. ``WorkerStart`` is the part that travels to each worker.
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class FrontEndHooks:
    """Given once, in the ``PipelineSpec``; ``on_worker_start`` travels to every worker, so it
    must pickle (a module-level function)."""
    deal_in_turn: bool = False   # batch k of a pass goes to worker k % num_workers
    open_in_turn: int | None = None  # dealt in turn, to the next worker with room: each holds at
    # most its share of this many open batches (torch's in_order=False)
    start_lazily: bool = False   # the pipeline is made without waiting for its workers
    on_worker_start: Callable[..., None] | None = None  # (WorkerInfo, dataset), in
    # each worker process once it is seeded, before the user's worker_init_fn
    fresh_start: str = "start a new one in the child"  # how to get a pipeline of one's own


@dataclasses.dataclass(frozen=True)
class WorkerStart:
    """What each worker runs once it is seeded, before its first batch: the front end's
    ``on_worker_start`` (in processes only: threads share the trainer's modules), then the
    user's ``worker_init_fn``. Sent to every worker, pickled where it is spawned."""
    on_worker_start: Callable[..., None] | None = None
    worker_init_fn: Callable[[int], object] | None = None

    def run(self, info: object, wid: int, in_process: bool, dataset: object) -> None:
        if in_process and self.on_worker_start is not None:
            self.on_worker_start(info, dataset)
        if self.worker_init_fn is not None:
            self.worker_init_fn(wid)
