"""Workers (processes or threads) and the manager thread that feeds them.

One batch's trip through this module:

1. The manager thread takes a free slot and the next ``(seq, indices)`` of the
   stream, and sends ``(seq, slot, indices)`` down the least-busy worker's task pipe.
2. The worker calls ``worker_obj[indices]`` (or ``worker_obj.fill_batch(indices, out)``)
   and writes the batch into the slot (``layout.write_batch``).
3. It sends back ``("done", seq, slot, size, seconds)``: only ids travel, never the payload.
4. The manager puts ``(seq, slot, None)`` on the middle queue for the converters.

A batch too large for its slot comes back encoded in the message instead (the
overflow path). The manager also watches every worker process's sentinel, so a
worker that dies is reported at once, as ``concurrent.futures`` and ``loky`` do.
"""
from __future__ import annotations

import os
import pickle
import queue
import random
import selectors
import signal
import sys
import threading
import time
import traceback
from multiprocessing import connection
from typing import NamedTuple

import numpy as np

from .errors import ShmSeqError, WorkerDied, WorkerError, warn_user
from .layout import SlotAllocator, SlotOverflow, encode_batch, write_batch
from .plan import BatchStream
from .ring import PAGE, Ring, RingSpec
from .stats import LoaderStats

PARENT_POLL_SECONDS = 0.5
JOIN_SECONDS = 3.0
SLOT_HEADROOM = 1.25


def slot_bytes_for(needed: int) -> int:
    """A slot size for batches of about ``needed`` bytes: headroom, rounded to pages."""
    return -(-int(needed * SLOT_HEADROOM) // PAGE) * PAGE


def make_worker(worker):
    """MDNC's convention: a class is instantiated in each worker, an instance is used as is."""
    return worker() if isinstance(worker, type) else worker


def build_batch(worker_obj, indices: np.ndarray, region: np.ndarray | None):
    """Call the user's worker; in-place workers get an allocator over the slot."""
    fill = getattr(worker_obj, "fill_batch", None)
    if fill is None:
        return worker_obj[indices], None
    allocator = SlotAllocator(region)
    return fill(indices, allocator), allocator


def describe_exception(exc: BaseException) -> tuple:
    """What crosses back to the consumer about a failure: type, message, traceback, the object."""
    try:
        pickled = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text below still tells the story
        pickled = None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text, pickled)


def worker_error(info: tuple, *, indices=None, seq=None, what: str) -> WorkerError:
    exc_type, exc_message, text, pickled = info
    error = WorkerError(f"{what}: {exc_type}: {exc_message}\n\nWorker traceback:\n{text}",
                        exc_type=exc_type, exc_message=exc_message, worker_traceback=text,
                        batch_indices=indices, seq=seq)
    if pickled is not None:
        try:
            error.__cause__ = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - the cause is a courtesy
            pass
    return error


def _run_task(worker_obj, ring: Ring | None, seq: int, slot: int | None, indices: np.ndarray):
    """Build and write one batch; the reply carries its size and the time it took."""
    began = time.perf_counter()
    region = ring.region(slot) if slot is not None else None
    try:
        batch, allocator = build_batch(worker_obj, indices, region)
        if region is not None:
            try:
                size = write_batch(batch, region, allocator)
                return ("done", seq, slot, size, time.perf_counter() - began)
            except SlotOverflow:
                pass
        payload = encode_batch(batch)
        return ("overflow", seq, slot, payload, time.perf_counter() - began)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        return ("error", seq, slot, describe_exception(exc))


def _parent_alive(parent_pid: int | None) -> bool:
    """Whether the consumer still runs (its pid exists and is no zombie).

    Not ``getppid()`` alone: under forkserver a worker's parent is the fork server.
    """
    if parent_pid is None or os.getppid() == parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class WorkerInfo(NamedTuple):
    """What ``get_worker_info()`` tells the code running inside a worker."""
    id: int
    num_workers: int
    seed: int


_current = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """The calling worker's id, the number of workers and its seed; None outside workers."""
    return getattr(_current, "info", None)


def worker_seed(base_seed: int, wid: int) -> int:
    """A reproducible seed of its own for each worker."""
    return int(np.random.SeedSequence([base_seed, wid]).generate_state(1, np.uint64)[0])


def _set_up(info: WorkerInfo, in_process: bool, worker_init_fn) -> None:
    """Seed the worker's random generators, then run the user's hook.

    Only processes seed the global generators (``random``, numpy's, torch's): threads
    share them, and read their own seed from ``get_worker_info()`` instead.
    """
    _current.info = info
    if in_process:
        random.seed(info.seed)
        np.random.seed(info.seed % 2**32)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.manual_seed(info.seed)
    if worker_init_fn is not None:
        worker_init_fn(info.id)


def pack_indices(indices) -> bytes | list[bytes]:
    """Indices as raw bytes for the task pipe (a list of arrays for multi-shard batches)."""
    if isinstance(indices, list):
        return [part.tobytes() for part in indices]
    return indices.tobytes()


def unpack_indices(packed) -> np.ndarray | list[np.ndarray]:
    if isinstance(packed, list):
        return [np.frombuffer(part, np.int64).copy() for part in packed]
    return np.frombuffer(packed, np.int64).copy()


def worker_loop(worker, tasks, results, info: WorkerInfo, worker_init_fn, attach,
                parent_pid: int | None) -> None:
    """The body of a worker, process or thread. ``parent_pid`` is set in processes."""
    if parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    try:
        _set_up(info, parent_pid is not None, worker_init_fn)
        worker_obj = make_worker(worker)
    except BaseException as exc:  # noqa: BLE001
        results.send(("init_error", info.id, describe_exception(exc)))
        return
    ring = None
    try:
        while True:
            while not tasks.poll(PARENT_POLL_SECONDS):
                if not _parent_alive(parent_pid):
                    return
            message = tasks.recv()
            if message is None:
                return
            if message[0] == "ring":
                ring = attach(message[1])
                results.send(("attached", info.id))
            else:
                seq, slot, indices = message
                results.send(_run_task(worker_obj, ring, seq, slot, unpack_indices(indices)))
    except (EOFError, OSError):
        return  # the consumer closed the pipes: it is shutting down


class _WorkerHandle:
    """One worker as the manager sees it: its pipes, its process or thread, its open tasks."""

    def __init__(self, wid: int, tasks, results, runner):
        self.wid = wid
        self.tasks = tasks
        self.results = results
        self.runner = runner
        self.open: dict[int, np.ndarray] = {}  # seq -> indices
        self.attached = False
        self.accepting = True

    @property
    def pid(self):
        return getattr(self.runner, "pid", None)

    @property
    def sentinel(self):
        return getattr(self.runner, "sentinel", None)


class WorkerPool:
    """Starts the workers and runs the manager thread (dispatch, collect, watch)."""

    def __init__(self, worker, *, num_workers: int, backend: str, context, stream: BatchStream,
                 n_slots: int, slot_bytes: int | None, middle: queue.SimpleQueue, on_fatal,
                 stats: LoaderStats, seed: int = 0, worker_init_fn=None):
        self.stream = stream
        self.stats = stats
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.middle = middle
        self.on_fatal = on_fatal
        self.ring: Ring | None = None
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self._free: list[int] = []
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._seek: queue.SimpleQueue = queue.SimpleQueue()
        self._probe_open = False
        self._idle = True
        self._stopping = False
        self._wake_reader, self._wake_writer = connection.Pipe(duplex=False)
        os.set_blocking(self._wake_writer.fileno(), False)
        if backend == "proc":
            _check_picklable(worker, context.get_start_method())
        self._workers = [
            self._spawn(worker, WorkerInfo(wid, num_workers, worker_seed(seed, wid)), backend,
                        context, worker_init_fn)
            for wid in range(num_workers)]
        self._manager = threading.Thread(target=self._manage, name="shmseq-manager", daemon=True)

    # -- start -------------------------------------------------------------------------------
    def _spawn(self, worker, info: WorkerInfo, backend: str, context, worker_init_fn) -> _WorkerHandle:
        task_reader, task_writer = connection.Pipe(duplex=False)
        result_reader, result_writer = connection.Pipe(duplex=False)
        common = (worker, task_reader, result_writer, info, worker_init_fn)
        if backend == "thread":
            runner = threading.Thread(target=worker_loop, name=f"shmseq-worker-{info.id}",
                                      daemon=True, args=(*common, self._local_ring, None))
        else:
            runner = context.Process(target=worker_loop, name=f"shmseq-worker-{info.id}",
                                     daemon=True, args=(*common, Ring.attach, os.getpid()))
        handle = _WorkerHandle(info.id, task_writer, result_reader, runner)
        runner.start()
        if backend != "thread":
            task_reader.close()
            result_writer.close()
        return handle

    def _local_ring(self, spec: RingSpec) -> Ring:
        return self.ring

    def start(self, timeout: float) -> None:
        """Create the ring (now, or after a probe batch sizes it) and wait for every worker to map it."""
        if self.slot_bytes is not None and self.stream:
            self._open_ring(self.slot_bytes)
        self._manager.start()
        if not self.ready.wait(timeout):
            raise ShmSeqError(f"the workers did not start within timeout={timeout} s")
        if self.failure is not None:
            raise self.failure

    def _open_ring(self, slot_bytes: int) -> None:
        self.ring = Ring.create(self.n_slots, slot_bytes)
        self.ring.on_release = self.release
        self._free = list(range(self.n_slots))
        for handle in self._workers:
            self._send(handle, ("ring", self.ring.spec))

    # -- slot release (any thread, from a lease finalizer: no locks) ----------------------------
    def release(self, slot: int) -> None:
        self._released.put(slot)
        if self._idle:  # else the next worker reply wakes the manager anyway
            self._wake()

    def seek(self, seq: int) -> None:
        """Skip the stream forward to ``seq`` (the consumer left an epoch early)."""
        self._seek.put(seq)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_writer.send_bytes(b"")
        except (BlockingIOError, OSError):
            pass  # already woken, or shut down

    # -- the manager thread --------------------------------------------------------------------
    def _manage(self) -> None:
        try:
            if not self.stream:
                self.ready.set()
            with self._watch() as selector:
                while not self._stopping:
                    self._apply_seeks_and_releases()
                    self._dispatch()
                    # A freed slot must wake us only while some worker has nothing to do.
                    self._idle = any(not h.open for h in self._workers if h.accepting)
                    if not (self._idle and not self._released.empty()):
                        self._wait_and_handle(selector)
        except BaseException as exc:  # noqa: BLE001 - reported to the consumer
            self.failure = exc
            self.ready.set()
            self.on_fatal(exc)

    def _apply_seeks_and_releases(self) -> None:
        while not self._seek.empty():
            self.stream.seek(self._seek.get())
        while not self._released.empty():
            self._free.append(self._released.get())

    def _dispatch(self) -> None:
        if not self.stream:
            return
        if self.ring is None:
            if not self._probe_open:
                self._probe_open = True
                self._send_task(None)
            return
        while self._free:
            self._send_task(self._free.pop())

    def _send_task(self, slot: int | None) -> None:
        live = [h for h in self._workers if h.accepting]
        if not live:
            return  # every worker is gone: their sentinels report why
        seq, indices = self.stream.take()
        handle = min(live, key=lambda h: len(h.open))
        handle.open[seq] = indices
        self._send(handle, (seq, slot, pack_indices(indices)))

    @staticmethod
    def _send(handle: _WorkerHandle, message) -> None:
        try:
            handle.tasks.send(message)
        except OSError:
            handle.accepting = False  # it died: its sentinel (or last message) tells why

    def _watch(self) -> selectors.BaseSelector:
        """One selector for the whole run: result pipes, process sentinels, the wake-up pipe."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_reader, selectors.EVENT_READ, None)
        for handle in self._workers:
            if handle.results is not None:
                selector.register(handle.results, selectors.EVENT_READ, (self._receive, handle))
            if handle.sentinel is not None:
                selector.register(handle.sentinel, selectors.EVENT_READ, (self._report_death, handle))
        return selector

    def _wait_and_handle(self, selector: selectors.BaseSelector) -> None:
        for key, _ in selector.select(timeout=1.0):
            if key.data is None:
                while self._wake_reader.poll():
                    self._wake_reader.recv_bytes()
            elif not self._stopping:
                handler, handle = key.data
                handler(handle, selector)

    def _receive(self, handle: _WorkerHandle, selector: selectors.BaseSelector) -> None:
        """Every reply the worker has sent so far."""
        try:
            while handle.results.poll():
                self._handle(handle, handle.results.recv())
        except (EOFError, OSError):
            selector.unregister(handle.results)
            handle.results = None  # a dying process: its sentinel tells how

    def _handle(self, handle: _WorkerHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "done":
            _, seq, slot, size, busy = message
            handle.open.pop(seq, None)
            self.stats.worker_busy_s += busy
            self.middle.put((seq, slot, None))
        elif kind == "overflow":
            self._overflowed(handle, *message[1:])
        elif kind == "error":
            _, seq, slot, info = message
            indices = handle.open.pop(seq, None)
            error = worker_error(info, indices=indices, seq=seq, what=(
                f"worker {handle.wid} failed on batch {seq} (sample indices {_brief(indices)})"))
            if slot is None:
                raise error  # the probe failed: the ring cannot be sized, start() reports it
            self._give_back(slot)
            self.middle.put((seq, None, error))
        elif kind == "attached":
            handle.attached = True
            if all(h.attached for h in self._workers):
                self.ring.unlink()  # every worker maps it: nothing can leak from now on
                self.ready.set()
        elif kind == "init_error":
            raise worker_error(message[2], what=f"worker {handle.wid} failed to start")

    def _overflowed(self, handle: _WorkerHandle, seq: int, slot: int | None, payload,
                    busy: float) -> None:
        handle.open.pop(seq, None)
        self.stats.worker_busy_s += busy
        if slot is None:  # the probe that sizes the ring: its batch goes into the first slot
            self._probe_open = False
            self._open_ring(slot_bytes_for(len(payload)))
            slot = self._free.pop()
            self.ring.region(slot)[:len(payload)] = payload
            self.middle.put((seq, slot, None))
        else:
            self._give_back(slot)
            self.middle.put((seq, None, payload))

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    def _report_death(self, handle: _WorkerHandle, selector: selectors.BaseSelector) -> None:
        while handle.results is not None and handle.results.poll():
            self._receive(handle, selector)  # its last words (an init error) explain more
        handle.runner.join(JOIN_SECONDS)  # its sentinel closed: the exit status follows at once
        code = handle.runner.exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        message = f"worker {handle.wid} (pid {handle.pid}) {how}"
        if handle.open:  # a worker takes its tasks in order: the first one was in progress
            current, *queued = sorted(handle.open)
            message += (f" while building batch {current} (sample indices "
                        f"{_brief(handle.open[current])})")
            if queued:
                message += f"; batches {', '.join(map(str, queued))} were queued for it"
        raise WorkerDied(message, pid=handle.pid, exitcode=code)

    def holder_of(self, seq: int) -> str:
        """Which worker is building ``seq``, for timeout messages."""
        for handle in self._workers:
            if seq in handle.open:
                return f"worker {handle.wid}" + (f" (pid {handle.pid})" if handle.pid else "")
        return "no worker (it was never dispatched: the ring has no free slot)"

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the manager and the workers, then free the ring. Safe to call twice."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        if self._manager.is_alive():
            self._manager.join(JOIN_SECONDS)
        for handle in self._workers:
            self._send(handle, None)
        self._drain_until_exited(time.monotonic() + JOIN_SECONDS)
        for handle in self._workers:
            handle.tasks.close()
            if handle.results is not None:
                handle.results.close()
            self._end(handle)
        self._wake_reader.close()
        self._wake_writer.close()
        if self.ring is not None:
            self.ring.unlink()
            self.ring.close()

    def _drain_until_exited(self, deadline: float) -> None:
        """Read and drop late results, so that no worker blocks on a full pipe while leaving."""
        with self._watch() as selector:
            while self._still_running(selector) and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=0.01):
                    handle = key.data[1] if key.data else None
                    if handle is None or key.fileobj is not handle.results:
                        selector.unregister(key.fileobj)  # the wake-up pipe, or an exit
                        continue
                    try:
                        handle.results.recv_bytes()
                    except (EOFError, OSError):
                        selector.unregister(handle.results)

    def _still_running(self, selector: selectors.BaseSelector) -> bool:
        """Processes until their sentinel fired (it stays registered until then); live threads."""
        registered = selector.get_map()
        return any(h.runner.is_alive() if h.sentinel is None else h.sentinel in registered
                   for h in self._workers)

    @staticmethod
    def _end(handle: _WorkerHandle) -> None:
        """Kill a process that did not leave in time; a thread cannot be killed, so say so."""
        if isinstance(handle.runner, threading.Thread):
            if handle.runner.is_alive():
                warn_user(f"worker thread {handle.wid} is still inside the worker's code after "
                          f"{JOIN_SECONDS} s and cannot be stopped: it is left to finish alone")
            return
        if handle.runner.is_alive():
            handle.runner.kill()
        handle.runner.join(JOIN_SECONDS)
        handle.runner.close()


def _check_picklable(worker, start_method: str) -> None:
    if start_method == "fork":
        return
    try:
        pickle.dumps(worker)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same fix
        raise TypeError(
            f"worker {worker!r} cannot be pickled, which start_method={start_method!r} needs "
            f"({type(exc).__name__}: {exc}): define it at module level, or use "
            "start_method='fork' or thread_type='thread'") from exc


def _brief(indices) -> str:
    if indices is None:
        return "unknown"
    return np.array2string(np.asarray(indices), threshold=12, separator=", ")
