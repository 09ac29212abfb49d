"""Seams for testing pipelines without a GPU, and for looking inside a running one.

Fake devices (see ``shmseq.engine.trainer.devices.Device``), given to ``ShmSequence(..., device=...)``:

* ``FakeDevice``: a copying device, as CUDA is; its copies run late, on another thread, after
  random delays, reading the slot's raw addresses as a DMA engine does, so that a slot reused
  too early shows up as a torn batch.
* ``FakePinnedDevice``: host views of page-locked slots, the consumer's own ``non_blocking``
  copies made on a ``FakeStream``.
* ``FakeGpuDecoder``: a ``shmseq.decode`` stage as the CUDA decoder is, the encoded bytes read
  from the slot late, by address, on a ``FakeStream`` (as nvJPEG reads a page-locked slot),
  then decoded on the CPU.

And what a test may ask of a sequence or loader while it runs: ``ring_of``, ``worker_pids``,
``planned_batches``.
"""
from __future__ import annotations

import ctypes
import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from .decode import DecodeStage, HostDecoder, source_batch
from .engine import Completion, EpochPlan, Fence, HostDevice, Ragged, ShmSeqError, Wrap, map_arrays

if TYPE_CHECKING:
    import torch

    from .engine import Pipeline, Ring, RingSpec
    from .sequence import ShmSequence


class FakeEvent:
    """Completion of fake copies; carries the error that ``wait`` raises, if any."""

    def __init__(self, error: BaseException | None = None) -> None:
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

    def __init__(self, max_delay: float = 0.01, seed: int = 0) -> None:
        self.max_delay = max_delay
        self._random = random.Random(seed)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._locked: list[tuple[int, int]] = []
        self.busy_s = 0.0  # time its thread spent on copies (a GPU's copy time), written there

    def register(self, address: int, nbytes: int) -> None:
        self._locked.append((address, address + nbytes))

    def _put(self, job: FakeEvent | tuple[np.ndarray, int, int]) -> None:
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
            began = time.perf_counter()
            time.sleep(self._random.uniform(0, self.max_delay))
            target, source, nbytes = job
            ctypes.memmove(target.ctypes.data, source, nbytes)
            del job, target
            self.busy_s += time.perf_counter() - began

    def close(self) -> None:
        """Stop once every job enqueued has run."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class FakeDevice:
    """A copying device (as CUDA) on a ``FakeStream``: copies complete late, on its thread.

    ``fail_on(views)``: that batch's copy fails (raised at hand-over); ``fail_wait_on(views)``:
    waiting for that copy fails (a sticky error, seen by the releaser)."""

    wrap: Wrap | None = None

    def __init__(self, max_delay: float = 0.01, seed: int = 0,
                 fail_on: Callable[[object], bool] | None = None,
                 fail_wait_on: Callable[[object], bool] | None = None) -> None:
        self.stream = FakeStream(max_delay, seed)
        self.fail_on = fail_on
        self.fail_wait_on = fail_wait_on
        self.attached_ring: RingSpec | None = None
        self._busy_popped = 0.0

    def attach(self, ring: Ring) -> None:
        self.attached_ring = ring.spec
        self.stream.register(ring.address, ring.spec.total_bytes)

    def pop_counts(self) -> dict[str, float]:
        """``copy_s``: the stream's copy time since the last call, as ``CudaDevice``'s."""
        busy = self.stream.busy_s
        popped, self._busy_popped = self._busy_popped, busy
        return {"copy_s": busy - popped}

    def convert(self, views: object) -> tuple[object, FakeEvent]:
        failed = self.fail_on is not None and self.fail_on(views)
        targets = map_arrays(views, np.empty_like if failed else self.stream.copy)
        stuck = self.fail_wait_on is not None and self.fail_wait_on(views)
        event = self.stream.record(RuntimeError("fake wait failed") if stuck else None)
        event.copy_failed = failed
        return targets, event

    def hand_over(self, batch: object, event: FakeEvent) -> object:
        event.done.wait()  # the consumer's stream waits on the copy's event
        if event.copy_failed:
            raise ShmSeqError("copying a batch to the device failed: fake copy failed")
        return batch

    def wait(self, event: FakeEvent) -> None:
        event.wait()

    def close(self) -> None:
        self.stream.close()


class FakePinnedDevice(HostDevice):
    """Host views of page-locked slots, with the consumer's copies on a fake current stream:
    ``stream.copy(view)`` is the user's ``view.cuda(non_blocking=True)``."""

    def __init__(self, stream: FakeStream) -> None:
        super().__init__(to_torch=False)
        self.stream = stream

    def attach(self, ring: Ring) -> Fence:
        self.stream.register(ring.address, ring.spec.total_bytes)
        return self.fence

    def fence(self) -> Completion:
        return self.stream.record().wait


class FakeGpuDecoder(HostDecoder):
    """A decode stage that reads the slot as the CUDA decoder does: by address, late (the
    ``FakeStream``'s copies of the encoded bytes and labels), held by no view of it, so only the
    event after those reads keeps the slot from being rewritten; the copies are then decoded by
    the CPU decoder. Give ``ShmSequence(..., device=lambda: FakeGpuDecoder(stage))``."""

    def __init__(self, stage: DecodeStage, max_delay: float = 0.01, seed: int = 0) -> None:
        super().__init__(stage)
        self.stream = FakeStream(max_delay, seed)

    def attach(self, ring: Ring) -> None:
        self.stream.register(ring.address, ring.spec.total_bytes)

    # The types ignored below: a device of its own, which borrows the CPU decoder's decoding;
    # what it hands over from ``convert`` is copies and a fake stream's event.
    def convert(self, views: object  # type: ignore[override]
                ) -> tuple[tuple[Ragged, np.ndarray, np.ndarray], FakeEvent]:
        encoded, labels, ids = source_batch(views)
        copied = (Ragged(self.stream.copy(encoded.values), encoded.offsets.copy()),
                  self.stream.copy(labels), ids.copy())
        return copied, self.stream.record()

    def wait(self, event: FakeEvent) -> None:  # type: ignore[override]
        event.wait()

    def hand_over(self, copied: tuple[Ragged, np.ndarray, np.ndarray],  # type: ignore[override]
                  event: FakeEvent) -> tuple[torch.Tensor, torch.Tensor]:
        event.done.wait()
        return super().hand_over(*super().convert(copied))

    def close(self) -> None:
        self.stream.close()
        super().close()


# -- looking inside a running sequence or loader ---------------------------------------------------
def _pipeline_of(loader: object) -> Pipeline:
    """The running pipeline of a ``ShmSequence`` (any front end built on it), or of a
    ``shmseq.torch.DataLoader``'s iterator (or the loader's persistent one)."""
    pipeline = getattr(loader, "pipeline", None)
    if pipeline is None or not hasattr(pipeline, "pool"):
        raise ValueError(f"{type(loader).__name__} object has no running pipeline with workers: "
                         "start it (start(), a with-block, or iter() on a loader) with "
                         "num_workers > 0 first")
    return pipeline


def ring_of(loader: object) -> Ring | None:
    """The slot ring a running sequence or loader delivers from (``ring.contains(array)`` says
    whether a batch is a view of it); None while it is not sized yet (no batch came back)."""
    return _pipeline_of(loader).ring


def worker_pids(loader: object) -> list[int | None]:
    """The process ids of a running sequence's or loader's workers, by worker id (None: a
    thread)."""
    pool = _pipeline_of(loader).pool
    assert pool is not None  # made with the pipeline
    return [handle.pid for handle in pool.handles]


def planned_batches(sequence: ShmSequence, epoch: int) -> list[np.ndarray]:
    """The sample indices of every batch of ``epoch``, in order, as a ``ShmSequence`` (with its
    own seeded plan) delivers them."""
    plan = sequence.plan
    assert isinstance(plan, EpochPlan), "a sequence with a plan of its own"
    return plan.batches(epoch)
