import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shmseq import WorkerError
from shmseq.testing import planned_batches, ring_of
from sequences import make, run_checkpointing_at_last_batch
from workers import DtypeWorker, FillWorker, ImageWorker, Pair, SizedWorker, WhoBuilt


def labels_of(batches):
    return [np.asarray(b).tolist() for b in batches]


@pytest.mark.filterwarnings("ignore:the consumer holds")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dset_size=st.integers(0, 120), batch_size=st.integers(1, 17), num_workers=st.integers(1, 3),
       buffer=st.integers(1, 5), backend=st.sampled_from(["proc", "thread"]), shuffle=st.booleans())
def test_every_index_exactly_once_in_order(dset_size, batch_size, num_workers, buffer, backend,
                                           shuffle):
    seq = make(dset_size=dset_size, batch_size=batch_size, num_workers=num_workers, buffer=buffer,
               thread_type=backend, shuffle=shuffle, seed=11)
    with seq.start():
        for epoch in range(2):
            got = [b.copy() for b in seq]
            expected = planned_batches(seq, epoch)
            assert [b.tolist() for b in got] == [b.tolist() for b in expected]
            flat = np.concatenate(got) if got else np.array([], np.int64)
            assert sorted(flat.tolist()) == list(range(dset_size))
            assert len(got) == len(seq)


def test_start_test_order_equals_start_order():
    seq = make(dset_size=50, shuffle=True, seed=5)
    with seq.start():
        parallel = [labels_of([b.copy() for b in seq]) for _ in range(3)]
    test = make(dset_size=50, shuffle=True, seed=5)
    with test.start_test("numpy"):
        serial = [labels_of(test) for _ in range(3)]
    assert parallel == serial
    assert parallel[0] != parallel[1]  # reshuffled each epoch


def test_an_index_array_is_the_dataset():
    indices = np.array([30, 10, 20, 50])
    with make(dset_size=indices, batch_size=3).start() as seq:
        assert labels_of(seq) == [[30, 10, 20], [50]]
        assert seq.dset_size == 4 and len(seq) == seq.length == 2 and seq.batch_size == 3


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_delivered_arrays_are_views_of_the_ring(backend):
    with make(ImageWorker, thread_type=backend).start() as seq:
        ring = ring_of(seq)
        for batch in seq:
            assert ring.contains(batch["image"]) and ring.contains(batch["label"])
            assert batch["image"].flags.writeable
            assert (batch["image"][:, 0, 0, 0] == batch["label"] % 251).all()
            assert batch["names"] == [f"s{i}" for i in batch["label"]]


def test_torch_tensors_share_the_slot():
    torch = pytest.importorskip("torch")
    with make(ImageWorker, out_type="cpu").start() as seq:
        ring = ring_of(seq)
        for batch in seq:
            assert isinstance(batch["image"], torch.Tensor) and batch["image"].dtype == torch.uint8
            assert ring.contains(batch["image"].numpy()) and batch["label"].dtype == torch.int64


def test_in_place_worker_writes_once_into_the_slot():
    with make(FillWorker, slot_bytes=4096).start() as seq:
        ring = ring_of(seq)
        for k, (values, labels) in enumerate(seq):
            assert ring.contains(values) and values.dtype == np.float32
            assert labels.tolist() == list(range(4 * k, 4 * k + 4))
            assert (values[:, 3] == labels).all()


@pytest.mark.parametrize("slot_bytes", [1 << 17, None])
def test_only_slot_ids_cross_the_middle_pipe(monkeypatch, slot_bytes):
    """From start() on: the first batches, which size the ring when no slot_bytes is given,
    are written into their slots by their workers too."""
    read = os.read
    reads = []

    def recording(fd, size):
        data = read(fd, size)
        reads.append((fd, len(data)))
        return data

    monkeypatch.setattr(os, "read", recording)
    with make(ImageWorker(64), 1000, slot_bytes=slot_bytes, start_method="fork").start() as seq:
        reply_fds = {handle.replies.fd for handle in seq.pipeline.pool.handles}
        batches = sum(1 for _ in seq)
    monkeypatch.undo()
    replies = sum(size for fd, size in reads if fd in reply_fds)
    assert batches == 250 and 0 < replies / batches < 100, (
        f"{replies} bytes crossed the reply pipes for {batches} batches")


def test_keeping_every_batch_neither_deadlocks_nor_corrupts():
    with make(ImageWorker, dset_size=60, buffer=3, num_workers=2).start() as seq:
        with pytest.warns(RuntimeWarning, match="copied out of the ring"):
            kept = list(seq)
    assert len(kept) == 15
    assert seq.stats.copy_out_count >= 13 - 2 and seq.stats.batches == 15
    for k, batch in enumerate(kept):
        assert batch["label"].tolist() == list(range(4 * k, 4 * k + 4))
        assert (batch["image"][:, 3, 3, 1] == batch["label"] % 251).all()


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_oversize_batches_arrive_intact_and_name_a_slot_size_that_fits_them_all(backend):
    sizes = [1000, 50_000, 1000, 200_000, 1000, 210_000]
    with make(SizedWorker(sizes), dset_size=18, batch_size=1, slot_bytes=8192,
              thread_type=backend).start() as seq:
        with pytest.warns(RuntimeWarning, match=r"slot_bytes=\d+") as caught:
            batches = [(data.copy(), labels.copy()) for data, labels in seq]
    suggested = [int(re.search(r"slot_bytes=(\d+)", str(w.message))[1]) for w in caught
                 if "overflow" in str(w.message)]
    assert len(suggested) == 1 and suggested[0] >= 50_000  # once, for the first oversize batch
    assert seq.stats.overflow_count == 9 and seq.stats.largest_overflow_bytes > 210_000
    assert seq.stats.suggested_slot_bytes > seq.stats.largest_overflow_bytes
    for k, (data, labels) in enumerate(batches):
        assert len(data) == sizes[k % 6] and (data == k % 256).all() and labels.tolist() == [k]


def test_auto_sized_slots_fit_the_batches():
    with make(ImageWorker, dset_size=64, batch_size=8).start() as seq:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sum(1 for _ in seq) == 8
        assert ring_of(seq).spec.slot_bytes >= 8 * 8 * 8 * 3


def allocated_bytes(ring) -> int:
    """Bytes of the ring's segment /dev/shm has given it."""
    return os.fstat(ring.spec.owner_fd).st_blocks * 512


GROWING = [100_000] * 6 + [120_000] + [100_000] * 5  # batch 6 is a fifth larger than the first


@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_a_ring_sized_by_its_first_batch_allocates_room_for_larger_ones_when_one_comes(backend):
    """A slot holds a quarter more than the first batch, for larger batches that may never
    come: only what the first batch took is allocated in each slot up front; a larger one
    allocates the rest of its slot first, and arrives in it, with no overflow."""
    with make(SizedWorker(GROWING), dset_size=12, batch_size=1, num_workers=1, buffer=4,
              thread_type=backend).start() as seq:
        ring = ring_of(seq)
        ring.wait_reserved()
        before = allocated_bytes(ring)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = [(data.copy(), labels.copy()) for data, labels in seq]
        after = allocated_bytes(ring)
    spec = ring.spec
    assert before == spec.reserved_bytes < spec.total_bytes
    assert after == before + spec.stride - spec.reserved  # the rest of one slot
    assert [len(data) for data, _ in batches] == GROWING and seq.stats.overflow_count == 0
    assert all((data == k).all() and labels.tolist() == [k] for k, (data, labels) in enumerate(batches))


def test_room_for_a_larger_batch_dev_shm_cannot_give_is_refused_at_that_batch(monkeypatch):
    """Never a SIGBUS: the rest of a slot is allocated before a larger batch is written there."""
    from shmseq import SharedMemoryFull

    real = os.posix_fallocate

    def refusing_the_rest_of_a_slot(fd, start, size):
        if start % stride:
            raise OSError(28, "No space left on device")
        real(fd, start, size)

    seq = make(SizedWorker(GROWING), dset_size=12, batch_size=1, num_workers=1, buffer=4,
               thread_type="thread")
    with seq.start():
        stride = ring_of(seq).spec.stride
        monkeypatch.setattr(os, "posix_fallocate", refusing_the_rest_of_a_slot)
        kind, message, _, _ = first_error_after(seq, 6)
    assert kind is SharedMemoryFull and "slot" in message and "of the ring needs" in message


def test_breaking_out_mid_epoch_then_a_whole_next_epoch():
    with make(dset_size=40, buffer=4).start() as seq:
        for k, batch in enumerate(seq):
            if k == 2:
                break
        del batch
        assert labels_of(b.copy() for b in seq) == [list(range(i, i + 4)) for i in range(0, 40, 4)]
        assert seq.epoch == 2


def test_start_while_running_interrupts_cleanly():
    seq = make(dset_size=400, shuffle=True, seed=1)
    seq.start()
    iterator = iter(seq)
    first = next(iterator)
    seq.start()
    with pytest.raises(Exception, match="finished or restarted"):
        next(iterator)
    del first
    assert len(list(b.copy() for b in seq)) == 100
    seq.finish()
    seq.finish()


def first_error(seq):
    """What the first batch raises, caught as it is raised (pytest.raises keeps the exception,
    and with its traceback the frames holding the pipeline, until a garbage collection)."""
    try:
        next(iter(seq))
    except Exception as exc:  # noqa: BLE001 - the exception is what is looked at
        return type(exc), str(exc), exc.__cause__, getattr(exc, "__notes__", [])
    raise AssertionError("the first batch did not fail")


def first_error_after(seq, batches: int):
    """What the epoch raises once ``batches`` batches came (as ``first_error``)."""
    iterator = iter(seq)
    for _ in range(batches):
        next(iterator)
    return first_error(iterator)


@pytest.mark.parametrize("backend", ["proc", "thread"])
@pytest.mark.parametrize("slot_bytes", [None, 4096])
def test_a_worker_exception_is_raised_as_its_own_type_with_its_batch(backend, slot_bytes):
    seq = make(SizedWorker([]), dset_size=8, thread_type=backend, slot_bytes=slot_bytes)
    with seq.start():
        kind, message, record, notes = first_error(seq)
    assert kind is ZeroDivisionError and isinstance(record, WorkerError)
    assert record.batch_indices.tolist() == [0, 1, 2, 3] and record.exc_type.endswith("ZeroDivisionError")
    assert "Worker traceback" in str(record) and "in __getitem__" in record.worker_traceback
    assert "failed on batch 0 of epoch 0 (sample indices [0, 1, 2, 3])" in notes[0]


def test_iterating_before_start_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"call start\(\)"):
        iter(make())


def test_cuda_falls_back_to_cpu_with_one_warning_per_process():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    script = textwrap.dedent("""
        import warnings
        from shmseq import ShmSequence
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            sequences = [ShmSequence(dict, 8, out_type="cuda") for _ in range(3)]
        print([seq.out_type for seq in sequences], [str(w.message).split(":")[0] for w in caught])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("['cpu', 'cpu', 'cpu'] "
                                   "[\"out_type='cuda' but CUDA is not available\"]")


def test_zero_workers_runs_in_the_calling_thread():
    with make(num_workers=0).start() as seq:
        assert labels_of(seq)[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_methods(method):
    with make(ImageWorker, dset_size=24, start_method=method).start() as seq:
        assert [b["label"].tolist()[0] for b in seq] == [0, 4, 8, 12, 16, 20]


def test_an_unpicklable_worker_is_refused_at_start_for_spawn():
    class Local:  # cannot be pickled: defined in a function
        def __getitem__(self, indices):
            return indices

    seq = make(Local, start_method="spawn")
    with pytest.raises(TypeError, match="cannot be pickled.*start_method='spawn'"):
        seq.start()


def test_resource_tracker_stays_quiet_with_spawn(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from shmseq import ShmSequence, WorkerError
        from workers import ImageWorker
        if __name__ == "__main__":
            seq = ShmSequence(ImageWorker, 32, batch_size=4, num_workers=2, out_type="null",
                              start_method="spawn")
            with seq.start():
                print(sum(1 for _ in seq))
    """ % str(__import__("pathlib").Path(__file__).parent)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "8"
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_stats_count_what_the_loader_did():
    with make(ImageWorker, dset_size=40).start() as seq:
        for _ in seq:
            pass
        stats = seq.stats
    assert stats.batches == 10 and stats.bytes == 40 * (8 * 8 * 3 + 8)
    assert stats.worker_busy_s > 0 and 0 <= stats.stall_fraction <= 1
    assert stats.overflow_count == stats.copy_out_count == 0
    assert set(stats.as_dict()) >= {"batches", "bytes", "consumer_wait_s", "stall_fraction"}


@pytest.mark.parametrize("out_type", ["null", "cpu"])
def test_a_bfloat16_tensor_comes_back_as_itself_from_the_slot(out_type):
    torch = pytest.importorskip("torch")
    with make(DtypeWorker("bfloat16"), out_type=out_type).start() as seq:
        for k, batch in enumerate(b for b in seq):
            expected = torch.tensor(list(range(4 * k, 4 * k + 4)), dtype=torch.float32)
            assert batch.dtype == torch.bfloat16
            assert torch.equal(batch, expected.to(torch.bfloat16) / 3)
            assert ring_of(seq).contains(batch.view(torch.int16).numpy())


@pytest.mark.parametrize("out_type", ["null", "cpu"])
def test_a_big_endian_array_round_trips(out_type):
    if out_type == "cpu":
        pytest.importorskip("torch")
    with make(DtypeWorker("big-endian"), out_type=out_type, buffer=12).start() as seq:
        batches = [b for b in seq]
        values = [np.asarray(b).tolist() for b in batches]
    assert values == [[1000 * i for i in range(k, k + 4)] for k in range(0, 40, 4)]
    if out_type == "null":
        assert batches[0].dtype == np.dtype(">i4")


def test_a_namedtuple_keeps_its_type():
    with make(DtypeWorker("namedtuple")).start() as seq:
        batch = next(iter(seq))
        assert type(batch) is Pair and batch.label.tolist() == [0, 1, 2, 3]
        assert batch.image.shape == (4, 2) and ring_of(seq).contains(batch.image)
        del batch


def test_a_masked_array_keeps_its_mask():
    with make(DtypeWorker("masked"), slot_bytes=4096).start() as seq:
        batch = next(iter(seq))
        assert isinstance(batch, np.ma.MaskedArray) and batch.mask.tolist() == [True, False] * 2
        del batch


def _builders(worker, consumer_seconds: float) -> list[int]:
    """Which worker built each batch of the epoch's second half (the first fills the ring)."""
    with make(worker, dset_size=160, buffer=8, slot_bytes=4096).start() as seq:
        built = []
        for who, _ in seq:
            built.append(int(who[0]))
            time.sleep(consumer_seconds)
    return built[len(built) // 2:]


def test_a_slow_consumer_keeps_its_tasks_on_a_worker_that_is_awake():
    """Batches wait for the consumer: tasks go to the first worker with room, not to a sleeping
    one woken for each batch."""
    builders = _builders(WhoBuilt(0.0), consumer_seconds=0.005)
    assert max(builders.count(0), builders.count(1)) >= 0.9 * len(builders), builders


def test_slow_workers_share_the_work():
    """The consumer waits for batches: tasks are spread over the workers."""
    builders = _builders(WhoBuilt(0.01), consumer_seconds=0.0)
    assert min(builders.count(0), builders.count(1)) >= 0.3 * len(builders), builders


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:the consumer holds")  # a one-slot ring: copied out
@pytest.mark.parametrize("backend", ["proc", "thread"])
@pytest.mark.parametrize("slot_bytes", [None, 4096])
def test_start_returns_once_the_workers_are_ready_not_at_its_timeout(backend, slot_bytes):
    """A reply read without waiting (the last worker mapping the ring, say) ends the wait of
    start(): twenty starts, each allowed 60 s, fit in the test's 30 s."""
    for _ in range(20):
        seq = make(dset_size=1, batch_size=1, num_workers=1, buffer=1, thread_type=backend,
                   slot_bytes=slot_bytes, timeout=60)
        with seq.start():
            assert [b.tolist() for b in seq] == [[0]]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_processes_run_torchs_operators_on_one_thread(start_method):
    torch = pytest.importorskip("torch")
    from workers import ThreadCount
    torch.set_num_threads(2)
    with make(ThreadCount, dset_size=8, start_method=start_method).start() as seq:
        assert {int(n) for batch in seq for n in batch} == {1}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_an_epochs_last_batch_resumes_to_its_end_not_its_start(workers):
    """A loop that checkpoints at the last batch of an epoch and counts epochs itself (calling
    set_epoch from its counter, as trainers do) goes on with the next epoch, as under
    torchdata's loaders: the finished epoch is not given again."""
    full, state = run_checkpointing_at_last_batch(make(shuffle=True, seed=5,
                                                       num_workers=workers), range(2))
    assert (state["epoch"], state["position"]) == (0, 10)
    resumed, _ = run_checkpointing_at_last_batch(make(shuffle=True, seed=5, num_workers=workers),
                                                 range(0, 2), state)
    assert resumed == full[10:]  # nothing of epoch 0, then epoch 1 as the uninterrupted run
