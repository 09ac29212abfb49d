"""Host-to-device copy rate from the page-locked ring against pageable memory (CUDA only)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from shmseq.engine.trainer.devices import PageLock  # noqa: E402
from shmseq.engine.trainer.ring import Ring  # noqa: E402

BATCH_BYTES = 64 * 224 * 224 * 3  # one imagenet64 batch


@pytest.fixture(scope="module")
def registered_slot():
    ring = Ring.create(2, BATCH_BYTES)
    lock = PageLock(ring, torch.cuda.current_device())
    yield torch.from_numpy(ring.region(0))
    torch.cuda.synchronize()
    lock.release()
    ring.unlink()
    ring.close()


def copy_rate(benchmark, source):
    target = torch.empty(source.shape, dtype=source.dtype, device="cuda")
    stream = torch.cuda.Stream()

    def copy():
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        stream.synchronize()

    benchmark(copy)
    benchmark.extra_info["GB/s"] = source.numel() / benchmark.stats["mean"] / 1e9


def test_h2d_from_the_registered_ring(benchmark, registered_slot):
    assert registered_slot.is_pinned()
    copy_rate(benchmark, registered_slot)


def test_h2d_from_pageable_memory(benchmark):
    copy_rate(benchmark, torch.from_numpy(np.zeros(BATCH_BYTES, np.uint8)))
