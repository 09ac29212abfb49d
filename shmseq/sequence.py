"""ShmSequence: wires plan -> workers -> ring -> device -> the consumer, and owns the lifecycle.

A started sequence owns one runtime: ``_Pipeline`` (workers) or ``_Inline`` (everything in
the calling thread). A runtime never refers back to its sequence, and nothing in it sits in
a reference cycle, so that a sequence nobody references any more is closed by its
finalizer at once, without the garbage collector. ``finish()`` closes it from any thread.
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing
import numbers
import os
import threading
import time
import weakref

import numpy as np

from .convert import OrderedOutput, Route
from .devices import OUT_TYPES, make_device, resolve_out_type
from .errors import BatchTimeout, PipelineClosed, ShmSeqError
from .layout import encode_batch, read_batch
from .plan import BatchStream, EpochPlan, as_index_array
from .pool import Arrival, Waker, WorkerPool
from .worker_handle import JOIN_SECONDS
from .ring import Ring
from .stats import LoaderStats
from .workers import build_batch, make_worker, slot_bytes_for

THREAD_TYPES = ("proc", "thread")
MAX_TIMEOUT = 2_147_483  # seconds: the most select() takes (a 32-bit count of milliseconds)
ERROR_GRACE = 0.2  # seconds workers get to leave once a failure was raised, before they are killed
TEST_MODES = ("default", "cpu", "numpy")


def _check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}"
                         f"{' or None' if optional else ''}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_out_type(out_type) -> None:
    if not isinstance(out_type, str) or not (
            out_type in OUT_TYPES or (out_type.startswith("cuda:") and out_type[5:].isdigit())):
        raise ValueError(f"out_type must be 'null' (numpy), 'cpu' (torch), 'cuda' or 'cuda:N', "
                         f"got {out_type!r}")


def _check_timeout(timeout) -> float | None:
    """Seconds to wait for a batch; None (given as None or inf): as long as it takes."""
    if timeout is None or (isinstance(timeout, numbers.Real) and timeout == math.inf):
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (
            0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:,}], or None "
                         f"(or inf) to wait as long as it takes, got {timeout!r}")
    return float(timeout)


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value); None: no deadline."""
    return None if deadline is None else deadline - time.monotonic()


def _check_worker(worker) -> None:
    if not (hasattr(worker, "__getitem__") or hasattr(worker, "fill_batch")):
        raise TypeError(f"worker must be a class or an object with __getitem__(indices) "
                        f"(or fill_batch(indices, out)), got {worker!r}")


class ShmSequence:
    """Batches of ``worker[indices]`` built by a pool, delivered in order through shared memory.

    ``worker`` is a class (instantiated once in each worker) or an instance (copied
    into each process, shared by threads) whose ``__getitem__`` takes a 1-D int64
    array of sample indices and returns the batch: an ndarray, or a tuple / list /
    dict nesting of ndarrays plus small extras. Workers may instead define
    ``fill_batch(indices, out)`` and allocate their arrays with ``out.empty(shape,
    dtype)``, straight in the slot. The full contract: docs/reference.md.
    """

    def __init__(self, worker, dset_size, *, batch_size: int = 32, slot_bytes: int | None = None,
                 buffer: int = 10, num_workers: int = 4, num_converters: int | None = None,
                 shuffle: bool = True, seed: int | None = None, thread_type: str = "proc",
                 out_type: str = "cuda", start_method: str | None = None,
                 timeout: float | None = 120.0,
                 last_batch: str = "keep", pin_memory: bool | None = None, pin_device_id: int = 0,
                 rank: int | None = None, world_size: int | None = None, worker_init_fn=None,
                 worker_restarts: int = 0):
        _check_worker(worker)
        _check_int("batch_size", batch_size, 1)
        _check_int("buffer", buffer, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("num_converters", num_converters, 1, optional=True)
        _check_int("slot_bytes", slot_bytes, 1, optional=True)
        _check_int("seed", seed, 0, optional=True)
        _check_int("pin_device_id", pin_device_id, 0)
        _check_int("worker_restarts", worker_restarts, 0)
        if worker_restarts and thread_type == "thread":
            raise ValueError(f"worker_restarts={worker_restarts} replaces worker processes that "
                             "die, but thread_type='thread' runs none: use thread_type='proc'")
        _check_choice("thread_type", thread_type, THREAD_TYPES)
        _check_choice("start_method", start_method, (None, *multiprocessing.get_all_start_methods()))
        _check_out_type(out_type)
        self._timeout = _check_timeout(timeout)
        self.worker = worker
        self._seed_given = seed is not None
        self._seed = self._default_seed() if seed is None else int(seed)
        self._plan = self._make_plan(dset_size, batch_size, shuffle, last_batch, rank, world_size)
        self.worker_init_fn = worker_init_fn
        self.slot_bytes = slot_bytes
        self.buffer = buffer
        self.num_workers = num_workers
        self.thread_type = thread_type
        self.start_method = start_method
        self.out_type = resolve_out_type(out_type)
        self.pin_memory = pin_memory
        self.pin_device_id = pin_device_id
        self.worker_restarts = worker_restarts
        # MDNC's default: for CUDA output, the number of streams batches are copied on.
        self.num_converters = num_converters or max(num_workers // 4, min(num_workers, 4), 1)
        self.epoch = 0                   # the epoch the next iteration starts
        self._resume_at = 0               # ... at this batch (set by load_state_dict)
        self._last = (-1, 0)              # (epoch, batches delivered) of the last iteration
        self._open: tuple[int, int] | None = None  # (epoch, first position) being iterated
        self._iterating = None            # (runtime, token) of the iteration in progress
        self._claim = threading.Lock()
        self._runtime = None
        self._closer = None
        self._stats = LoaderStats()

    def _default_seed(self) -> int:
        """The seed when none is given: fresh entropy, so that each run shuffles anew."""
        return int(np.random.SeedSequence().entropy % 2**63)

    def _make_plan(self, dset_size, batch_size, shuffle, last_batch, rank, world_size):
        return EpochPlan(as_index_array(dset_size), batch_size, shuffle=bool(shuffle),
                         seed=self._seed, last_batch=last_batch, rank=rank, world_size=world_size,
                         seed_given=self._seed_given)

    # -- the MDNC attributes --------------------------------------------------------------------
    @property
    def dset_size(self) -> int:
        return len(self._plan.indices)

    @property
    def batch_size(self) -> int | None:
        return getattr(self._plan, "batch_size", None)

    @property
    def length(self) -> int:
        return len(self)

    @property
    def seed(self) -> int:
        """The shuffle's and the workers' seed (the ranks' shared one, once they agreed)."""
        return getattr(self._plan, "seed", self._seed)

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for a batch before ``BatchTimeout``; None: as long as it takes."""
        return self._timeout

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
        time, overflows, copy-outs), kept after ``finish()``; zeros in test mode."""
        return self._stats

    @property
    def use_cuda(self) -> bool:
        return self.out_type.startswith("cuda")

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, compat=None) -> "ShmSequence":
        """Start the workers; interrupts a running pipeline first.

        ``compat`` is accepted for MDNC compatibility and ignored (there are no converter
        processes or threads to choose: copies run on CUDA streams).
        """
        self.finish()
        return self._own(_Pipeline(self) if self.num_workers else _Inline(self, "default"))

    def start_test(self, test_mode: str = "default") -> "ShmSequence":
        """Run everything in the calling thread, with the same batches as ``start()``.

        ``'default'``: delivered as ``start()`` would; ``'cpu'``: torch CPU tensors even if
        ``out_type`` is CUDA; ``'numpy'``: the worker's output untouched.
        """
        _check_choice("test_mode", test_mode, TEST_MODES)
        self.finish()
        return self._own(_Inline(self, test_mode))

    def _own(self, runtime) -> "ShmSequence":
        self._runtime = runtime
        self._stats = runtime.stats
        self._closer = weakref.finalize(self, _close_in_owner, runtime, os.getpid())
        return self

    def finish(self) -> None:
        """Stop every worker and thread and free the ring: before it returns, whatever thread
        calls it, unless the consumer still holds batches (their slots' memory then goes with
        the last of them). Safe to call at any time."""
        closer, self._closer, self._runtime = self._closer, None, None
        if closer is not None:
            closer()

    def __enter__(self) -> "ShmSequence":
        if self._runtime is None:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()

    def __iter__(self):
        """One epoch; the next iteration is the next epoch (``break`` leaves the rest).

        The epoch is taken at the first batch: a bare ``iter(seq)`` takes nothing."""
        runtime = self._runtime
        if runtime is None:
            raise RuntimeError("the sequence is not running: call start() or start_test() "
                               "(or use it in a with-block) before iterating")
        return self._epoch(runtime)

    def _epoch(self, runtime):
        token = self._claim_iteration(runtime)
        epoch, position = self.epoch, self._resume_at
        self.epoch, self._resume_at = epoch + 1, 0
        self._open = self._last = (epoch, position)
        delivered = position
        try:
            for batch in runtime.batches(epoch, position):  # no enumerate(): it keeps the last
                delivered += 1
                self._last = (epoch, delivered)
                yield batch
                del batch
        except GeneratorExit:
            raise
        except BaseException:
            if self._runtime is runtime:
                self.finish()  # an error or Ctrl-C: nothing of the pipeline is left running
            raise
        finally:
            self._release_iteration(token)

    def _claim_iteration(self, runtime):
        with self._claim:
            if self._iterating is not None and self._iterating[0] is runtime:
                raise RuntimeError(
                    "this sequence is already being iterated (a for-loop over it is still going, "
                    "in this thread or another): finish or break out of that loop first, or "
                    "close() its iterator; to read two streams at once, make two sequences")
            token = object()
            self._iterating = (runtime, token)
            return token

    def _release_iteration(self, token) -> None:
        with self._claim:
            if self._iterating is not None and self._iterating[1] is token:
                self._iterating = self._open = None

    # -- resuming -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (as ``DistributedSampler.set_epoch``), told to
        a user's sampler too. The epoch the sequence is at already keeps its position (a
        restored mid-epoch state: trainers call this before every epoch)."""
        _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self._resume_at = int(epoch), 0
        self._plan.set_epoch(int(epoch))

    def state_dict(self) -> dict:
        """Where the consumer is: a run restored from this yields exactly the batches it had not
        received yet, in the same order."""
        epoch, delivered = self._last
        if self._resume_at or epoch < 0 or delivered >= self._plan.length(epoch):
            epoch, delivered = self.epoch, self._resume_at  # between epochs
        plan = self._plan
        return {"epoch": epoch, "position": delivered, "seed": self.seed,
                "batch_size": self.batch_size, "dset_size": self.dset_size,
                "last_batch": getattr(plan, "last_batch", None), "rank": getattr(plan, "rank", 0),
                "world_size": getattr(plan, "world_size", 1),
                "rollover_remainder": _remainder(plan, epoch)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it was.

        Any rank's state resumes every rank: ranks get as many batches per epoch and go in step,
        so their states differ only in ``rank``, which is not checked (Lightning and Accelerate
        checkpoint rank 0's state and load it on every rank)."""
        self._plan.refresh()
        mine = self.state_dict()
        for key in ("batch_size", "dset_size", "last_batch", "world_size"):
            if state.get(key, mine[key]) != mine[key]:
                raise ValueError(f"state {key}={state[key]!r} does not match this sequence's "
                                 f"{key}={mine[key]!r}: build the sequence as the saved one was")
        self._seed = int(state["seed"])
        self._plan.settle_seed(self._seed)
        self.epoch, self._resume_at = int(state["epoch"]), int(state["position"])
        self._last = (-1, 0)
        if self._runtime is not None:
            self._runtime.replan()  # batches in flight were planned with the old seed


def _remainder(plan, epoch: int) -> list[int]:
    """The samples an epoch inherits from the previous ones (rollover), for the record."""
    if getattr(plan, "last_batch", None) != "rollover" or not plan.samples_per_epoch:
        return []
    carried = epoch * plan.samples_per_epoch - plan.start(epoch) * plan.batch_size
    return plan.batches(epoch)[0][:carried].tolist() if carried and plan.length(epoch) else []


def _close_in_owner(runtime, owner_pid: int) -> None:
    """The finalizer of a started sequence: a forked child that inherited it does nothing."""
    if os.getpid() == owner_pid:
        runtime.close()


class _Pipeline:
    """The running machinery of a started sequence: pool, ring, route, and their closing."""

    def __init__(self, seq: ShmSequence):
        self.plan = seq._plan
        self.timeout = seq._timeout
        self.n_slots = seq.buffer
        self.stats = LoaderStats()
        self.ring: Ring | None = None
        self.pool: WorkerPool | None = None
        self.device = None
        self._turn = threading.RLock()  # held by the consumer while it takes a batch
        self._closed = False
        self._broken = False  # a failure was raised: workers get no time to finish politely
        self._packing = False  # the consumer is the slower side (see _follow_the_pace)
        self.waker = Waker()
        self.output = OrderedOutput()
        self.stream = BatchStream(self.plan, seq.epoch, seq._resume_at)
        try:
            self.device = make_device(seq.out_type, seq.pin_memory, seq.pin_device_id,
                                      seq.num_converters)
            self.route = Route(self.device, self.output, self.stats)
            self.pool = WorkerPool(seq.worker, num_workers=seq.num_workers, backend=seq.thread_type,
                                   context=multiprocessing.get_context(seq.start_method),
                                   stream=self.stream, waker=self.waker, stats=self.stats,
                                   seed=seq.seed, worker_init_fn=seq.worker_init_fn,
                                   restarts=seq.worker_restarts)
            if seq.slot_bytes is not None and self.plan.has_batches():
                self._make_ring(seq.slot_bytes)
            self._start(seq._timeout)
        except BaseException:
            self._broken = True
            self.close()
            raise

    def _start(self, timeout: float | None) -> None:
        """Return once every worker built its worker object and mapped the ring (whose name
        is then unlinked), and the probe batch sized the ring if it had to."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.pool.started() or (self.ring is None and self.stream.peek() is not None):
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise ShmSeqError(f"the workers did not start within timeout={timeout} s: "
                                  f"{self.pool.which_not_started() or 'the probe batch is late'}")
            self._pump(remaining)

    def _make_ring(self, slot_bytes: int) -> None:
        self.ring = Ring.create(self.n_slots, slot_bytes, wake=self.waker.wake_if_waiting)
        self.route.ring = self.ring
        self.device.attach(self.ring)
        self.pool.use_ring(self.ring)

    def _pump(self, timeout: float | None) -> None:
        arrivals, waited = self.pool.pump(timeout)
        for arrival in arrivals:
            if self.ring is None:
                self._sized_by(arrival)
            else:
                self.route.arrive(arrival)
        self._follow_the_pace(waited)
        self.pool.dispatch(pack=self._packing)

    def _follow_the_pace(self, waited: bool) -> None:
        """Which side is slower: the consumer, once it found half the ring or more waiting for
        it, until it has to wait for a batch again. Its tasks are then packed on one worker
        (see ``WorkerPool._send_task``)."""
        if waited:
            self._packing = False
        elif 2 * self.output.waiting >= self.n_slots:
            self._packing = True

    def _sized_by(self, probe: Arrival) -> None:
        """The first batch came back encoded: size the ring to it, and deliver it from there."""
        if probe.error is not None:
            raise probe.error()
        payload = probe.payload
        self._make_ring(slot_bytes_for(len(payload)))
        slot = self.ring.acquire()
        self.ring.region(slot)[:len(payload)] = payload
        self.ring.written(slot)
        self.route.arrive(Arrival(probe.seq, slot))

    # -- the consumer's side ---------------------------------------------------------------------
    def batches(self, epoch: int, position: int = 0):
        with self._turn:
            self.output.check()
            seq = self.stream.open(epoch, position)
            self.output.drop_below(seq)
        for position in range(position, self.plan.length(epoch)):
            yield self.take(seq, epoch, position)
            seq += 1

    def take(self, seq: int, epoch: int, position: int):
        """Batch ``seq``: from the output if it is there, else once the pool brings it."""
        with self._turn:
            try:
                delivery = self.output.pop(seq)  # raises once the pipeline is closed
                if self.ring is not None:
                    self.ring.collect()  # slots freed, and copies failed, in other threads
                if delivery is None:
                    delivery = self._wait_for(seq, epoch, position)
                elif self.ring.has_free():
                    self.pool.dispatch(pack=self._packing)  # keep the workers busy meanwhile
                return self.route.hand_over(seq, delivery)
            except PipelineClosed:
                raise
            except BaseException:
                self._broken = True  # report first: the workers are then stopped at once
                raise

    def _wait_for(self, seq: int, epoch: int, position: int):
        began = time.perf_counter()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                self._timed_out(seq, epoch, position)
            try:
                self._pump(remaining)
            except Exception:
                self.output.check()  # closed meanwhile, by a signal handler: say so
                raise
            if (delivery := self.output.pop(seq)) is not None:
                self.stats.consumer_wait_s += time.perf_counter() - began
                return delivery

    def _timed_out(self, seq: int, epoch: int, position: int):
        raise BatchTimeout(
            f"batch {position} of epoch {epoch} (sample indices "
            f"{self.plan.batches(epoch)[position].tolist()}) did not arrive within timeout="
            f"{self.timeout} s; it is with {self.pool.holder_of(seq)}")

    def replan(self) -> None:
        """The plan changed (a new seed): batches planned so far are stale."""
        with self._turn:
            self.stream.reset(self.stream.state())

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wake a waiting consumer, then stop the workers, wait for copies in flight, close the
        device and unmap the ring: every step runs even if one before it fails."""
        self.output.close("the sequence was finished or restarted while iterating")
        self.waker.wake()
        with self._turn:
            if self._closed:
                return
            self._closed = True
            with contextlib.ExitStack() as steps:  # run last to first
                steps.callback(self.waker.close)
                if self.ring is not None:
                    steps.callback(self.ring.close)
                if self.device is not None:
                    steps.callback(self.device.close)
                if self.ring is not None:
                    steps.callback(self.ring.finish_copies)
                if self.pool is not None:
                    steps.callback(self.pool.stop, ERROR_GRACE if self._broken else JOIN_SECONDS)
                steps.callback(self.output.clear)


class _Inline:
    """Everything in the calling thread: ``start_test()`` and ``num_workers=0``."""

    def __init__(self, seq: ShmSequence, test_mode: str):
        self.plan = seq._plan
        self.worker_obj = make_worker(seq.worker)
        self.test_mode = test_mode
        out_type = "cpu" if test_mode == "cpu" and seq.use_cuda else seq.out_type
        self.device = make_device(out_type, pin_memory=False)
        self.stats = LoaderStats()

    def batches(self, epoch: int, position: int = 0):
        self.plan.open(epoch)
        for indices in self.plan.batches(epoch)[position:]:
            batch, _ = build_batch(self.worker_obj, indices, None)
            if self.test_mode != "numpy":
                # Through the slot format, so that types and layout match start() exactly.
                views = read_batch(encode_batch(batch), self.device.leaf)
                batch = self.device.hand_over(*self.device.convert(views))
            yield batch

    def replan(self) -> None:
        """Nothing planned ahead."""

    def close(self) -> None:
        self.worker_obj = None
        self.device.close()
