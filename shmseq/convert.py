"""Converter threads, the output reorder buffer, and the devices batches are delivered to.

A converter takes ``(seq, slot, payload)`` from the middle queue, leases the slot
from the ring (``ring.lease``), decodes the batch into views of it
(``layout.read_batch``) and hands it to a device:

* ``HostDevice``: numpy views (``out_type='null'``) or ``torch.from_numpy`` tensors
  (``'cpu'``), zero-copy: the delivered arrays keep the lease, so the slot stays
  busy until the consumer drops them;
* ``CudaDevice``: copies to the GPU, after which the slot is free again.

Converted batches wait in ``OrderedOutput`` until the consumer asks for their seq.
"""
from __future__ import annotations

import queue
import threading
from typing import NamedTuple

import numpy as np

from .errors import ShmSeqError, warn_user
from .layout import map_arrays, read_batch

OUT_TYPES = ("null", "cpu", "cuda")


class Delivery(NamedTuple):
    batch: object         # what the consumer gets
    views: object         # the same batch as numpy views of its slot or payload
    slot: int | None      # the ring slot the batch's views live in, if any
    payload_bytes: int    # size of an out-of-ring payload (probe or overflow), else 0


class OrderedOutput:
    """Converted batches keyed by seq, taken strictly in order by the consumer."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: dict[int, object] = {}
        self._failure: BaseException | None = None
        self.floor = 0

    def put(self, seq: int, item) -> None:
        with self._cond:
            if seq >= self.floor:
                self._items[seq] = item
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    def take(self, seq: int, timeout: float):
        """The item for ``seq``; ``None`` after ``timeout`` s. A pipeline failure wins over
        batches still waiting: once the pipeline is broken or closed, every take raises."""
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._items or self._failure, timeout):
                return None
            if self._failure is not None:
                raise self._failure
            item = self._items.pop(seq)
        if isinstance(item, BaseException):
            raise item
        return item

    def drop_below(self, seq: int) -> None:
        """Forget batches before ``seq`` (an epoch left early); their slots come back."""
        with self._cond:
            self.floor = max(self.floor, seq)
            stale = [self._items.pop(key) for key in list(self._items) if key < seq]
        del stale


def _to_torch(array: np.ndarray):
    import torch
    try:
        return torch.from_numpy(array)
    except TypeError:  # a dtype torch lacks (strings, structured): stays a numpy view
        return array


class HostDevice:
    """Batches as views of their slot: numpy arrays, or torch CPU tensors sharing the memory."""

    keeps_slot = True

    def __init__(self, to_torch: bool):
        self.to_torch = to_torch

    def convert(self, batch):
        return map_arrays(batch, _to_torch) if self.to_torch else batch


class CudaDevice:
    """Copies each batch to a CUDA device; the slot is free once the copy is done."""

    keeps_slot = False

    def __init__(self, device: str):
        import torch
        self.torch = torch
        self.device = torch.device(device)

    def convert(self, batch):
        return map_arrays(batch, lambda a: _cuda_copy(self.torch, a, self.device))


def _cuda_copy(torch, array: np.ndarray, device):
    tensor = _to_torch(array)
    if isinstance(tensor, np.ndarray):
        return array.copy()
    return tensor.to(device)


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


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
    import torch
    if not torch.cuda.is_available():
        warn_user(f"out_type={out_type!r} but CUDA is not available: delivering CPU tensors "
                      "(out_type='cpu') instead")
        return "cpu"
    return out_type


def make_device(out_type: str):
    if out_type.startswith("cuda"):
        return CudaDevice(out_type)
    return HostDevice(to_torch=out_type == "cpu")


class Converters:
    """``count`` threads turning middle-queue items into deliveries."""

    def __init__(self, count: int, middle: queue.SimpleQueue, output: OrderedOutput, pool, device):
        self.middle = middle
        self.output = output
        self.pool = pool
        self.device = device
        self._threads = [threading.Thread(target=self._run, name=f"shmseq-converter-{i}", daemon=True)
                         for i in range(count)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        for _ in self._threads:
            self.middle.put(None)
        for thread in self._threads:
            thread.join(timeout)

    def _run(self) -> None:
        try:
            while (item := self.middle.get()) is not None:
                self._route(*item)
        except BaseException as exc:  # noqa: BLE001 - a dead converter must not hang the consumer
            self.output.fail(exc)

    def _route(self, seq: int, slot: int | None, payload) -> None:
        if isinstance(payload, BaseException):
            self.output.put(seq, payload)
        elif seq < self.output.floor:
            if slot is not None:
                self.pool.release(slot)
        else:
            self.output.put(seq, self._convert(seq, slot, payload))

    def _convert(self, seq: int, slot: int | None, payload):
        try:
            region = self.pool.ring.lease(slot) if payload is None else payload
            views = read_batch(region)
            batch = self.device.convert(views)
        except Exception as exc:  # noqa: BLE001 - surfaces in the consumer, in order
            error = ShmSeqError(f"converting batch {seq} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return error
        in_slot = payload is None and self.device.keeps_slot
        return Delivery(batch, views, slot if in_slot else None, 0 if payload is None else len(payload))
