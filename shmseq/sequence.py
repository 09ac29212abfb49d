"""ShmSequence: wires plan -> workers -> ring -> converters -> the consumer, and owns the lifecycle."""
from __future__ import annotations

import multiprocessing
import numbers
import queue
import time
import weakref

import numpy as np

from .convert import MISSING, Converters, Delivery, DirectHandOver, OrderedOutput, to_delivery
from .devices import OUT_TYPES, make_device, resolve_out_type, torch_available
from .errors import BatchTimeout, PipelineClosed, warn_user
from .layout import encode_batch, map_arrays, read_batch
from .plan import BatchStream, EpochPlan, as_index_array
from .pool import JOIN_SECONDS, WorkerPool
from .stats import LoaderStats
from .workers import build_batch, make_worker, slot_bytes_for

THREAD_TYPES = ("proc", "thread")
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
                 out_type: str = "cuda", start_method: str | None = None, timeout: float = 120.0,
                 last_batch: str = "keep", pin_memory: bool | None = None, pin_device_id: int = 0,
                 rank: int | None = None, world_size: int | None = None, worker_init_fn=None):
        _check_worker(worker)
        _check_int("batch_size", batch_size, 1)
        _check_int("buffer", buffer, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("num_converters", num_converters, 1, optional=True)
        _check_int("slot_bytes", slot_bytes, 1, optional=True)
        _check_int("seed", seed, 0, optional=True)
        _check_int("pin_device_id", pin_device_id, 0)
        _check_choice("thread_type", thread_type, THREAD_TYPES)
        _check_choice("start_method", start_method, (None, *multiprocessing.get_all_start_methods()))
        _check_out_type(out_type)
        if not isinstance(timeout, numbers.Real) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.worker = worker
        self.seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else int(seed)
        self._plan = self._make_plan(dset_size, batch_size, shuffle, last_batch, rank, world_size)
        self.worker_init_fn = worker_init_fn
        self.slot_bytes = slot_bytes
        self.buffer = buffer
        self.num_workers = num_workers
        self.thread_type = thread_type
        self.start_method = start_method
        self.timeout = float(timeout)
        self.out_type = resolve_out_type(out_type)
        self.pin_memory = pin_memory
        self.pin_device_id = pin_device_id
        # MDNC's default; converter threads only run for CUDA output (host batches are
        # mapped in the consumer's thread).
        self.num_converters = num_converters or max(num_workers // 4, min(num_workers, 4), 1)
        self.epoch = 0                   # the epoch the next iteration starts
        self._resume_at = 0               # ... at this batch (set by load_state_dict)
        self._last = (-1, 0)              # (epoch, batches delivered) of the last iteration
        self._runtime = None
        self._restart = None
        self._closer = None
        self._stats = LoaderStats()

    def _make_plan(self, dset_size, batch_size, shuffle, last_batch, rank, world_size):
        rank, world_size = _distributed_defaults(rank, world_size)
        return EpochPlan(as_index_array(dset_size), batch_size, shuffle=bool(shuffle),
                         seed=self.seed, last_batch=last_batch, rank=rank, world_size=world_size)

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

    def __len__(self) -> int:
        """Batches in the epoch the next iteration yields (with rollover, epochs differ)."""
        return self._plan.length(self.epoch) - self._resume_at

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
        """Start the workers (and, for CUDA output, the converters); interrupts a running pipeline first.

        ``compat`` is accepted for MDNC compatibility: converters are threads in every mode.
        """
        return self._run(lambda: _Pipeline(self) if self.num_workers else _Inline(self, "default"),
                         lambda: self.start(compat))

    def start_test(self, test_mode: str = "default") -> "ShmSequence":
        """Run everything in the calling thread, with the same batches as ``start()``.

        ``'default'``: delivered as ``start()`` would; ``'cpu'``: torch CPU tensors even if
        ``out_type`` is CUDA; ``'numpy'``: the worker's output untouched.
        """
        _check_choice("test_mode", test_mode, TEST_MODES)
        return self._run(lambda: _Inline(self, test_mode), lambda: self.start_test(test_mode))

    def _run(self, make_runtime, restart) -> "ShmSequence":
        self.finish()
        runtime = make_runtime()
        self._runtime, self._restart = runtime, restart
        self._stats = getattr(runtime, "stats", LoaderStats())
        self._closer = weakref.finalize(self, runtime.close)
        return self

    def finish(self) -> None:
        """Stop every worker and thread and free the ring. Safe to call at any time."""
        if self._closer is not None:
            self._closer()
        self._runtime = self._closer = None

    def __enter__(self) -> "ShmSequence":
        if self._runtime is None:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()

    def __iter__(self):
        """One epoch; the next iteration is the next epoch (``break`` leaves the rest)."""
        if self._runtime is None:
            raise RuntimeError("the sequence is not running: call start() or start_test() "
                               "(or use it in a with-block) before iterating")
        epoch, position = self.epoch, self._resume_at
        if not self._runtime.can_serve(self._plan.start(epoch) + position):
            self._restart()  # asked to go back before batches already consumed
        self.epoch, self._resume_at, self._last = epoch + 1, 0, (epoch, position)
        return self._guarded(self._runtime, epoch, position)

    def _guarded(self, runtime, epoch: int, position: int):
        """Track the position; shut the pipeline down when an error or Ctrl-C leaves an epoch."""
        try:
            for delivered, batch in enumerate(runtime.batches(epoch, position), position + 1):
                self._last = (epoch, delivered)
                yield batch
                del batch
        except GeneratorExit:
            raise
        except BaseException:
            if self._runtime is runtime:
                self.finish()
            raise

    # -- resuming -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (as ``DistributedSampler.set_epoch``)."""
        _check_int("epoch", epoch, 0)
        self.epoch, self._resume_at = int(epoch), 0

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
        """Resume from ``state_dict()``: the next iteration continues that epoch where it was."""
        mine = self.state_dict()
        for key in ("batch_size", "dset_size", "last_batch", "rank", "world_size"):
            if state.get(key, mine[key]) != mine[key]:
                raise ValueError(f"state {key}={state[key]!r} does not match this sequence's "
                                 f"{key}={mine[key]!r}: build the sequence as the saved one was")
        self.seed = self._plan.seed = int(state["seed"])
        self.epoch, self._resume_at = int(state["epoch"]), int(state["position"])
        self._last = (-1, 0)
        if self._runtime is not None:
            self._restart()  # batches in flight were planned with the old position


def _distributed_defaults(rank, world_size) -> tuple[int, int]:
    """Explicit values win; else torch.distributed's when it is initialized; else one rank."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch_available():
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return (dist.get_rank() if rank is None else rank,
                    dist.get_world_size() if world_size is None else world_size)
    return rank or 0, world_size or 1


def _remainder(plan, epoch: int) -> list[int]:
    """The samples an epoch inherits from the previous ones (rollover), for the record."""
    if getattr(plan, "last_batch", None) != "rollover" or not plan.samples_per_epoch:
        return []
    carried = epoch * plan.samples_per_epoch - plan.start(epoch) * plan.batch_size
    return plan.batches(epoch)[0][:carried].tolist() if carried and plan.length(epoch) else []


class _Pipeline:
    """The running machinery of a started sequence."""

    def __init__(self, seq: ShmSequence):
        self.plan = seq._plan
        self.timeout = seq.timeout
        self.device = make_device(seq.out_type, seq.pin_memory, seq.pin_device_id)
        self.output = OrderedOutput(on_drop=self._discard)
        self.consumed_to = self.plan.start(seq.epoch) + seq._resume_at
        self.stream = BatchStream(self.plan, start_seq=self.consumed_to)
        middle = DirectHandOver(self.output) if self.device.keeps_slot else queue.SimpleQueue()
        self.stats = LoaderStats()
        context = multiprocessing.get_context(seq.start_method)
        self.pool = WorkerPool(seq.worker, num_workers=seq.num_workers, backend=seq.thread_type,
                               context=context, stream=self.stream, n_slots=seq.buffer,
                               slot_bytes=seq.slot_bytes, deliver=middle.put, stats=self.stats,
                               seed=seq.seed, worker_init_fn=seq.worker_init_fn)
        self.converters = (None if self.device.keeps_slot else
                           Converters(seq.num_converters, middle, self.output, self.pool, self.device))
        self._warned: set[str] = set()
        try:
            self.pool.start(seq.timeout)
            if self.pool.ring is not None:
                self.device.attach(self.pool.ring)
            if self.converters is not None:
                self.converters.start()
        except BaseException:
            self.close()
            raise

    def can_serve(self, seq: int) -> bool:
        """Batches before ``consumed_to`` were handed over (or skipped): they are gone."""
        return seq >= self.consumed_to

    def batches(self, epoch: int, position: int = 0):
        start = self.plan.start(epoch)
        self.plan.forget_before(epoch)
        self.pool.seek(start + position)
        self.output.drop_below(start + position)
        for seq in range(start + position, start + self.plan.length(epoch)):
            self.consumed_to = seq + 1
            yield self._hand_over(seq, self._take(seq))

    def _discard(self, item) -> None:
        """An item dropped unread: a raw batch still owns its slot (a Delivery's lease frees it)."""
        if type(item) is tuple and item[1] is not None:
            self.pool.release(item[1])

    def _take(self, seq: int) -> Delivery:
        """Drive the pool until batch ``seq`` is out (or ``timeout`` passes)."""
        began = time.perf_counter()
        deadline = began + self.timeout
        while (item := self.output.pop(seq)) is MISSING:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                self._timed_out(seq)
            self.pool.pump(remaining)
        self.stats.consumer_wait_s += time.perf_counter() - began
        if type(item) is tuple:  # straight from the workers: map the slot here
            item, _ = to_delivery(*item, self.pool.ring, self.device)
        if isinstance(item, BaseException):
            raise item
        return item

    def _timed_out(self, seq: int):
        epoch, position = self.plan.locate(seq)
        raise BatchTimeout(
            f"batch {position} of epoch {epoch} (sample indices "
            f"{self.stream.indices_of(seq).tolist()}) did not arrive within timeout="
            f"{self.timeout} s; it is with {self.pool.holder_of(seq)}")

    def _hand_over(self, seq: int, delivery: Delivery):
        ring = self.pool.ring
        self.stats.batches += 1
        self.stats.bytes += delivery.nbytes
        if delivery.payload_bytes:
            self.stats.overflow_count += 1
            self._warn_once("overflow", (
                f"batch {seq} needed {delivery.payload_bytes:,} bytes but slot_bytes is "
                f"{ring.spec.slot_bytes:,}: it came through the overflow path, with a copy. "
                f"Pass slot_bytes={slot_bytes_for(delivery.payload_bytes)} (or more) to keep "
                "every batch in the ring"))
        if delivery.slot is None:
            return self.device.hand_over(delivery.batch, delivery.completion)
        if ring.held_count() + 1 >= ring.spec.n_slots:
            self._warn_once("copy-out", (
                f"the consumer holds {ring.held_count()} earlier batches of a ring of "
                f"{ring.spec.n_slots} slots, so handing over this one in place would leave the "
                "workers no free slot: batches are copied out of the ring instead. Raise buffer, "
                "or drop references to earlier batches, to stay zero-copy"))
            self.stats.copy_out_count += 1
            copied, _ = self.device.convert(map_arrays(delivery.views, np.copy))
            return copied
        ring.held[delivery.slot] = True
        return delivery.batch

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_user(message)

    def close(self) -> None:
        """Converters first, then the copies in flight, the device, and last the workers and ring."""
        self.output.fail(PipelineClosed("the sequence was finished or restarted while iterating"))
        if self.converters is not None:
            self.converters.stop(JOIN_SECONDS)
        self.device.close()
        self.pool.stop()


class _Inline:
    """Everything in the calling thread: ``start_test()`` and ``num_workers=0``."""

    def __init__(self, seq: ShmSequence, test_mode: str):
        self.plan = seq._plan
        self.worker_obj = make_worker(seq.worker)
        self.test_mode = test_mode
        out_type = "cpu" if test_mode == "cpu" and seq.use_cuda else seq.out_type
        self.device = make_device(out_type, pin_memory=False)

    def can_serve(self, seq: int) -> bool:
        return True

    def batches(self, epoch: int, position: int = 0):
        self.plan.forget_before(epoch)
        for indices in self.plan.batches(epoch)[position:]:
            batch, _ = build_batch(self.worker_obj, indices, None)
            if self.test_mode != "numpy":
                # Through the slot format, so that types and layout match start() exactly.
                batch = self.device.hand_over(*self.device.convert(read_batch(encode_batch(batch))))
            yield batch

    def close(self) -> None:
        self.worker_obj = None
        self.device.close()
