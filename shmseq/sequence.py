"""ShmSequence: the public API, its epochs and resumable state, and the lifecycle.

A started sequence owns one runtime (pipeline.py): a ``Pipeline`` (workers) or an ``Inline``
one (everything in the calling thread). A runtime never refers back to its sequence, and
nothing in it sits in a reference cycle, so that a sequence nobody references any more is
closed by its finalizer at once, without the garbage collector. ``finish()`` closes it from
any thread.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, NamedTuple

import numpy as np

from .checks import check_bool, check_choice, check_int, check_worker
from .engine import (Device, EpochPlan, FrontEndHooks, Inline, LoaderStats, Pipeline,
                     PipelineSpec, Plan, WorkerInfo, as_index_array, closing_finalizer)
from .options import LoaderOptions

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from typing_extensions import Self

Runtime = Pipeline | Inline

TEST_MODES = ("default", "cpu", "numpy")


def answer_torch(info: WorkerInfo, dataset: object) -> None:
    """In a worker process with torch loaded, ``torch.utils.data.get_worker_info()`` answers
    too, for datasets written for torch's loader (``shmseq.get_worker_info()`` always does)."""
    if sys.modules.get("torch") is not None:  # None: torch made unimportable
        from .torch_worker import tell_torch
        tell_torch(info, dataset)


SEQUENCE_HOOKS = FrontEndHooks(on_worker_start=answer_torch,
                               fresh_start="call start() on a new ShmSequence in the child")


class Batching(NamedTuple):
    """How a sequence's arguments cut the data set into batches: what a plan is made of."""
    indices: np.ndarray
    batch_size: int
    shuffle: bool
    seed: int
    seed_given: bool      # False: drawn by this process, so that ranks agree on rank 0's
    last_batch: str
    rank: int | None
    world_size: int | None


class Stage:
    """A loader's own part around a ``ShmSequence`` (``ShardSequence``'s: the node's shard cache
    and this rank's prefetcher; a ``shmseq.DataLoader``'s: its batch sampler), given to the
    sequence when it is made. The sequence calls each hook from the trainer's thread, at the
    moment its name says; the defaults add nothing."""

    def plan(self, batching: Batching) -> Plan:
        """What draws every epoch's batches; the default: ``batching``'s seeded epochs."""
        return EpochPlan(batching.indices, batching.batch_size, shuffle=batching.shuffle,
                         seed=batching.seed, last_batch=batching.last_batch, rank=batching.rank,
                         world_size=batching.world_size, seed_given=batching.seed_given)

    def starting(self, sequence: ShmSequence, test: bool) -> None:
        """Before the runtime starts (``start_test()``'s: ``test``), at the sequence's
        ``resume_point``."""

    def started(self) -> None:
        """The runtime is up (its workers too)."""

    def finished(self) -> None:
        """The runtime was closed (its counters took the stage's ``counts()`` first)."""

    def counts(self) -> dict[str, int | float]:
        """What this process counted since the last call (added to ``stats``)."""
        return {}

    def saved(self, sequence: ShmSequence, state: dict) -> dict:
        """``state`` (``ShmSequence.state_dict()``'s) with what the stage must resume."""
        return state

    def loading(self, sequence: ShmSequence, state: dict) -> dict:
        """A saved state, before the sequence loads it (a stage may rewrite it)."""
        return state


class ShmSequence:
    """Batches of ``worker[indices]`` built by a pool, delivered in order through shared memory.

    Args:
        worker: a class (instantiated once in each worker) or an instance (copied into each
            process, shared by threads) whose ``__getitem__`` takes a 1-D int64 array of
            sample indices and returns the batch: an ndarray, or a tuple / list / dict nesting
            of ndarrays plus small extras. Or it defines ``fill_batch(indices, out)`` and
            allocates its arrays with ``out.empty(shape, dtype)``, straight in the slot.
        dset_size: the number of samples, or a 1-D array of the sample indices to draw from.
        batch_size: samples per batch.
        slot_bytes: bytes of one slot; None: sized by the first batches (a quarter more).
        buffer: slots in the ring: how many batches may be built ahead of the consumer. None:
            counted from the slot size, the workers and how many batches the consumer holds
            at once (two slots per worker, one per batch held, one ready; more for small
            batches, up to 10 within half the CPU's last-level cache), within
            ``memory_budget``.
        num_workers: worker processes (or threads); 0 builds batches in the calling thread;
            ``'auto'``: as many as keep the consumer fed, adjusted as it runs (more while it
            waits for batches and CPU is free, fewer while the ring stays full), never more
            than ``max_workers``. The batches and their order do not depend on it.
        max_workers: the most workers ``'auto'`` runs; None: 16, or the usable cores if more.
            A worker's ``get_worker_info().num_workers`` is this bound.
        cpu_budget: cores ``'auto'``'s workers and the consumer may use together; None: the
            cores this process may run on.
        memory_budget: bytes the ring may take when shmseq counts its slots (no ``buffer``);
            with ``'auto'``, the ring and the workers: each costs what its process holds
            alone (``stats.worker_private_bytes``) and its two slots.
        num_converters: CUDA streams batches are copied on (MDNC's name); None: MDNC's default.
        shuffle, seed: a new order each epoch, a function of ``seed`` and the epoch.
        thread_type: ``'proc'`` (processes) or ``'thread'``.
        out_type: ``'null'`` numpy arrays, ``'cpu'`` torch tensors, ``'cuda'``/``'cuda:N'``
            tensors copied to that GPU (CPU tensors, with a warning, where there is none).
        start_method: multiprocessing's ``'fork'``, ``'spawn'`` or ``'forkserver'``.
        timeout: seconds to wait for a batch (and for the workers to start); None: no limit.
        last_batch: ``'keep'``, ``'discard'`` or ``'rollover'`` a last, smaller batch.
        pin_memory, pin_device_id: page-lock the ring for fast copies to that GPU.
        rank, world_size: this process's share of every epoch; None: read from
            ``torch.distributed`` when an epoch starts.
        worker_init_fn: called with the worker id in each worker before its first batch.
        worker_restarts: how many worker processes that die may be replaced in a run.
        device: makes the ``Device`` each start uses instead of the one ``out_type`` makes:
            a consumer-side stage (``shmseq.decode.DecodeStage``: JPEG decode in the trainer),
            or ``shmseq.testing``'s fakes, to test a pipeline's copies without a GPU.
        stage: for loaders built on a sequence, their own part around it (a ``Stage``: the
            plan, and hooks at each start, finish, save and load); ``ShardSequence`` and
            ``shmseq.DataLoader`` give theirs.

    Raises:
        ValueError, TypeError: an argument out of its range or of the wrong type (the message
            names it and what to pass instead).
        ImportError: ``out_type='cpu'`` without torch installed.

    The full contract: docs/reference.md.
    """

    def __init__(self, worker: object, dset_size: ArrayLike, *, batch_size: int = 32,
                 slot_bytes: int | None = None, buffer: int | None = None,
                 num_workers: int | Literal["auto"] = 4,
                 num_converters: int | None = None,
                 shuffle: bool = True, seed: int | None = None, thread_type: str = "proc",
                 out_type: str = "cuda", start_method: str | None = None,
                 timeout: float | None = 120.0,
                 last_batch: str = "keep", pin_memory: bool | None = None, pin_device_id: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 worker_init_fn: Callable[[int], object] | None = None,
                 worker_restarts: int = 0, device: Callable[[], Device] | None = None,
                 max_workers: int | None = None, cpu_budget: float | None = None,
                 memory_budget: int | None = None, stage: Stage | None = None) -> None:
        check_worker(worker)
        check_int("batch_size", batch_size, 1)
        check_int("seed", seed, 0, optional=True)
        check_bool("shuffle", shuffle)
        self.options = LoaderOptions(
            num_workers, max_workers=max_workers, cpu_budget=cpu_budget,
            memory_budget=memory_budget, buffer=buffer, slot_bytes=slot_bytes,
            thread_type=thread_type, start_method=start_method, out_type=out_type,
            pin_memory=pin_memory, pin_device_id=pin_device_id, num_converters=num_converters,
            timeout=timeout, worker_init_fn=worker_init_fn, worker_restarts=worker_restarts,
            device=device)
        self.worker = worker
        self.stage = Stage() if stage is None else stage
        self._seed = self._default_seed() if seed is None else int(seed)
        self._plan: Plan = self.stage.plan(Batching(
            as_index_array(dset_size), batch_size, bool(shuffle), self._seed, seed is not None,
            last_batch, rank, world_size))
        self.epoch = 0                   # the epoch the next iteration starts
        self._resume_at = 0               # ... at this batch (set by load_state_dict)
        self._last = (-1, 0)              # (epoch, batches delivered) of the last iteration
        self._last_ended = False          # ... and whether it saw its epoch's end
        self._open: tuple[int, int] | None = None  # (epoch, first position) being iterated
        self._iterating: tuple[Runtime, object] | None = None  # (runtime, token) of the iteration
        self._claim = threading.Lock()
        self._runtime: Runtime | None = None
        self._closer: weakref.finalize | None = None
        self._stage_closer: weakref.finalize | None = None
        self._stats = LoaderStats()

    def _default_seed(self) -> int:
        """The seed when none is given: fresh entropy, so that each run shuffles anew."""
        entropy = np.random.SeedSequence().entropy
        assert isinstance(entropy, int)  # drawn, not given
        return int(entropy % 2**63)

    # -- the options, under MDNC's attribute names ---------------------------------------------
    num_workers = property(lambda self: self.options.num_workers)
    max_workers = property(lambda self: self.options.max_workers)
    cpu_budget = property(lambda self: self.options.cpu_budget)
    memory_budget = property(lambda self: self.options.memory_budget)
    buffer = property(lambda self: self.options.buffer)
    slot_bytes = property(lambda self: self.options.slot_bytes)
    thread_type = property(lambda self: self.options.thread_type)
    start_method = property(lambda self: self.options.start_method)
    out_type = property(lambda self: self.options.out_type)
    pin_memory = property(lambda self: self.options.pin_memory)
    pin_device_id = property(lambda self: self.options.pin_device_id)
    num_converters = property(lambda self: self.options.num_converters)
    worker_init_fn = property(lambda self: self.options.worker_init_fn)
    worker_restarts = property(lambda self: self.options.worker_restarts)

    # -- the MDNC attributes --------------------------------------------------------------------
    @property
    def dset_size(self) -> int:
        plan = self._plan
        assert isinstance(plan, EpochPlan)  # a sampler's plan's loaders count their dataset
        return len(plan.indices)

    @property
    def batch_size(self) -> int | None:
        return self._plan.batch_size

    @property
    def length(self) -> int:
        return len(self)

    @property
    def seed(self) -> int:
        """The shuffle's and the workers' seed (the ranks' shared one, once they agreed)."""
        seed = self._plan.seed
        return self._seed if seed is None else seed

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for a batch before ``BatchTimeout``; None: as long as it takes."""
        return self.options.timeout

    def __len__(self) -> int:
        """Batches of the epoch being iterated, or else of the one the next iteration yields
        (with rollover, epochs differ; ranks as torch.distributed has them now)."""
        epoch, position = self._epoch_in_view()
        return self._plan.length(epoch) - position

    def _epoch_in_view(self) -> tuple[int, int]:
        """(epoch, first position) of the iteration in progress, or else of the next one."""
        if self._open is not None:
            return self._open
        self._plan.refresh()
        return self.epoch, self._resume_at

    @property
    def stats(self) -> LoaderStats:
        """Counters of the last pipeline started (batches, bytes, worker busy and consumer wait
        time, overflows, copy-outs), kept after ``finish()``; zeros in test mode. With a
        stage, what it counted in this process too (a shard cache's fetches, ...)."""
        self._stats.add_counts(self.stage.counts())
        return self._stats

    @property
    def use_cuda(self) -> bool:
        return self.out_type.startswith("cuda")

    # -- for inspection (shmseq.testing) --------------------------------------------------------
    @property
    def pipeline(self) -> Pipeline | Inline | None:
        """The running pipeline (an ``Inline`` one without workers); None before ``start()``
        and after ``finish()``."""
        return self._runtime

    @property
    def plan(self) -> Plan:
        """What draws every epoch's batches (``plan.batches(epoch)``: their sample indices)."""
        return self._plan

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, compat: object = None) -> Self:
        """Start the workers; interrupts a running pipeline first.

        ``compat`` is accepted for MDNC compatibility and ignored (there are no converter
        processes or threads to choose: copies run on CUDA streams).
        """
        self.finish()
        if not self.num_workers:
            return self._started(lambda: Inline(self._spec(), self._plan), test=False)
        self._stats = LoaderStats()  # kept, with what it counted, if the start fails
        return self._started(lambda: Pipeline(self._spec(), self._plan, self.epoch,
                                              self._resume_at, stats=self._stats), test=False)

    def start_test(self, test_mode: str = "default") -> Self:
        """Run everything in the calling thread, with the same batches as ``start()``.

        ``'default'``: delivered as ``start()`` would; ``'cpu'``: torch CPU tensors even if
        ``out_type`` is CUDA; ``'numpy'``: the worker's output untouched.
        """
        check_choice("test_mode", test_mode, TEST_MODES)
        self.finish()
        return self._started(lambda: Inline(self._spec(), self._plan, test_mode), test=True)

    def _started(self, make: Callable[[], Runtime], test: bool) -> Self:
        """The runtime ``make()`` starts, the stage told before and after; the stage finishes
        with the runtime, or with the sequence if nobody references it any more."""
        self._stage_closer = weakref.finalize(self, self.stage.finished)
        try:
            self.stage.starting(self, test)
            self._own(make())
        except BaseException:
            self.finish()
            raise
        self.stage.started()
        return self

    def _spec(self) -> PipelineSpec:
        """What the pipeline started now runs. Its workers' seeds come from the sequence's
        seed and the epoch it starts at: a pipeline started again later draws fresh streams,
        the same ones for the same seed and epoch."""
        base = np.random.SeedSequence([self.seed, self.epoch]).generate_state(1, np.uint64)[0]
        return self.options.spec(self.worker, int(base >> 1), SEQUENCE_HOOKS)

    @property
    def resume_point(self) -> tuple[int, int]:
        """(epoch, position): where the next iteration starts."""
        return self.epoch, self._resume_at

    def _own(self, runtime: Runtime) -> Self:
        self._runtime = runtime
        self._stats = runtime.stats
        self._closer = closing_finalizer(self, runtime)
        return self

    def finish(self) -> None:
        """Stop every worker and thread and free the ring: before it returns, whatever thread
        calls it, unless the consumer still holds batches (their slots' memory then goes with
        the last of them). Safe to call at any time."""
        closer, self._closer, self._runtime = self._closer, None, None
        if closer is not None:
            closer()
        stage_closer, self._stage_closer = self._stage_closer, None
        if stage_closer is not None:
            self._stats.add_counts(self.stage.counts())
            stage_closer()

    def __enter__(self) -> Self:
        if self._runtime is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def __iter__(self) -> Iterator[Any]:
        """One epoch; the next iteration is the next epoch (``break`` leaves the rest).

        The epoch is taken at the first batch: a bare ``iter(seq)`` takes nothing."""
        runtime = self._runtime
        if runtime is None:
            raise RuntimeError("the sequence is not running: call start() or start_test() "
                               "(or use it in a with-block) before iterating")
        return self._epoch(runtime)

    def _epoch(self, runtime: Runtime) -> Iterator[Any]:
        token = self._claim_iteration(runtime)
        epoch, position = self.epoch, self._resume_at
        self.epoch, self._resume_at = epoch + 1, 0
        self._open = self._last = (epoch, position)
        self._last_ended = False
        delivered = position
        try:
            for batch in runtime.batches(epoch, position):  # no enumerate(): it keeps the last
                delivered += 1
                self._last = (epoch, delivered)
                yield batch
                del batch
            self._last_ended = True
        except GeneratorExit:
            raise
        except BaseException:
            if self._runtime is runtime:
                self.finish()  # an error or Ctrl-C: nothing of the pipeline is left running
            raise
        finally:
            self._release_iteration(token)

    def _claim_iteration(self, runtime: Runtime) -> object:
        with self._claim:
            if self._iterating is not None and self._iterating[0] is runtime:
                raise RuntimeError(
                    "this sequence is already being iterated (a for-loop over it is still going, "
                    "in this thread or another): finish or break out of that loop first, or "
                    "close() its iterator; to read two streams at once, make two sequences")
            token = object()
            self._iterating = (runtime, token)
            return token

    def _release_iteration(self, token: object) -> None:
        with self._claim:
            if self._iterating is not None and self._iterating[1] is token:
                self._iterating = self._open = None

    # -- resuming -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (as ``DistributedSampler.set_epoch``), told to
        a user's sampler too. The epoch the sequence is at already keeps its position (a
        restored mid-epoch state: trainers call this before every epoch)."""
        check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self._resume_at = int(epoch), 0
        self._plan.set_epoch(int(epoch))

    def state_dict(self) -> dict:
        """Where the consumer is: a run restored from this yields exactly the batches it had not
        received yet, in the same order. Taken at an epoch's last batch (inside the loop), it
        is that epoch's end, as torchdata's loaders have it: the restored run's iteration of
        that epoch yields nothing, then the next epoch comes; taken once the loop ended, it is
        the next epoch's start."""
        epoch, delivered = self._last
        if self._resume_at or epoch < 0 or self._last_ended:
            epoch, delivered = self.epoch, self._resume_at  # between epochs
        plan = self._plan
        return self.stage.saved(self, {
            "epoch": epoch, "position": delivered, "seed": self.seed,
            "batch_size": self.batch_size, "dset_size": self.dset_size,
            "last_batch": plan.last_batch, "rank": plan.rank, "world_size": plan.world_size,
            "rollover_remainder": plan.carried(epoch)})

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it was.

        Any rank's state resumes every rank: ranks get as many batches per epoch and go in step,
        so their states differ only in ``rank``, which is not checked (Lightning and Accelerate
        checkpoint rank 0's state and load it on every rank)."""
        self._plan.refresh()
        state = self.stage.loading(self, state)
        mine = self.state_dict()
        for key in ("batch_size", "dset_size", "last_batch", "world_size"):
            if state.get(key, mine[key]) != mine[key]:
                raise ValueError(f"state {key}={state[key]!r} does not match this sequence's "
                                 f"{key}={mine[key]!r}: build the sequence as the saved one was")
        self._seed = int(state["seed"])
        self._plan.settle_seed(self._seed)
        self.epoch, self._resume_at = int(state["epoch"]), int(state["position"])
        self._last, self._last_ended = (-1, 0), False
        if self._runtime is not None:
            self._runtime.replan()  # batches in flight were planned with the old seed
