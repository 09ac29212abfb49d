"""Where batches are delivered: the ``Device`` contract and its implementations.

A device turns a batch of numpy views of a slot into what the consumer gets (``Device``
says how, step by step). A device that page-locks the ring also returns a fence from
``attach``, which the ring takes when the last view of a batch dies: a completion (a callable
that blocks until done) for the copies the consumer may have enqueued from the slot, since a
``non_blocking`` copy from page-locked memory still reads the slot after the view is gone.

* ``HostDevice``: numpy views or ``torch.from_numpy`` tensors, zero-copy; page-locked in
  place when a pinning device is given (MXNet's ``pin_memory``), with a CUDA event recorded
  on that device's current stream as each batch's fence.
* ``CudaDevice``: the whole ring page-locked in place (``cudaHostRegister``), each batch
  copied on one of ``num_converters`` streams, an event per batch; the copies' GPU time is
  read from timing events (``GpuTimer``) for the statistics' ``copy_s``.

Fakes of both, for tests without a GPU, are in ``shmseq.testing``.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from ..common.errors import ShmSeqError, warn_once
from ..common.layout import Wrap, iter_arrays, map_arrays
from ..common.protocol import Completion, Fence

if TYPE_CHECKING:
    import torch

    from .ring import Ring

OUT_TYPES = ("null", "cpu", "cuda")


class Device(Protocol):
    """What the pipeline asks of a device, in the order it asks.

    ``wrap``: ``wrap(dtype)`` is what turns each view of that dtype into what the consumer
    gets, as a batch is read from its slot (``torch.from_numpy``), or None to keep the numpy
    view; ``wrap`` itself None: numpy views throughout.
    """

    wrap: Wrap | None

    def attach(self, ring: Ring) -> Fence | None:
        """Once the ring exists: page-lock it if the device copies from it; the fence for the
        ring to take whenever a lease dies if the consumer's own copies from a slot may still
        read it after the batch's views died (a page-locked host's), else None."""

    # A copy is the device's own (a CUDA event, say): Any, for the pipeline only hands it back.
    def convert(self, views: object) -> tuple[object, Any]:
        """``(batch, copy)``: ``copy`` is None when the batch *is* the views (host output), else
        the device copy still reading the slot, which stays busy until ``wait(copy)``."""

    def hand_over(self, batch: object, copy: Any) -> object:
        """The batch as the consumer gets it, in its thread, just before it is yielded."""

    def wait(self, copy: Any) -> None:
        """Block until ``copy`` no longer reads the slot (on the releaser's thread)."""

    def close(self) -> None:
        """After the last copy completed, before the ring is unmapped.

        A device may also have ``pop_skipped()``: the samples it left out of the batch it just
        handed over (a decode stage's bad images), reported as a worker's skips are; and
        ``pop_counts()``: its statistics since the last call (``{"copy_s": seconds}``, a
        decode stage's ``decode_s``), added to the loader's every half second (both looked up
        once, by ``protocol.Hooks``)."""


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
        warn_once("no torch", f"out_type={out_type!r} needs torch, which is not installed: "
                  "delivering numpy arrays (out_type='null') instead, here and for every "
                  "sequence after it; pass out_type='null' to say so and silence this")
        return "null"
    if not cuda_available():
        warn_once("no cuda", f"out_type={out_type!r} but CUDA is not available: delivering CPU "
                  "tensors (out_type='cpu') instead, here and for every sequence after it; pass "
                  "out_type='cpu' to say so and silence this")
        return "cpu"
    return out_type


def torch_wrap(dtype: np.dtype) -> Callable[[np.ndarray], torch.Tensor] | None:
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

    def __init__(self, ring: Ring, device_index: int) -> None:
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

    def fence(self) -> Completion:
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

    def __init__(self, to_torch: bool, pin_device: int | None = None) -> None:
        self.to_torch = to_torch
        self.wrap: Wrap | None = torch_wrap if to_torch else None  # views made tensors as they are read
        self.pin_device = pin_device
        self._lock: PageLock | None = None

    def attach(self, ring: Ring) -> Fence | None:
        if self.pin_device is None:
            return None
        self._lock = PageLock(ring, self.pin_device)
        return self._lock.fence

    def convert(self, views: object) -> tuple[object, None]:
        return views, None  # already as delivered: read through ``wrap``

    def hand_over(self, batch: object, copy: None) -> object:
        return batch

    def wait(self, copy: None) -> None:
        pass

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


class GpuTimer:
    """The GPU time of one stage (copies, a decode): pairs of timing events around its work
    on a stream, read once they completed, so that nobody waits for them. The spans of several
    streams add up (they may overlap)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self._spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def mark(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """A timing event recorded on ``stream`` now (one that ends a span may also be waited on
        as any event)."""
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def span(self, began: torch.cuda.Event, ended: torch.cuda.Event) -> None:
        self._spans.append((began, ended))

    def pop_seconds(self) -> float:
        """The seconds of the spans that completed since the last call, in the order they were
        made: one still running waits for the next call, with those after it."""
        seconds, spans = 0.0, self._spans
        while spans and spans[0][1].query():
            began, ended = spans.popleft()
            seconds += began.elapsed_time(ended) / 1000  # milliseconds
        return seconds


class CudaDevice:
    """Copies each batch to the GPU on one of its own streams; an event marks the end."""

    wrap: Wrap | None = staticmethod(torch_wrap)  # read as tensors of the slot, then copied

    def __init__(self, device: str, num_streams: int = 1) -> None:
        import torch
        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._streams = itertools.cycle([torch.cuda.Stream(self.device) for _ in range(num_streams)])
        self._lock: PageLock | None = None
        self.timer = GpuTimer(torch)

    def attach(self, ring: Ring) -> None:
        self._lock = PageLock(ring, self.device.index)

    def next_stream(self) -> torch.cuda.Stream:
        """The next of the device's streams, in turn."""
        return next(self._streams)

    def convert(self, views: object) -> tuple[object, torch.cuda.Event]:
        torch = self.torch
        stream = self.next_stream()
        began = self.timer.mark(stream)
        with torch.cuda.stream(stream):
            batch = map_arrays(views, self._copy, (np.ndarray, torch.Tensor))
        event = self.timer.mark(stream)
        self.timer.span(began, event)
        return batch, event

    def _copy(self, array: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        if isinstance(array, np.ndarray):
            return array.copy()  # strings and the like stay on the host, off the slot
        return array.to(self.device, non_blocking=True)

    def hand_over(self, batch: object, event: torch.cuda.Event) -> object:
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in iter_arrays(batch, self.torch.Tensor):
            tensor.record_stream(current)  # the allocator must not reuse it under the consumer
        return batch

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def pop_counts(self) -> dict[str, float]:
        return {"copy_s": self.timer.pop_seconds()}

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def make_device(out_type: str, pin_memory: bool | None = None, pin_device_id: int = 0,
                num_streams: int = 1) -> Device:
    if out_type.startswith("cuda"):
        return CudaDevice(out_type, num_streams)
    if pin_memory is None:
        pin_memory = out_type == "cpu" and cuda_available()
    elif pin_memory and not cuda_available():
        warn_once("no cuda to pin for", "pin_memory=True but CUDA is not available: delivering "
                  "pageable memory, here and for every sequence after it")
        pin_memory = False
    return HostDevice(to_torch=out_type == "cpu", pin_device=pin_device_id if pin_memory else None)
