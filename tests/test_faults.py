"""Every failure is reported within seconds, nothing hangs, nothing leaks (leaks: conftest)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shmseq.engine.common.segments
from shmseq import (BatchTimeout, SharedMemoryFull, ShmSeqError, ShmSequence, UnsupportedBatch,
                    WorkerDied, WorkerError)
from shmseq.engine.trainer.devices import HostDevice
from shmseq.testing import worker_pids
from jobs import running
from leaks import leftovers, shm_entries
from shmseq.engine.common.ragged import Ragged
from shmseq.engine.worker.batch import check_rows
from workers import (BadReturn, Crash, DieOrDawdle, DiesUnpickled, ExitInInit, FailingInit, Hang,
                     IndexWorker, ImageWorker, SampleDataset, SampleWithLabels, ScalarLabels, Slow,
                     SlowStart5, TypeErrorAt)
from sequences import make

TESTS = Path(__file__).parent


@pytest.mark.parametrize("backend", ["proc", "thread"])
@pytest.mark.parametrize("slot_bytes", [None, 4096])
def test_a_failing_constructor_fails_start_and_a_later_start_works(backend, slot_bytes):
    seq = make(FailingInit, thread_type=backend, slot_bytes=slot_bytes)
    with pytest.raises(OSError, match="cannot open the dataset file") as info:
        seq.start()
    record = info.value.__cause__
    assert isinstance(record, WorkerError) and "__init__" in record.worker_traceback
    assert "failed to start" in str(record) and "failed to start" in info.value.__notes__[0]
    seq.worker = IndexWorker
    with seq.start():
        assert len(list(b.copy() for b in seq)) == 10


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSEGV", "exit"])
def test_a_dying_worker_is_named_within_seconds(how):
    seq = make(Crash(how, at=13), dset_size=400, timeout=100)
    began = time.monotonic()
    with pytest.raises(WorkerDied) as info:  # from start() or from the iteration
        with seq.start():
            for batch in seq:
                del batch  # info's traceback holds this frame: it must not hold a batch
    assert time.monotonic() - began < 10
    expected = "exited with code 3" if how == "exit" else f"killed by signal {how}"
    assert expected in str(info.value) and f"pid {info.value.pid}" in str(info.value)
    assert "batch 3" in str(info.value) and "12, 13, 14, 15" in str(info.value)


def test_a_hanging_worker_times_out_naming_the_batch():
    seq = make(Hang(at=9), timeout=1.0)
    with seq.start():
        began = time.monotonic()
        with pytest.raises(BatchTimeout, match=r"batch 2 of epoch 0 \(sample indices \[8, 9, 10, 11\]\)"
                                               r".*timeout=1.0 s.*worker \d \(pid \d+\)"):
            for _ in seq:
                pass
        assert time.monotonic() - began < 10


@pytest.mark.timeout(60)
def test_a_hanging_worker_with_large_index_batches_still_times_out():
    """Tasks pile up unread in a hung worker's pipe: sending them must never block the consumer."""
    seq = make(Hang(at=0), dset_size=40_000, batch_size=4096, num_workers=1, buffer=10,
               slot_bytes=1 << 16, timeout=1.0)
    with seq.start():
        with pytest.raises(BatchTimeout, match="batch 0 of epoch 0"):
            next(iter(seq))


def test_a_worker_that_cannot_start_stops_the_ones_that_did(monkeypatch):
    import multiprocessing
    real = multiprocessing.get_context("fork")

    class SecondForkFails:
        def get_start_method(self):
            return "fork"

        def Process(self, *args, name, **kwargs):
            if name.endswith("-1"):
                raise OSError("cannot fork: resource temporarily unavailable")
            return real.Process(*args, name=name, **kwargs)

    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: SecondForkFails())
    with pytest.raises(OSError, match="cannot fork"):
        make(num_workers=3).start()


def test_an_error_shuts_the_pipeline_down():
    seq = make(Crash("SIGKILL", at=25), slot_bytes=4096)
    with pytest.raises(WorkerDied):
        seq.start()
        list(seq)
    with pytest.raises(RuntimeError, match="not running"):
        iter(seq)


def test_the_consumer_raising_mid_epoch_leaves_nothing():
    with pytest.raises(ZeroDivisionError):
        with make(dset_size=400).start() as seq:
            for k, _ in enumerate(seq):
                if k == 3:
                    1 / 0


def test_ctrl_c_while_waiting_for_a_batch():
    main = threading.main_thread().ident
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        with make(Slow(0.2), dset_size=400).start() as seq:
            timer.start()
            for _ in seq:
                pass
    timer.join()


@pytest.mark.parametrize("method, tries", [("fork", 25), ("spawn", 6)])
def test_every_ctrl_c_reaches_the_training_loop(method, tries):
    """A Ctrl-C lands anywhere in a tight loop over torch batches, the last view of a batch
    dying there at every step: each one is the loop's KeyboardInterrupt (never printed as
    "Exception ignored" and dropped), the workers are gone, and the next start() works."""
    pytest.importorskip("torch")
    script = textwrap.dedent(f"""
        import os, random, signal, sys, threading, time
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence
        from workers import ImageWorker
        from leaks import leftovers
        if __name__ == "__main__":
            rng, raised = random.Random(0), 0
            seq = ShmSequence(ImageWorker(8), 10**6, batch_size=4, num_workers=2, buffer=4,
                              out_type="cpu", start_method={method!r}, timeout=30)
            for _ in range({tries}):
                try:
                    with seq.start():
                        timer = threading.Timer(rng.uniform(0.01, 0.1), signal.pthread_kill,
                                                (threading.main_thread().ident, signal.SIGINT))
                        timer.start()
                        for batch in seq:
                            pass
                except KeyboardInterrupt:
                    raised += 1
                timer.join()
                batch = None  # the views of the last batch keep its ring mapped, by design
            print("raised", raised, "left", leftovers(grace=1.0))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["raised", str(tries), "left", "{}"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_a_failing_converter_surfaces(monkeypatch):
    def convert(self, batch):
        if batch[0] == 8:
            raise ValueError("device is gone")
        return batch, None

    monkeypatch.setattr(HostDevice, "convert", convert)
    with make().start() as seq:
        with pytest.raises(ShmSeqError,
                           match="converting batch 2 of epoch 0 failed: ValueError: device is gone"):
            for _ in seq:
                pass


@pytest.mark.parametrize("slot_bytes", [None, 40 << 20])
def test_not_enough_shared_memory_is_refused_at_start(monkeypatch, slot_bytes):
    monkeypatch.setattr(shmseq.engine.common.segments, "shm_free_bytes", lambda: 64 << 20)
    seq = make(ImageWorker(1024), dset_size=64, batch_size=8, buffer=10, slot_bytes=slot_bytes)
    with pytest.raises(SharedMemoryFull, match=r"needs [\d,]+ bytes.*has 67,108,864 free.*--shm-size"):
        seq.start()


def _in_a_small_dev_shm(script: str, megabytes: int = 64) -> subprocess.CompletedProcess:
    """Run ``script`` in a mount namespace of its own whose /dev/shm is a ``megabytes`` tmpfs
    (skipped where this process may not make one)."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs unshare -m (a private mount namespace) to make a small /dev/shm")
    command = (f"mount -t tmpfs -o size={megabytes}m tmpfs /dev/shm && "
               f"exec {sys.executable} -c \"$0\"")
    return subprocess.run(["unshare", "-m", "sh", "-c", command, script], capture_output=True,
                          text=True, timeout=120)


def test_dev_shm_taken_by_another_program_after_the_check_is_refused_at_once():
    """Another program takes /dev/shm space and gives it back in a loop: each start() either
    works or raises SharedMemoryFull naming the bytes, within a second; nothing is left; once the
    space is back, start() works."""
    script = textwrap.dedent(f"""
        import multiprocessing, os, sys, time
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence, SharedMemoryFull
        from workers import ImageWorker

        def hog(stop):
            while not stop.is_set():
                with open("/dev/shm/other-program", "wb") as taken:
                    try:
                        os.posix_fallocate(taken.fileno(), 0, 30 << 20)
                    except OSError:
                        pass
                    time.sleep(0.001)
                os.unlink("/dev/shm/other-program")

        def sequence():
            return ShmSequence(ImageWorker(512), 96, batch_size=8, num_workers=2, buffer=6,
                               out_type="null", timeout=20)

        if __name__ == "__main__":
            stop = multiprocessing.Event()
            other = multiprocessing.Process(target=hog, args=(stop,))
            other.start()
            for _ in range(15):
                began = time.monotonic()
                try:
                    with sequence().start() as seq:
                        outcome = f"ok {{sum(1 for _ in seq)}}"
                except SharedMemoryFull as refused:
                    outcome = "full" if "bytes of shared memory" in str(refused) else str(refused)
                print(outcome, time.monotonic() - began < 1.0, flush=True)
            stop.set()
            other.join()
            with sequence().start() as seq:
                print("after", sum(1 for _ in seq), os.listdir("/dev/shm"))
    """)
    done = _in_a_small_dev_shm(script)
    lines = done.stdout.splitlines()
    assert lines[-1:] == ["after 12 []"], done.stdout + done.stderr
    assert {line for line in lines[:-1]} <= {"ok 12 True", "full True"}, done.stdout
    assert "full True" in lines, done.stdout  # the race was met


@pytest.mark.parametrize("options, message", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"num_workers": -1}, "num_workers must be an integer >= 0 or 'auto' .*, got -1"),
    ({"buffer": 0}, "buffer must be an integer >= 1 or None, got 0"),
    ({"slot_bytes": 0}, "slot_bytes must be an integer >= 1 or None, got 0"),
    ({"num_converters": 0}, "num_converters"),
    ({"out_type": "gpu"}, "out_type must be .* got 'gpu'"),
    ({"thread_type": "fiber"}, "thread_type must be one of 'proc', 'thread', got 'fiber'"),
    ({"start_method": "vfork"}, "start_method must be one of .* got 'vfork'"),
    ({"timeout": 0}, r"timeout must be a number of seconds in \(0, 2,147,483\].*got 0"),
    ({"timeout": float("nan")}, "timeout must be .*got nan"),
    ({"timeout": 3e6}, "timeout must be .*or None .*got 3000000.0"),
    ({"timeout": -float("inf")}, "timeout must be .*got -inf"),
    ({"dset_size": -5}, "dset_size must be >= 0, got -5"),
    ({"dset_size": 2**70}, "dset_size=1,180,591,620,717,411,303,424 is more samples than can be"),
    ({"dset_size": 10.0}, "dset_size must be an int .* got float 10.0"),
    ({"dset_size": np.zeros((3, 2), int)}, r"dset_size .* must be 1-D, got shape \(3, 2\)"),
])
def test_bad_arguments_fail_at_construction(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make(**options)


@pytest.mark.parametrize("options, message", [
    ({"batch_size": "64"}, r"batch_size must be an integer >= 1, got '64' \(str\)"),
    ({"batch_size": True}, r"batch_size must be an integer >= 1, got True \(bool\)"),
    ({"num_workers": 2.0}, r"num_workers must be an integer >= 0 or 'auto' .*, got 2.0 \(float\)"),
    ({"seed": "7"}, "seed must be an integer >= 0 or None, got '7'"),
    ({"shuffle": "yes"}, r"shuffle must be True or False, got 'yes' \(str\)"),
    ({"shuffle": None}, "shuffle must be True or False, got None"),
    ({"pin_memory": "no"}, "pin_memory must be True or False or None, got 'no'"),
    ({"timeout": "30"}, "timeout must be a number of seconds .*got '30'"),
])
def test_arguments_of_the_wrong_type_are_type_errors_naming_them(options, message):
    with pytest.raises(TypeError, match=message):
        make(**options)


@pytest.mark.parametrize("timeout", [None, float("inf")])
def test_no_timeout_waits_as_long_as_it_takes(timeout):
    with make(Slow(0.01), timeout=timeout).start() as seq:
        assert seq.timeout is None and len(list(b.copy() for b in seq)) == 10


def test_a_worker_without_getitem_is_refused():
    with pytest.raises(TypeError, match="worker must be .* __getitem__"):
        ShmSequence(object(), 10)


def test_a_worker_returning_none_is_told_so_with_its_batch():
    with make(BadReturn("none"), slot_bytes=4096).start() as seq:
        try:
            next(iter(seq))
        except UnsupportedBatch as exc:  # not pytest.raises: its record would hold the frames
            cause, message = exc.__cause__, str(exc)
    assert "returned None" in message and isinstance(cause, WorkerError)
    assert cause.exc_type == "shmseq.engine.common.errors.UnsupportedBatch"
    assert cause.batch_indices.tolist() == [0, 1, 2, 3]


def first_batch_refusal(worker, options: dict) -> str:
    """What the ``UnsupportedBatch`` of ``worker``'s first batch of 16 says ("" if none came)."""
    message = ""
    with make(worker, dset_size=64, batch_size=16, **options).start() as seq:
        try:
            next(iter(seq))
        except UnsupportedBatch as exc:  # not pytest.raises: its record would hold the frames
            message = str(exc)
    return message


@pytest.mark.parametrize("options", [{}, {"thread_type": "thread"}, {"num_workers": 0}])
def test_a_dataset_of_samples_is_refused_naming_the_sample_level_loaders(options):
    """Given the batch's index array, a dataset written for one index returns one sample: an
    image of (3, 8, 8) and a label of (4,) for a batch of 16, which would travel as a batch."""
    message = first_batch_refusal(SampleDataset(), options)
    assert "arrays of shapes (3, 8, 8), (4,) for the 16 sample indices" in message
    assert "shmseq.DataLoader" in message and "shmseq.torch.DataLoader" in message


@pytest.mark.parametrize("options", [{}, {"num_workers": 0}])
def test_a_dataset_of_samples_with_a_label_per_index_is_refused(options):
    """Given the batch's index array, a dataset written for one index returns one image of
    (3, 8, 8) and ``indices % 10``: the labels' row per index must not let the image through
    as a batch."""
    message = first_batch_refusal(SampleWithLabels(), options)
    assert "arrays of shapes (3, 8, 8), (16,) for the 16 sample indices" in message
    assert "largest, (3, 8, 8), has no row per index" in message
    assert "shmseq.DataLoader" in message and "shmseq.torch.DataLoader" in message


@pytest.mark.parametrize("batch", [
    (np.zeros((3, 32, 32), np.float32), np.arange(16) % 10),        # one CHW image, the labels
    {"image": np.zeros((1, 28, 28, 2)), "id": np.arange(16), "w": np.ones(16)},
])
def test_a_sample_beside_arrays_of_one_row_per_index_fails_the_rows_check(batch):
    with pytest.raises(UnsupportedBatch, match="has no row per index"):
        check_rows(batch, np.arange(16))


@pytest.mark.parametrize("options", [{}, {"num_workers": 0}])
def test_a_dataset_of_samples_failing_on_the_index_array_is_told_what_it_was_given(options):
    """``int(labels[indices])`` fails with numpy's words alone; the first batch's failure
    says that the worker was given an array of indices, and where a dataset of samples goes."""
    notes, cause = [], None
    with make(ScalarLabels(), dset_size=64, batch_size=16, **options).start() as seq:
        try:
            next(iter(seq))
        except TypeError as exc:  # not pytest.raises: its record would hold the frames
            notes, cause = exc.__notes__, exc.__cause__
    hint = ("worker[indices] was given a 1-D int64 array of 16 sample indices, not one index: a "
            "dataset whose __getitem__ takes one index goes to shmseq.torch.DataLoader "
            "or shmseq.DataLoader")
    assert any(hint in note for note in notes)
    if options:
        return
    assert isinstance(cause, WorkerError) and hint in str(cause)
    assert "int(self.labels[index])" in cause.worker_traceback


@pytest.mark.parametrize("at, told", [(9, False), (1, True)])
def test_only_a_first_batch_failing_is_told_about_index_arrays(at, told):
    """A TypeError of the third batch comes from a worker that took the index arrays of two."""
    notes = []
    with make(TypeErrorAt(at), dset_size=16, num_workers=1).start() as seq:
        try:
            for _ in seq:
                pass
        except TypeError as exc:  # not pytest.raises: its record would hold the frames
            notes = exc.__notes__
    assert notes and any("array of 4 sample indices" in note for note in notes) == told


@pytest.mark.parametrize("batch", [
    (np.zeros((16, 3, 8, 8)), np.zeros(3), np.int64(7)),            # per-sample rows and extras
    {"ids": np.array([5]), "images": [np.zeros(k) for k in range(16)]},  # a list of 16 items
    Ragged.from_items([np.zeros(k) for k in range(16)]),            # 16 ragged items
    pytest.param("nested", id="a-nested-tensor-of-16-items"),
    [1.5] * 16,                                                     # no array at all
    ("names", 3.0, np.float32(1)),                                  # nothing with rows
    (np.zeros((5, 16, 3)), np.arange(16)),                          # time-major, its lengths
    (np.zeros((2, 16, 3, 8, 8)), np.arange(16)),                    # two views of each sample
    (np.zeros((40, 3)), np.zeros((2, 90), np.int64), np.arange(16)),  # a graph: nodes, edges
    (np.zeros((9, 4)), np.arange(16)),                              # 9 boxes in 16 images
])
def test_a_batch_with_a_row_per_index_anywhere_passes_the_rows_check(batch):
    if isinstance(batch, str):
        torch = pytest.importorskip("torch")
        batch = torch.nested.nested_tensor([torch.zeros(k) for k in range(16)])
    check_rows(batch, np.arange(16))


@pytest.mark.parametrize("kind", ["objects", "set"])
def test_a_batch_of_objects_travels_pickled(kind):
    with make(BadReturn(kind), slot_bytes=4096).start() as seq:
        batch = next(iter(seq))
        assert (batch.dtype == object) if kind == "objects" else batch[1] == {1, 2}
        del batch


def test_two_hundred_start_finish_cycles_leak_nothing():
    """In a process of its own, which imports no more than a trainer: in this one, which
    imported torch, transformers and the rest, a fork costs more and a cycle took 60 ms
    instead of 15, the test 12 s."""
    script = textwrap.dedent(f"""
        import gc, multiprocessing, os, sys, threading
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence
        from workers import IndexWorker
        from leaks import leftovers

        def resources():
            gc.collect()
            return (len(os.listdir("/proc/self/fd")), threading.active_count(),
                    len(multiprocessing.active_children()))

        if __name__ == "__main__":
            seq = ShmSequence(IndexWorker, 40, batch_size=4, num_workers=1, shuffle=False,
                              out_type="null", timeout=30, slot_bytes=4096, start_method="fork")
            for _ in range(3):  # let lazily created objects (selectors, imports) settle first
                seq.start()
                seq.finish()
            print(resources())
            for cycle in range(200):
                seq.start()
                if cycle % 50 == 0:
                    assert len(next(iter(seq))) == 4
                seq.finish()
            print(resources())
            print(leftovers(grace=1.0))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    before, after, left = done.stdout.splitlines()
    assert after == before and left == "{}"


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_soak_twenty_thousand_batches_through_three_slots():
    seq = make(ImageWorker(4), dset_size=20_000 * 4, buffer=3)
    with seq.start():
        pids = [os.getpid()] + worker_pids(seq)
        for k, batch in enumerate(seq):
            assert batch["label"][0] == 4 * k and batch["image"][3, 1, 1, 2] == (4 * k + 3) % 251
            sum(range(200))  # a consumer slower than the workers
            if k == 2_000:
                early = [_rss_kib(pid) for pid in pids]
        late = [_rss_kib(pid) for pid in pids]
    assert k == 19_999
    growth = [b - a for a, b in zip(early, late)]
    assert max(growth) < 8 * 1024, f"resident memory grew by {growth} KiB"


@pytest.mark.parametrize("method, slot_bytes", [
    ("fork", None), ("forkserver", None),
    ("fork", 4096),  # overflowing batches: workers blocked sending to the dead consumer
])
def test_killing_the_main_process_leaves_no_worker_and_no_segment(method, slot_bytes):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence
        from shmseq.testing import worker_pids
        from workers import ImageWorker
        if __name__ == "__main__":
            seq = ShmSequence(ImageWorker(64), 10_000, batch_size=4, num_workers=2,
                              out_type="null", start_method={method!r},
                              slot_bytes={slot_bytes!r}).start()
            batches = iter(seq)
            next(batches)
            print(*worker_pids(seq), flush=True)
            seq.pipeline.pool.exchange(0.5, waiting=0)  # overflowing workers now block on full pipes
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    consumer, output = _run_killed(script)
    pids = [int(pid) for pid in output.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids)), "workers outlived their killed parent"
    assert not shm_entries({consumer})


def test_killing_the_main_process_during_start_leaves_no_segment():
    """Killed while waiting for its workers to map the ring: its name was unlinked as the ring
    was made, so nothing is left whatever the workers do."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence
        from workers import SlowStart
        if __name__ == "__main__":
            seq = ShmSequence(SlowStart, 100, batch_size=4, num_workers=2, out_type="null",
                              slot_bytes=4096, start_method="fork")
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            seq.start()
    """)
    consumer, _ = _run_killed(script)
    deadline = time.monotonic() + 5
    while shm_entries({consumer}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm_entries({consumer})


def _run_killed(script: str) -> tuple[int, str]:
    """Run ``script``, which kills itself: its pid (which its rings' names carry), its output."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    output, errors = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, errors
    return process.pid, output


# -- workers never outlive the consumer; errors come first --------------------------------------
def _alive(pids) -> list[int]:
    return [pid for pid in pids if running(pid)]


def _run_until_killed(script: str, inside: int) -> tuple[int, list[int], float]:
    """Run ``script`` and SIGKILL it once ``inside`` of its workers said they are in their
    30-second call (``workers.say_inside``), and a moment more for them to be in it: its pid,
    the workers' pids (from the line ``workers PID PID`` the script prints, else from what
    both workers said), and when it died. A run that never gets there fails after a minute."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    guard = threading.Timer(60, process.kill)
    guard.start()
    with process.stdout:  # the workers hold it too: never wait for its end
        pids, entered = [], []
        while ((len(entered) < inside or len(pids or entered) < 2)
               and (line := process.stdout.readline())):
            said, *numbers = line.split()
            if said == "workers":
                pids = [int(pid) for pid in numbers]
            else:
                entered.append(int(numbers[0]))
        time.sleep(0.1)
        guard.cancel()
        process.kill()
        process.wait(timeout=30)
        return process.pid, pids or entered, time.monotonic()


_IMPORTS = """
import concurrent.futures, os, sys, threading, time
sys.path.insert(0, {tests!r})
from shmseq import ShmSequence
from shmseq.testing import worker_pids
import workers

def say_workers(seq):
    # one write, which a worker's own line cannot cut in two
    os.write(1, ("workers " + " ".join(map(str, worker_pids(seq))) + chr(10)).encode())
"""


METHODS = ["fork", "spawn", "forkserver"]


@pytest.mark.parametrize("worker", ["workers.Sleeps()", "workers.HoldsTheGil()"],
                         ids=["python", "c-holding-the-gil"])
@pytest.mark.parametrize("method", METHODS)
def test_workers_inside_user_code_leave_within_a_second_of_a_killed_consumer(method, worker):
    script = _IMPORTS.format(tests=str(TESTS)) + textwrap.dedent(f"""
        if __name__ == "__main__":
            seq = ShmSequence({worker}, 400, batch_size=4, num_workers=2, slot_bytes=4096,
                              out_type="null", start_method={method!r}).start()
            say_workers(seq)
            next(iter(seq))
    """)
    consumer, pids, died = _run_until_killed(script, inside=1)  # the batches may all go to one
    assert len(pids) == 2
    while _alive(pids) and time.monotonic() - died < 5:
        time.sleep(0.02)
    assert not _alive(pids)
    assert time.monotonic() - died < 1.0 + 0.3, "a worker outlived its consumer by over a second"
    assert not shm_entries({consumer})


@pytest.mark.parametrize("method, starter", [
    ("fork", "a thread still running"), ("fork", "a thread that has ended"),
    ("spawn", "a thread that has ended"), ("forkserver", "a thread that has ended")])
def test_workers_follow_the_process_not_the_thread_that_started_them(method, starter):
    """Frameworks start loaders from threads (prefetchers, servers, notebooks' jobs): workers
    in a C call that holds the GIL (no watchdog thread of theirs can run) still leave within a
    second of the trainer's death."""
    script = _IMPORTS.format(tests=str(TESTS)) + textwrap.dedent(f"""
        def start(then_take_one):
            seq = ShmSequence(workers.HoldsTheGil(), 400, batch_size=4, num_workers=2,
                              slot_bytes=4096, out_type="null", start_method={method!r}).start()
            say_workers(seq)
            if then_take_one:
                next(iter(seq))
            return seq

        if __name__ == "__main__":
            if {starter == "a thread still running"!r}:
                threading.Thread(target=start, args=(True,), daemon=True).start()
                time.sleep(60)
            with concurrent.futures.ThreadPoolExecutor(1) as starter:
                seq = starter.submit(start, False).result()
            next(iter(seq))  # its thread has ended
    """)
    consumer, pids, died = _run_until_killed(script, inside=1)
    assert len(pids) == 2
    while _alive(pids) and time.monotonic() - died < 5:
        time.sleep(0.02)
    assert not _alive(pids), f"workers outlived a trainer that started them from {starter}"
    assert time.monotonic() - died < 1.0 + 0.3, "a worker outlived its consumer by over a second"
    assert not shm_entries({consumer})


@pytest.mark.parametrize("worker", ["workers.SlowStart30", "workers.HoldsTheGilStarting"],
                         ids=["python", "c-holding-the-gil"])
@pytest.mark.parametrize("method", METHODS)
def test_a_kill_during_start_with_workers_in_their_constructor_leaves_nothing(method, worker):
    script = _IMPORTS.format(tests=str(TESTS)) + textwrap.dedent(f"""
        if __name__ == "__main__":
            ShmSequence({worker}, 400, batch_size=4, num_workers=2, slot_bytes=4096,
                        out_type="null", start_method={method!r}).start()
    """)
    consumer, pids, died = _run_until_killed(script, inside=2)
    assert len(pids) == 2
    while (_alive(pids) or shm_entries({consumer})) and time.monotonic() - died < 5:
        time.sleep(0.02)
    assert not _alive(pids) and not shm_entries({consumer})
    assert time.monotonic() - died < 1.0 + 0.3


@pytest.mark.timeout(30)
def test_the_consumer_never_blocks_on_a_hung_workers_one_page_pipe(monkeypatch):
    """Linux gives a user's new pipes one page once their pipes pass pipe-user-pages-soft."""
    import fcntl
    from multiprocessing import connection
    real = connection.Pipe

    def one_page(duplex=True):
        ends = real(duplex)
        for end in ends:
            fcntl.fcntl(end.fileno(), 1031, 4096)  # F_SETPIPE_SZ
        return ends

    monkeypatch.setattr(connection, "Pipe", one_page)
    seq = make(Hang(at=0), dset_size=40_000, batch_size=512, num_workers=1, buffer=10,
               slot_bytes=1 << 16, timeout=1.0)
    began = time.monotonic()
    with pytest.raises(BatchTimeout, match="batch 0 of epoch 0"):
        with seq.start():
            next(iter(seq))
    assert time.monotonic() - began < 5


def test_a_timeout_is_raised_when_it_expires_not_after_the_shutdown():
    seq = make(Hang(at=9), timeout=1.0, num_workers=2)
    with seq.start():
        batches = iter(seq)
        next(batches), next(batches)
        began = time.monotonic()
        with pytest.raises(BatchTimeout):
            next(batches)
        assert time.monotonic() - began < 1.0 + 0.6


def test_a_death_is_raised_at_once_while_a_sibling_is_busy():
    seq = make(DieOrDawdle(die_at=0, seconds=5), dset_size=40, num_workers=2, slot_bytes=4096)
    began = time.monotonic()
    with pytest.raises(WorkerDied, match="killed by signal SIGKILL while building batch 0 of epoch 0"):
        with seq.start():  # from start() or from the first batch
            next(iter(seq))
    assert time.monotonic() - began < 1.5


def test_a_start_timeout_names_the_workers_that_did_not_start():
    seq = make(SlowStart5, timeout=1.0, slot_bytes=4096)
    with pytest.raises(ShmSeqError, match=r"did not start within timeout=1.0 s: worker 0 \(pid "
                                          r"\d+\), worker 1 \(pid \d+\)"):
        seq.start()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_dying_before_it_read_itself_fails_start_without_hanging(method):
    """multiprocessing writes a process's arguments into a pipe whose read end the parent
    holds until the write ends: a large worker there, and a child that dies before reading it,
    held start() forever."""
    seq = make(DiesUnpickled(), start_method=method, timeout=30)
    with pytest.raises(WorkerDied, match="exited with code 7 while starting"):
        seq.start()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_script_without_the_main_guard_is_told_to_add_it_in_one_line_per_worker(tmp_path, method):
    """Under spawn or forkserver a worker imports the script first, which starts the workers
    again: each worker said so with multiprocessing's error (40 lines), WorkerDied did not."""
    (tmp_path / "train.py").write_text(textwrap.dedent(f"""
        from shmseq import ShmSequence
        from workers import IndexWorker
        seq = ShmSequence(IndexWorker, 40, batch_size=4, num_workers=2, out_type="null",
                          start_method={method!r})
        with seq.start():
            print(sum(len(batch) for batch in seq))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    script = subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, errors = script.communicate(timeout=60)
    assert script.returncode == 1
    last = errors.strip().splitlines()[-1]
    assert last.startswith("shmseq.engine.common.errors.WorkerDied: worker ") and "exited with code 1" in last
    assert 'put that code under if __name__ == "__main__":' in last, errors
    assert "bootstrapping phase" not in errors, errors
    workers_said = [line for line in errors.splitlines() if line.startswith("shmseq: ")]
    assert 1 <= len(workers_said) <= 2 and "train.py" in workers_said[0], errors
    assert not shm_entries({script.pid})


def test_a_worker_dying_in_its_constructor_is_said_to_die_while_starting():
    with pytest.raises(WorkerDied, match="exited with code 4 while starting") as info:
        make(ExitInInit).start()
    assert "batch" not in str(info.value)


def test_ctrl_c_while_spawned_workers_start_gives_one_traceback_and_leaves_nothing():
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        sys.path.insert(0, {str(TESTS)!r})
        from shmseq import ShmSequence
        from workers import SlowStart5
        if __name__ == "__main__":
            seq = ShmSequence(SlowStart5, 100, batch_size=4, num_workers=2, out_type="null",
                              slot_bytes=4096, start_method="spawn")
            threading.Timer(0.2, os.killpg, (os.getpgid(0), signal.SIGINT)).start()  # a Ctrl-C
            seq.start()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode != 0 and done.stderr.count("KeyboardInterrupt") == 1, done.stderr
    assert "shmseq-worker" not in done.stderr, done.stderr


@pytest.mark.filterwarnings("ignore:worker thread")  # threads leave after the batch in hand
@pytest.mark.parametrize("backend", ["proc", "thread"])
def test_a_second_ctrl_c_during_shutdown_still_stops_everything_at_once(backend):
    main = threading.main_thread().ident
    timers = [threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT)) for delay in (0.5, 0.6)]
    seq = make(Slow(0.4), dset_size=400, buffer=10, thread_type=backend)
    with pytest.raises(KeyboardInterrupt):
        with seq.start():
            for timer in timers:
                timer.start()
            for batch in seq:
                del batch
            time.sleep(5)  # the second Ctrl-C may come after the first one's shutdown
    for timer in timers:
        timer.join()
    assert leftovers(grace=1.0) == {}


class _Counting(Slow):
    """A slow worker shared by threads, counting the batches it started."""

    def __init__(self, seconds):
        super().__init__(seconds)
        self.started = []

    def __getitem__(self, indices):
        self.started.append(int(indices[0]))
        return super().__getitem__(indices)


def test_a_stop_overtakes_the_tasks_queued_before_it():
    """finish() with ten slow batches queued for each worker thread: each leaves after the
    batch in hand (threads cannot be killed; without the overtaking they would build all)."""
    worker = _Counting(0.1)
    seq = make(worker, dset_size=400, buffer=20, num_workers=2, thread_type="thread", slot_bytes=4096)
    with seq.start():
        next(iter(seq))
        started = len(worker.started)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("shmseq-worker") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the worker threads did not leave"
        time.sleep(0.02)
    assert len(worker.started) <= started + 2, (started, worker.started)
