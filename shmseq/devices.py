"""Where batches are delivered: the device interface and its implementations.

A device turns a batch of numpy views of a slot into what the consumer gets:

``attach(ring)``        once the ring exists (page-lock it for CUDA)
``convert(views)``      -> (batch, completion): ``completion`` is None when the batch
                        is ready now, else the copy still runs and the slot must stay
                        leased until ``wait(completion)`` returns
``hand_over(batch, c)`` in the consumer's thread, just before the batch is yielded
``close()``             after the last copy completed, before the ring is unmapped

``keeps_slot``: whether delivered batches are views of the slot (host devices) or
copies (CUDA, fake), after which the slot is free again.

* ``HostDevice``: numpy views or ``torch.from_numpy`` tensors, page-locked in place
  when a pinning device is given (MXNet's ``pin_memory``), zero-copy.
* ``CudaDevice``: the whole ring page-locked in place (``cudaHostRegister``), each
  converter thread copying on its own stream, an event per batch.
* ``FakeDevice``: for tests without a GPU: copies complete late, on another thread,
  after random delays, so a slot reused too early shows up as a torn batch.
"""
from __future__ import annotations

import ctypes
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


def _to_torch(array: np.ndarray):
    import torch
    try:
        return torch.from_numpy(array)
    except TypeError:  # a dtype torch lacks (strings, structured): stays a numpy array
        return array


class PageLock:
    """The ring registered with CUDA in place (never ``pin_memory()``, which copies)."""

    def __init__(self, ring, device_index: int):
        import torch
        self.cudart = torch.cuda.cudart()
        self.address = ring.address
        with torch.cuda.device(device_index):
            error = self.cudart.cudaHostRegister(self.address, ring.spec.total_bytes, 0)
        if int(error) != 0:
            raise ShmSeqError(f"cudaHostRegister of the {ring.spec.total_bytes:,}-byte ring failed "
                              f"with CUDA error {int(error)}: lower buffer or slot_bytes, or raise "
                              "the locked-memory limit (ulimit -l)")

    def release(self) -> None:
        self.cudart.cudaHostUnregister(self.address)


class HostDevice:
    """Batches as views of their slot: numpy arrays, or torch CPU tensors sharing the memory."""

    keeps_slot = True

    def __init__(self, to_torch: bool, pin_device: int | None = None):
        self.to_torch = to_torch
        self.pin_device = pin_device
        self._lock: PageLock | None = None

    def attach(self, ring) -> None:
        if self.pin_device is not None:
            self._lock = PageLock(ring, self.pin_device)

    def convert(self, views):
        return (map_arrays(views, _to_torch) if self.to_torch else views), None

    def hand_over(self, batch, completion):
        return batch

    def wait(self, completion) -> None:
        pass

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class CudaDevice:
    """Copies each batch to the GPU on its converter's own stream; an event marks the end."""

    keeps_slot = False

    def __init__(self, device: str):
        import torch
        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._streams = threading.local()
        self._lock: PageLock | None = None

    def attach(self, ring) -> None:
        self._lock = PageLock(ring, self.device.index)

    def _stream(self):
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = self.torch.cuda.Stream(self.device)
        return stream

    def convert(self, views):
        torch = self.torch
        stream = self._stream()
        with torch.cuda.stream(stream):
            batch = map_arrays(views, self._copy)
            event = torch.cuda.Event()
            event.record(stream)
        return batch, event

    def _copy(self, array: np.ndarray):
        tensor = _to_torch(array)
        if isinstance(tensor, np.ndarray):
            return array.copy()  # strings and the like stay on the host, off the slot
        return tensor.to(self.device, non_blocking=True)

    def hand_over(self, batch, event):
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)

        for tensor in iter_arrays(batch, self.torch.Tensor):
            tensor.record_stream(current)  # the allocator must not reuse it under the consumer
        return batch

    def wait(self, event) -> None:
        event.synchronize()

    def close(self) -> None:
        if self._lock is not None:
            self.torch.cuda.synchronize(self.device)
            self._lock.release()
            self._lock = None


class FakeEvent:
    """Completion of one fake copy; carries the copy's error, if any."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None


class FakeDevice:
    """A device whose copies complete late, from another thread, after random delays."""

    keeps_slot = False

    def __init__(self, max_delay: float = 0.01, seed: int = 0, fail_on=None):
        self.max_delay = max_delay
        self.fail_on = fail_on          # a predicate on the batch's views: that copy fails
        self.attached_ring = None
        self._random = random.Random(seed)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._copier = threading.Thread(target=self._copy_late, name="shmseq-fake-copier", daemon=True)

    def attach(self, ring) -> None:
        """Start copying (a thread: only now, after the workers were forked)."""
        self.attached_ring = ring
        self._copier.start()

    def convert(self, views):
        targets = map_arrays(views, np.empty_like)
        event = FakeEvent()
        if self.fail_on is not None and self.fail_on(views):
            event.error = RuntimeError("fake copy failed")
        # Like a DMA engine, the copy keeps raw addresses, not references: only the
        # pipeline's lease keeps the slot from being rewritten before the copy runs.
        copies = [(target.ctypes.data, source.ctypes.data, source.nbytes)
                  for source, target in zip(iter_arrays(views), iter_arrays(targets))]
        self._jobs.put((copies, event))
        return targets, event

    def _copy_late(self) -> None:
        while (job := self._jobs.get()) is not None:
            copies, event = job
            time.sleep(self._random.uniform(0, self.max_delay))
            if event.error is None:
                for target, source, nbytes in copies:
                    ctypes.memmove(target, source, nbytes)
            event.done.set()

    def hand_over(self, batch, event):
        event.done.wait()  # the consumer's stream waits on the copy's event
        if event.error is not None:
            raise ShmSeqError(f"copying a batch to the device failed: {event.error}") from event.error
        return batch

    def wait(self, event) -> None:
        event.done.wait()

    def close(self) -> None:
        if self._copier.is_alive():
            self._jobs.put(None)
            self._copier.join()
        self.attached_ring = None


def make_device(out_type: str, pin_memory: bool | None = None, pin_device_id: int = 0):
    if out_type.startswith("cuda"):
        return CudaDevice(out_type)
    if pin_memory is None:
        pin_memory = out_type == "cpu" and cuda_available()
    elif pin_memory and not cuda_available():
        warn_user("pin_memory=True but CUDA is not available: delivering pageable memory")
        pin_memory = False
    return HostDevice(to_torch=out_type == "cpu", pin_device=pin_device_id if pin_memory else None)
