"""The slot-release protocol of copying devices, proved against a fake device whose copies
complete late, on another thread, after random delays."""
import contextlib
import threading

import numpy as np
import pytest

import shmseq.engine.trainer.devices
from shmseq import ShmSeqError, ShmSequence
from shmseq.engine.trainer.devices import GpuTimer, make_device
from shmseq.testing import FakeDevice, FakeStream, planned_batches, ring_of
from shmseq.engine.trainer.ring import LEASED, Ring
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


class Fakes:
    """A sequence's device factory (``ShmSequence(..., device=fakes)``): the devices it made."""

    def __init__(self, **options):
        self.options = options
        self.made = []

    def __call__(self):
        self.made.append(RecordingFake(**self.options))
        return self.made[-1]


def run(dset_size=400, epochs=2, **options):
    options = {"batch_size": 4, "num_workers": 2, "shuffle": True, "seed": 2, "buffer": 2,
               "out_type": "null", "timeout": 30, **options}
    seq = ShmSequence(ImageWorker(16), dset_size, **options)
    with seq.start():
        return [[(b["label"].copy(), b["image"].copy()) for b in seq] for _ in range(epochs)], seq


def assert_intact(epochs, seq):
    for epoch, batches in enumerate(epochs):
        assert_epoch_intact(batches, seq, epoch)


def assert_epoch_intact(batches, seq, epoch):
    expected = planned_batches(seq, epoch)
    assert len(batches) == len(expected)
    for (labels, images), indices in zip(batches, expected):
        marker = (indices % 251).astype(np.uint8)[:, None, None, None]
        intact = labels.tolist() == indices.tolist() and (images == marker).all()
        assert intact, "a slot was rewritten before its copy completed"


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_no_slot_is_rewritten_before_its_copy_completes(backend):
    fakes = Fakes(max_delay=0.004)
    epochs, seq = run(thread_type=backend, device=fakes)
    assert_intact(epochs, seq)
    assert [entry[0] for entry in fakes.made[0].log] == ["attach", "close"]


def test_the_identity_check_catches_a_slot_released_too_early(monkeypatch):
    """Copies slower than writes tear a few batches an epoch (0 to 6 of 100 seen, at times
    none): epochs run until one is torn, 8 at most."""
    monkeypatch.setattr(Ring, "track_copy", lambda self, slot, completion: None)  # the bug
    options = {"batch_size": 4, "num_workers": 2, "shuffle": True, "seed": 2, "buffer": 2,
               "out_type": "null", "timeout": 30, "device": Fakes(max_delay=0.02)}
    with ShmSequence(ImageWorker(16), 400, **options).start() as seq:
        for epoch in range(8):
            batches = [(b["label"].copy(), b["image"].copy()) for b in seq]
            try:
                assert_epoch_intact(batches, seq, epoch)
            except AssertionError as torn:
                assert "rewritten before its copy completed" in str(torn)
                return
    pytest.fail("8 epochs and no batch torn: the check did not catch the early release")


def test_the_device_is_closed_before_the_ring_is_unmapped():
    fakes = Fakes(max_delay=0.05)
    devices = fakes.made
    seq = ShmSequence(ImageWorker(16), 400, batch_size=4, num_workers=2, buffer=3,
                      out_type="null", timeout=30, device=fakes)
    seq.start()
    next(iter(seq))
    seq.finish()  # copies still in flight
    assert devices[0].log == [("attach", True), ("close", True)]
    assert "shmseq-fake-stream" not in {t.name for t in threading.enumerate()}


def test_a_failed_copy_surfaces_in_order():
    seq = ShmSequence(ImageWorker(16), 400, batch_size=4, num_workers=2, shuffle=False,
                      out_type="null", timeout=30,
                      device=Fakes(fail_on=lambda views: 20 in views["label"]))
    with seq.start():
        got = []
        with pytest.raises(ShmSeqError, match="copying a batch to the device failed"):
            for batch in seq:
                got.append(batch["label"][0])
    assert got == [0, 4, 8, 12, 16]


def test_copied_batches_do_not_hold_slots():
    seq = ShmSequence(ImageWorker(16), 120, batch_size=4, num_workers=2, buffer=2,
                      out_type="null", timeout=30, shuffle=False, device=Fakes(max_delay=0.002))
    with seq.start():
        kept = list(seq)  # keeps every batch: fine, they are copies
        ring_of(seq).collect()
        assert ring_of(seq).count(LEASED) == 0
    assert [b["label"][0] for b in kept] == list(range(0, 120, 4))


def test_host_output_is_the_slot_itself_and_pins_only_with_cuda():
    views = {"x": np.arange(4)}
    batch, copy = make_device("null").convert(views)
    assert batch is views and copy is None
    if not shmseq.engine.trainer.devices.cuda_available():
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


def test_a_slot_freed_when_its_copy_completes_wakes_the_consumer():
    """One slot: each batch needs the slot whose copy the releaser thread frees, while the
    consumer already waits; the release must wake it (not the timeout)."""
    import time
    seq = ShmSequence(ImageWorker(16), 60, batch_size=4, num_workers=1, buffer=1, shuffle=False,
                      out_type="null", timeout=60, device=Fakes(max_delay=0.002))
    began = time.monotonic()
    with seq.start():
        assert [b["label"][0] for b in seq] == list(range(0, 60, 4))
    assert time.monotonic() - began < 10, "the consumer slept through a freed slot"


def test_torch_wraps_views_of_the_slot_where_torch_can():
    torch = pytest.importorskip("torch")
    from shmseq.engine.trainer.devices import torch_wrap
    region = np.arange(64, dtype=np.uint8)
    native = np.ndarray((4,), np.dtype("<i4"), region, 0)
    tensor = torch_wrap(native.dtype)(native)
    assert tensor.dtype == torch.int32 and tensor.data_ptr() == region.ctypes.data
    swapped = np.ndarray((4,), np.dtype(">i4"), region, 16)
    copied = torch_wrap(swapped.dtype)(swapped)  # torch holds native order only: a copy
    assert copied.tolist() == swapped.tolist() and copied.data_ptr() != swapped.ctypes.data
    assert torch_wrap(np.dtype("U3")) is None  # torch lacks it: stays a numpy view


class TimingEvent:
    """A CUDA timing event's stand-in, recorded at ``at_ms`` on a stream's clock; ``done``:
    the stream went past it."""

    def __init__(self, at_ms: float, done: bool = True) -> None:
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "TimingEvent") -> float:
        assert self.done and end.done, "CUDA refuses the time of an event not reached yet"
        return end.at_ms - self.at_ms


def test_the_gpu_timer_adds_the_spans_that_completed_and_waits_for_the_rest():
    timer = GpuTimer(torch=None)
    running = TimingEvent(9, done=False)
    timer.span(TimingEvent(0), TimingEvent(5))
    timer.span(TimingEvent(6), running)
    timer.span(TimingEvent(9), TimingEvent(12))
    assert timer.pop_seconds() == pytest.approx(0.005)  # the rest waits behind the running one
    running.done = True
    assert timer.pop_seconds() == pytest.approx(0.006)
    assert timer.pop_seconds() == 0


def test_the_copies_time_is_counted_and_named_when_it_bounds_the_rate():
    """Copies slower than the workers: the copy stream is busy nearly all the time, while the
    consumer (whose wait for a copy would be the GPU's) does not wait for batches."""
    seq = ShmSequence(ImageWorker(16), 320, batch_size=4, num_workers=2, buffer=2,
                      out_type="null", timeout=30, device=Fakes(max_delay=0.02))
    with seq.start():
        for _ in seq:
            pass
        window = seq.stats.breakdown()
        assert seq.stats.copy_s > 0 and window.copy_fraction > 0
        assert seq.stats.summary().startswith("copy-bound: host-to-device copies ran"), window


def test_the_cuda_device_times_each_batchs_copies_on_its_stream(monkeypatch):
    """No GPU here: torch.cuda's streams and events are stand-ins that record where they were
    recorded; the copies of numpy leaves stay on the host. On a GPU, tests/test_cuda.py."""
    torch = pytest.importorskip("torch")
    ticks = iter(range(0, 1000, 4))

    class Event(TimingEvent):
        def __init__(self, enable_timing=False):
            super().__init__(at_ms=0)
            self.timing = enable_timing

        def record(self, stream):
            self.at_ms, self.stream = next(ticks), stream

    class Stream:
        def __init__(self, device=None):
            pass

    for name, value in [("Stream", Stream), ("Event", Event), ("current_device", lambda: 0),
                        ("stream", lambda stream: contextlib.nullcontext())]:
        monkeypatch.setattr(torch.cuda, name, value)
    device = shmseq.engine.trainer.devices.CudaDevice("cuda", num_streams=2)
    events = [device.convert({"x": np.arange(4)})[1] for _ in range(3)]
    assert all(event.timing for event in events)
    assert len({event.stream for event in events}) == 2  # the streams in turn
    assert device.pop_counts() == {"copy_s": pytest.approx(0.012)}  # 4 ms a span, 3 of them
    assert device.pop_counts() == {"copy_s": 0}
