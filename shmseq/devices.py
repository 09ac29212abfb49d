"""Where batches are delivered: the device interface and its implementations.

A device turns a batch of numpy views of a slot into what the consumer gets:

``attach(ring)``        once the ring exists (page-lock it)
``leaf``                ``leaf(dtype)``: what makes each view of that dtype what the consumer
                        gets as a batch is read from its slot (a torch tensor of it), or None
                        (the leaf itself None: numpy views)
``convert(views)``      -> (batch, copy): ``copy`` is None when the batch *is* the views
                        (host output: a copy that completes at once), else the device copy
                        still reading the slot, which stays busy until ``wait(copy)`` returns
``hand_over(batch, c)`` in the consumer's thread, just before the batch is yielded
``wait(copy)``          block until ``copy`` no longer reads the slot (the releaser's thread)
``close()``             after the last copy completed, before the ring is unmapped

A device that page-locks the ring also sets ``ring.fence`` at ``attach``: called when the
last view of a batch dies, it returns a completion (a callable that blocks until done) for
the copies the consumer may have enqueued from the slot: a ``non_blocking`` copy from
page-locked memory still reads the slot after the view is gone.

* ``HostDevice``: numpy views or ``torch.from_numpy`` tensors, zero-copy; page-locked in
  place when a pinning device is given (MXNet's ``pin_memory``), with a CUDA event recorded
  on that device's current stream as each batch's fence.
* ``CudaDevice``: the whole ring page-locked in place (``cudaHostRegister``), each batch
  copied on one of ``num_converters`` streams, an event per batch.
* ``FakeDevice``, ``FakePinnedDevice``, ``FakeStream``: for tests without a GPU. Copies
  run late, on another thread, after random delays, reading raw addresses as a DMA engine
  does, so a slot reused too early shows up as a torn batch.
"""
from __future__ import annotations

import ctypes
import itertools
import queue
import random
import threading
import time

import numpy as np

from .errors import ShmSeqError, warn_user
from .layout import iter_arrays, map_arrays

OUT_TYPES = ("null", "cpu", "cuda")


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    if not torch_available():
        return False
    import torch
    return torch.cuda.is_available()


def resolve_out_type(out_type: str) -> str:
    """The out_type actually served: 'cuda' without CUDA falls back with a warning."""
    if not out_type.startswith("cuda"):
        if out_type == "cpu" and not torch_available():
            raise ImportError("out_type='cpu' delivers torch tensors, but torch is not installed: "
                              "install torch, or use out_type='null' for numpy arrays")
        return out_type
    if not torch_available():
        warn_user(f"out_type={out_type!r} needs torch, which is not installed: "
                  "delivering numpy arrays (out_type='null') instead")
        return "null"
    if not cuda_available():
        warn_user(f"out_type={out_type!r} but CUDA is not available: delivering CPU tensors "
                  "(out_type='cpu') instead")
        return "cpu"
    return out_type


def torch_leaf(dtype: np.dtype):
    """What makes a view of ``dtype`` a tensor sharing its memory; None where torch lacks the
    dtype (strings, structured): those stay numpy arrays. Torch holds native byte order only:
    other orders become a copy, in native order."""
    import torch
    native = dtype.newbyteorder("=")
    try:
        torch.from_numpy(np.empty(0, native))
    except TypeError:
        return None
    if dtype.isnative:
        return torch.from_numpy
    return lambda view: torch.from_numpy(view.astype(native))


class PageLock:
    """The ring registered with CUDA in place (never ``pin_memory()``, which copies)."""

    def __init__(self, ring, device_index: int):
        import torch
        self.torch = torch
        self.device_index = device_index
        self.cudart = torch.cuda.cudart()
        self.address = ring.address
        ring.wait_reserved()  # registering faults in every page: have them allocated, checked, first
        with torch.cuda.device(device_index):
            error = self.cudart.cudaHostRegister(self.address, ring.spec.total_bytes, 0)
        if int(error) != 0:
            raise ShmSeqError(f"cudaHostRegister of the {ring.spec.total_bytes:,}-byte ring failed "
                              f"with CUDA error {int(error)}: lower buffer or slot_bytes, or raise "
                              "the locked-memory limit (ulimit -l)")

    def fence(self):
        """An event after everything enqueued so far on the device's current stream."""
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self.device_index))
        return event.synchronize

    def release(self) -> None:
        """Unregister once no copy can still read the ring."""
        self.torch.cuda.synchronize(self.device_index)
        self.cudart.cudaHostUnregister(self.address)


class HostDevice:
    """Batches as views of their slot: numpy arrays, or torch CPU tensors sharing the memory."""

    def __init__(self, to_torch: bool, pin_device: int | None = None):
        self.to_torch = to_torch
        self.leaf = torch_leaf if to_torch else None  # views made tensors as they are read
        self.pin_device = pin_device
        self._lock: PageLock | None = None

    def attach(self, ring) -> None:
        if self.pin_device is not None:
            self._lock = PageLock(ring, self.pin_device)
            ring.fence = self._lock.fence

    def convert(self, views):
        return views, None  # already as delivered: read through ``leaf``

    def hand_over(self, batch, copy):
        return batch

    def wait(self, copy) -> None:
        pass

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


class CudaDevice:
    """Copies each batch to the GPU on one of its own streams; an event marks the end."""

    leaf = staticmethod(torch_leaf)  # read as tensors of the slot, then copied

    def __init__(self, device: str, num_streams: int = 1):
        import torch
        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._streams = itertools.cycle([torch.cuda.Stream(self.device) for _ in range(num_streams)])
        self._lock: PageLock | None = None

    def attach(self, ring) -> None:
        self._lock = PageLock(ring, self.device.index)

    def convert(self, views):
        torch = self.torch
        stream = next(self._streams)
        with torch.cuda.stream(stream):
            batch = map_arrays(views, self._copy, (np.ndarray, torch.Tensor))
            event = torch.cuda.Event()
            event.record(stream)
        return batch, event

    def _copy(self, leaf):
        if isinstance(leaf, np.ndarray):
            return leaf.copy()  # strings and the like stay on the host, off the slot
        return leaf.to(self.device, non_blocking=True)

    def hand_over(self, batch, event):
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in iter_arrays(batch, self.torch.Tensor):
            tensor.record_stream(current)  # the allocator must not reuse it under the consumer
        return batch

    def wait(self, event) -> None:
        event.synchronize()

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def make_device(out_type: str, pin_memory: bool | None = None, pin_device_id: int = 0,
                num_streams: int = 1):
    if out_type.startswith("cuda"):
        return CudaDevice(out_type, num_streams)
    if pin_memory is None:
        pin_memory = out_type == "cpu" and cuda_available()
    elif pin_memory and not cuda_available():
        warn_user("pin_memory=True but CUDA is not available: delivering pageable memory")
        pin_memory = False
    return HostDevice(to_torch=out_type == "cpu", pin_device=pin_device_id if pin_memory else None)


# -- fakes, for tests without a GPU -------------------------------------------------------------
class FakeEvent:
    """Completion of fake copies; carries the error that ``wait`` raises, if any."""

    def __init__(self, error: BaseException | None = None):
        self.done = threading.Event()
        self.error = error
        self.copy_failed = False

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class FakeStream:
    """A stream of a fake GPU: copies by raw address and events, run in order on a thread of
    its own, each copy after a random delay.

    As with CUDA, only a copy from page-locked memory (``register``) is asynchronous; one
    from pageable memory is done before ``copy`` returns."""

    def __init__(self, max_delay: float = 0.01, seed: int = 0):
        self.max_delay = max_delay
        self._random = random.Random(seed)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._locked: list[tuple[int, int]] = []

    def register(self, address: int, nbytes: int) -> None:
        self._locked.append((address, address + nbytes))

    def _put(self, job) -> None:
        if self._thread is None:  # started at first use: after the workers were forked
            self._thread = threading.Thread(target=self._run, name="shmseq-fake-stream",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def copy(self, source: np.ndarray) -> np.ndarray:
        """``source.cuda(non_blocking=True)``: a copy from page-locked memory reads it later."""
        target = np.empty_like(source)
        start = source.ctypes.data
        if any(low <= start and start + source.nbytes <= high for low, high in self._locked):
            self._put((target, start, source.nbytes))  # the device's memory, the source's address
        else:
            target[...] = source
        return target

    def record(self, error: BaseException | None = None) -> FakeEvent:
        event = FakeEvent(error)
        self._put(event)
        return event

    def synchronize(self) -> None:
        self.record().wait()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, FakeEvent):
                job.done.set()
                continue
            time.sleep(self._random.uniform(0, self.max_delay))
            target, source, nbytes = job
            ctypes.memmove(target.ctypes.data, source, nbytes)
            del job, target

    def close(self) -> None:
        """Stop once every job enqueued has run."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class FakeDevice:
    """A copying device (as CUDA) on a ``FakeStream``: copies complete late, on its thread.

    ``fail_on(views)``: that batch's copy fails (raised at hand-over); ``fail_wait_on(views)``:
    waiting for that copy fails (a sticky error, seen by the releaser)."""

    leaf = None

    def __init__(self, max_delay: float = 0.01, seed: int = 0, fail_on=None, fail_wait_on=None):
        self.stream = FakeStream(max_delay, seed)
        self.fail_on = fail_on
        self.fail_wait_on = fail_wait_on
        self.attached_ring = None

    def attach(self, ring) -> None:
        self.attached_ring = ring.spec
        self.stream.register(ring.address, ring.spec.total_bytes)

    def convert(self, views):
        failed = self.fail_on is not None and self.fail_on(views)
        targets = map_arrays(views, np.empty_like if failed else self.stream.copy)
        stuck = self.fail_wait_on is not None and self.fail_wait_on(views)
        event = self.stream.record(RuntimeError("fake wait failed") if stuck else None)
        event.copy_failed = failed
        return targets, event

    def hand_over(self, batch, event):
        event.done.wait()  # the consumer's stream waits on the copy's event
        if event.copy_failed:
            raise ShmSeqError("copying a batch to the device failed: fake copy failed")
        return batch

    def wait(self, event) -> None:
        event.wait()

    def close(self) -> None:
        self.stream.close()


class FakePinnedDevice(HostDevice):
    """Host views of page-locked slots, with the consumer's copies on a fake current stream:
    ``stream.copy(view)`` is the user's ``view.cuda(non_blocking=True)``."""

    def __init__(self, stream: FakeStream):
        super().__init__(to_torch=False)
        self.stream = stream

    def attach(self, ring) -> None:
        self.stream.register(ring.address, ring.spec.total_bytes)
        ring.fence = self.fence

    def fence(self):
        return self.stream.record().wait
