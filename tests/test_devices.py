"""The slot-release protocol of copying devices, proved against a fake device whose copies
complete late, on another thread, after random delays."""
import threading

import numpy as np
import pytest

import shmseq.pipeline
from shmseq import ShmSeqError, ShmSequence
from shmseq.devices import FakeDevice, FakeStream, make_device
from shmseq.ring import LEASED, Ring
from workers import ImageWorker


class RecordingFake(FakeDevice):
    """Also records what the pipeline did to it, and whether the ring was mapped then."""

    def __init__(self, **options):
        super().__init__(**options)
        self.log = []
        self.ring = None

    def attach(self, ring):
        super().attach(ring)
        self.ring = ring
        self.log.append(("attach", ring.segment.mapped))

    def close(self):
        self.log.append(("close", self.ring.segment.mapped))
        self.ring = None
        super().close()


@pytest.fixture
def fake(monkeypatch):
    devices = []

    def make(max_delay=0.01, fail_on=None):
        def factory(*args, **kwargs):
            devices.append(RecordingFake(max_delay=max_delay, fail_on=fail_on))
            return devices[-1]
        monkeypatch.setattr(shmseq.pipeline, "make_device", factory)
        return devices

    return make


def run(dset_size=400, epochs=2, **options):
    options = {"batch_size": 4, "num_workers": 2, "shuffle": True, "seed": 2, "buffer": 2,
               "out_type": "null", "timeout": 30, **options}
    seq = ShmSequence(ImageWorker(16), dset_size, **options)
    with seq.start():
        return [[(b["label"].copy(), b["image"].copy()) for b in seq] for _ in range(epochs)], seq


def assert_intact(epochs, seq):
    for epoch, batches in enumerate(epochs):
        expected = seq._plan.batches(epoch)
        assert len(batches) == len(expected)
        for (labels, images), indices in zip(batches, expected):
            marker = (indices % 251).astype(np.uint8)[:, None, None, None]
            intact = labels.tolist() == indices.tolist() and (images == marker).all()
            assert intact, "a slot was rewritten before its copy completed"


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_no_slot_is_rewritten_before_its_copy_completes(fake, backend):
    devices = fake(max_delay=0.004)
    epochs, seq = run(thread_type=backend)
    assert_intact(epochs, seq)
    assert [entry[0] for entry in devices[0].log] == ["attach", "close"]


def test_the_identity_check_catches_a_slot_released_too_early(fake, monkeypatch):
    fake(max_delay=0.002)
    monkeypatch.setattr(Ring, "track_copy", lambda self, slot, completion: None)  # the bug
    epochs, seq = run(dset_size=200, epochs=1)
    with pytest.raises(AssertionError, match="rewritten before its copy completed"):
        assert_intact(epochs, seq)


def test_the_device_is_closed_before_the_ring_is_unmapped(fake):
    devices = fake(max_delay=0.05)
    seq = ShmSequence(ImageWorker(16), 400, batch_size=4, num_workers=2, buffer=3,
                      out_type="null", timeout=30)
    seq.start()
    next(iter(seq))
    seq.finish()  # copies still in flight
    assert devices[0].log == [("attach", True), ("close", True)]
    assert not devices[0].stream._thread.is_alive()


def test_a_failed_copy_surfaces_in_order(fake):
    fake(fail_on=lambda views: 20 in views["label"])
    seq = ShmSequence(ImageWorker(16), 400, batch_size=4, num_workers=2, shuffle=False,
                      out_type="null", timeout=30)
    with seq.start():
        got = []
        with pytest.raises(ShmSeqError, match="copying a batch to the device failed"):
            for batch in seq:
                got.append(batch["label"][0])
    assert got == [0, 4, 8, 12, 16]


def test_copied_batches_do_not_hold_slots(fake):
    fake(max_delay=0.002)
    seq = ShmSequence(ImageWorker(16), 120, batch_size=4, num_workers=2, buffer=2,
                      out_type="null", timeout=30, shuffle=False)
    with seq.start():
        kept = list(seq)  # keeps every batch: fine, they are copies
        seq._runtime.ring.collect()
        assert seq._runtime.ring.count(LEASED) == 0
    assert [b["label"][0] for b in kept] == list(range(0, 120, 4))


def test_host_output_is_the_slot_itself_and_pins_only_with_cuda():
    views = {"x": np.arange(4)}
    batch, copy = make_device("null").convert(views)
    assert batch is views and copy is None
    if not shmseq.devices.cuda_available():
        assert make_device("cpu").pin_device is None
        with pytest.warns(RuntimeWarning, match="pin_memory=True but CUDA is not available"):
            assert make_device("cpu", pin_memory=True).pin_device is None


def test_fake_copies_from_locked_memory_complete_late_on_another_thread():
    stream = FakeStream(max_delay=0.05)
    locked, pageable = np.arange(1000), np.arange(1000)
    stream.register(locked.ctypes.data, locked.nbytes)
    late, now = stream.copy(locked), stream.copy(pageable)
    assert "shmseq-fake-stream" in {t.name for t in threading.enumerate()}
    assert np.array_equal(now, pageable)  # a pageable copy is done when it returns
    stream.synchronize()
    assert np.array_equal(late, locked)
    stream.close()


def test_a_slot_freed_when_its_copy_completes_wakes_the_consumer(fake):
    """One slot: each batch needs the slot whose copy the releaser thread frees, while the
    consumer already waits; the release must wake it (not the timeout)."""
    import time
    fake(max_delay=0.002)
    seq = ShmSequence(ImageWorker(16), 60, batch_size=4, num_workers=1, buffer=1, shuffle=False,
                      out_type="null", timeout=60)
    began = time.monotonic()
    with seq.start():
        assert [b["label"][0] for b in seq] == list(range(0, 60, 4))
    assert time.monotonic() - began < 10, "the consumer slept through a freed slot"


def test_torch_leaves_share_the_slot_where_torch_can():
    torch = pytest.importorskip("torch")
    from shmseq.devices import torch_leaf
    region = np.arange(64, dtype=np.uint8)
    native = np.ndarray((4,), np.dtype("<i4"), region, 0)
    tensor = torch_leaf(native.dtype)(native)
    assert tensor.dtype == torch.int32 and tensor.data_ptr() == region.ctypes.data
    swapped = np.ndarray((4,), np.dtype(">i4"), region, 16)
    copied = torch_leaf(swapped.dtype)(swapped)  # torch holds native order only: a copy
    assert copied.tolist() == swapped.tolist() and copied.data_ptr() != swapped.ctypes.data
    assert torch_leaf(np.dtype("U3")) is None  # torch lacks it: stays a numpy view
