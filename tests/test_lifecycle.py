"""A slot's life and a pipeline's end: deterministic release, no inherited rings, pinned slots
safe under non_blocking copies, plans drawn when their epoch starts, safe closing, one
iteration at a time. The garbage collector is off wherever release is checked."""
import errno
import gc
import os
import threading
import time
import warnings

import numpy as np
import pytest

from shmseq import DataLoader, PipelineClosed, ShmSeqError
from shmseq.engine.trainer.devices import HostDevice
from shmseq.testing import FakeDevice, FakePinnedDevice, FakeStream, planned_batches, worker_pids
from shmseq.engine.trainer.ring import Ring
from leaks import holders, live_children, mapped_rings
from sequences import make
from workers import ExitNoting, ImageWorker, ListWorker, SizedWorker, Slow

MiB = 1 << 20


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def released(grace: float = 5.0) -> bool:
    """No worker process and no ring mapping of ours is left (within ``grace`` seconds)."""
    deadline = time.monotonic() + grace
    while live_children() or mapped_rings():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- 1. deterministic release ------------------------------------------------------------------
def test_finish_unmaps_the_ring_without_the_garbage_collector(no_gc):
    seq = make(ImageWorker(256), 200, slot_bytes=MiB, buffer=6)
    for _ in range(3):
        with seq.start():
            for batch in seq:
                pass
        assert not live_children() and len(mapped_rings()) == 1  # the last batch's view
        del batch
        assert mapped_rings() == {}


@pytest.mark.parametrize("method", ["fork", "spawn", "thread"])
def test_a_worker_process_calls_worker_exit_as_it_leaves(tmp_path, method):
    """Each worker process calls its worker's ``worker_exit`` when it leaves; worker threads
    do not (their worker is the consumer's, shared by all of them, to end)."""
    options = {"thread_type": "thread"} if method == "thread" else {"start_method": method}
    seq = make(ExitNoting(tmp_path), 16, **options)
    with seq.start():
        pids = set(worker_pids(seq)) - {None}
        assert sum(len(batch) for batch in seq) == 16
    assert len(pids) == (0 if method == "thread" else 2)
    assert {int(name) for name in os.listdir(tmp_path)} == pids


def test_a_loader_dropped_without_close_stops_its_workers_at_once(no_gc):
    for _ in range(3):
        for batch in DataLoader(np.arange(40), batch_size=4, num_workers=2):
            pass
        del batch
        assert released(grace=0)


def test_a_started_sequence_dropped_mid_epoch_is_released(no_gc):
    seq = make(ImageWorker(64), 400).start()
    batches = iter(seq)
    first = next(batches)
    del batches, first, seq
    assert released(grace=0)


def test_an_error_releases_everything_without_the_garbage_collector(no_gc):
    seq = make(SizedWorker([]), 40, slot_bytes=4096)  # fails inside the worker
    with pytest.raises(ZeroDivisionError):
        with seq.start():
            list(seq)
    assert released(grace=0)


@pytest.mark.parametrize("out_type", ["null", "cpu"])
def test_a_kept_view_keeps_only_its_mapping_until_it_dies(no_gc, out_type):
    if out_type == "cpu":
        pytest.importorskip("torch")
    seq = make(ImageWorker(256), 40, slot_bytes=MiB, buffer=3, out_type=out_type)
    seq.start()
    batch = next(iter(seq))
    seq.finish()
    assert not live_children() and len(mapped_rings()) == 1
    image = batch["image"]
    del batch
    assert len(mapped_rings()) == 1 and int(image[1, 0, 0, 0]) == 1
    del image
    assert mapped_rings() == {}


@pytest.mark.parametrize("out_type", ["null", "cpu"])
def test_a_finished_pipeline_leaves_nothing_to_the_cyclic_collector(no_gc, out_type):
    if out_type == "cpu":
        pytest.importorskip("torch")
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        seq = make(ImageWorker, 40, out_type=out_type)
        with seq.start():
            for batch in seq:
                pass
        del seq, batch
        gc.collect()
        cyclic = {type(o).__qualname__ for o in gc.garbage
                  if type(o).__module__.startswith("shmseq")}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not cyclic, f"objects only the cyclic collector frees: {cyclic}"


# -- 2. no inherited rings ---------------------------------------------------------------------
def _worker_pids(seq) -> list[int]:
    return worker_pids(seq)


def _write_every_slot(seq) -> None:
    """Take a ring's worth of batches: every slot's pages are then allocated (they are as each
    slot is first written), and the workers are busy with the next ones."""
    for _, batch in zip(range(seq.buffer), seq):
        del batch


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_map_only_their_own_ring(method):
    train = make(ImageWorker(256), 400, slot_bytes=8 * MiB, buffer=4, start_method=method)
    val = make(ImageWorker(256), 400, slot_bytes=2 * MiB, buffer=4, start_method=method)
    with train.start():
        (train_ring,) = mapped_rings()
        _write_every_slot(train)
        with val.start():
            (val_ring,) = set(mapped_rings()) - {train_ring}
            for pid in _worker_pids(val):
                assert set(mapped_rings(pid)) == {val_ring}
            _write_every_slot(val)
            train.finish()
            assert set(mapped_rings()) == {val_ring}
            assert not holders(train_ring)  # nothing keeps train's pages: the kernel freed them
            assert [b["label"][0] for b in val][:3] == [0, 4, 8]


# -- 3. pinned slots and the consumer's non_blocking copies ------------------------------------
def _copies_intact(copies, seq) -> bool:
    expected = planned_batches(seq, 0)
    for (labels, images), indices in zip(copies, expected, strict=True):
        marker = (indices % 251).astype(np.uint8)[:, None, None, None]
        if labels.tolist() != indices.tolist() or not (images == marker).all():
            return False
    return True


def _copy_every_batch_then_drop_it(device, stream):
    """The usual ``x = x.cuda(non_blocking=True)``: the copy is enqueued on the current stream,
    the view of the slot dropped at once."""
    seq = make(ImageWorker(32), 240, buffer=2, shuffle=True, seed=3, num_workers=2,
               device=lambda: device)
    copies = []
    with seq.start():
        for batch in seq:
            copies.append((stream.copy(batch["label"]), stream.copy(batch["image"])))
            del batch
        stream.synchronize()
    return copies, seq


@pytest.fixture
def pinned():
    stream = FakeStream(max_delay=0.01, seed=1)
    device = FakePinnedDevice(stream)
    yield device, stream
    stream.close()


def test_a_pinned_slot_is_not_rewritten_under_a_pending_non_blocking_copy(pinned):
    copies, seq = _copy_every_batch_then_drop_it(*pinned)
    assert _copies_intact(copies, seq), "a pinned slot was rewritten before the copy from it ran"


def test_the_copy_check_catches_a_pinned_slot_freed_without_its_fence(pinned, monkeypatch):
    device, stream = pinned
    monkeypatch.setattr(device, "fence", lambda: None)  # the bug: freed when the view dies
    copies, seq = _copy_every_batch_then_drop_it(device, stream)
    assert not _copies_intact(copies, seq)


# -- 4. a user's sampler is drawn when its epoch starts ----------------------------------------
class EpochSampler:
    """A batch sampler shuffled by the epoch it was told (as DistributedSampler), recording the
    epoch it was at each time it was drawn."""

    def __init__(self, size=40, batch_size=4):
        self.size, self.batch_size, self.epoch, self.draws = size, batch_size, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch

    def expected(self, epoch):
        order = np.random.default_rng(epoch).permutation(self.size).tolist()
        return [order[at:at + self.batch_size] for at in range(0, self.size, self.batch_size)]

    def __iter__(self):
        self.draws.append(self.epoch)
        return iter(self.expected(self.epoch))

    def __len__(self):
        return -(-self.size // self.batch_size)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_is_drawn_only_when_its_epoch_starts(num_workers):
    sampler = EpochSampler()
    with DataLoader(np.arange(40), batch_sampler=sampler, num_workers=num_workers) as loader:
        for epoch in range(3):
            sampler.set_epoch(epoch)
            assert [b.tolist() for b in loader] == sampler.expected(epoch)
        sampler.set_epoch(3)
        for k, batch in enumerate(loader):
            if k == 1:
                break
        sampler.set_epoch(4)
        assert [b.tolist() for b in loader] == sampler.expected(4)
    assert sampler.draws == [0, 1, 2, 3, 4]


# -- 5. closing is exception-safe; the releaser's errors surface -------------------------------
def test_a_device_that_fails_to_close_still_lets_everything_go(monkeypatch):
    def sticky_error(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(HostDevice, "close", sticky_error)
    seq = make(ImageWorker, 40, slot_bytes=1 << 16)
    seq.start()
    assert next(iter(seq))["label"][0] == 0
    with pytest.raises(RuntimeError, match="illegal memory access"):
        seq.finish()
    assert released(grace=0)
    seq.finish()
    monkeypatch.undo()
    with seq.start():
        assert len(list(b["label"].copy() for b in seq)) == 10


def test_an_error_waiting_for_a_copy_surfaces_at_the_next_batch():
    device = FakeDevice(max_delay=0.002, fail_wait_on=lambda views: 20 in views["label"])
    seq = make(ImageWorker(16), 400, buffer=3, timeout=60, device=lambda: device)
    began = time.monotonic()
    with pytest.raises(ShmSeqError, match="waiting for a copy out of slot .* failed") as info:
        with seq.start():
            for _ in seq:
                pass
    assert time.monotonic() - began < 10
    assert "fake wait failed" in str(info.value.__cause__)


# -- 6. an OSError creating the ring is raised at once -----------------------------------------
def test_an_oserror_creating_the_ring_on_the_probe_path_is_raised_at_once(monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(Ring, "create", no_memory)
    seq = make(ImageWorker, 40, timeout=60)
    began = time.monotonic()
    with pytest.raises(OSError, match="Cannot allocate memory"):
        seq.start()
    assert time.monotonic() - began < 10


# -- 7. batches with no arrays hold no slot ----------------------------------------------------
def test_batches_without_arrays_hold_no_slot():
    seq = make(ListWorker, 400, buffer=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with seq.start():
            got = list(seq)
    assert got[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(got) == 100
    assert seq.stats.copy_out_count == 0


# -- 8. one iteration at a time ----------------------------------------------------------------
def test_nested_iteration_raises_at_once_and_the_sequence_goes_on():
    seq = make(dset_size=40, timeout=60)
    with seq.start():
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="already being iterated.*two sequences"):
            for _ in seq:
                for _ in seq:
                    pass
        assert time.monotonic() - began < 10
        assert [b.tolist()[0] for b in seq] == list(range(0, 40, 4))


def test_concurrent_iteration_from_two_threads_is_refused():
    seq = make(Slow(0.05), 400, num_workers=1)
    failures = []

    def second_consumer():
        try:
            next(iter(seq))
        except RuntimeError as exc:
            failures.append(str(exc))

    with seq.start():
        for k, _ in enumerate(seq):
            if k == 1:
                other = threading.Thread(target=second_consumer)
                other.start()
                other.join()
            if k == 3:
                break
    assert len(failures) == 1 and "already being iterated" in failures[0]


def test_a_bare_iter_does_not_take_an_epoch():
    seq = make(dset_size=12, shuffle=True, seed=3)
    reference = make(dset_size=12, shuffle=True, seed=3).start_test("numpy")
    with seq.start():
        iter(seq)
        assert [b.tolist() for b in seq] == [b.tolist() for b in reference]


# -- 9. finish() from another thread -----------------------------------------------------------
@pytest.mark.parametrize("backend", ["thread", "proc"])
def test_finish_from_another_thread_wakes_a_waiting_consumer(backend):
    seq = make(Slow(2.0), 40, num_workers=1, buffer=1, thread_type=backend, slot_bytes=1 << 16)
    seq.start()
    stopper = threading.Timer(0.3, seq.finish)
    began = time.monotonic()
    stopper.start()
    with pytest.raises(PipelineClosed):
        for _ in seq:
            pass
    woken = time.monotonic() - began
    stopper.join()
    assert woken < 1.3, f"the consumer woke {woken:.1f} s after it started waiting"


# -- 10. len() inside an epoch -----------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_inside_an_epoch_is_that_epochs_length(num_workers):
    seq = make(dset_size=10, batch_size=4, last_batch="rollover", num_workers=num_workers)
    with seq.start():
        assert len(seq) == 2
        assert [len(seq) for _ in seq] == [2, 2]
        assert len(seq) == 3
        assert [len(seq) for _ in seq] == [3, 3, 3]
