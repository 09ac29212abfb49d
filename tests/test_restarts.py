"""worker_restarts: a run that survives its workers' deaths, every batch once and in order,
the same as a run without them."""
import concurrent.futures
import functools
import multiprocessing
import os
import random
import re
import signal
import threading
import time
import warnings

import pytest

from shmseq import ShmSequence, WorkerDied
import workers
from workers import Crash, ExitInInit, KillOnce, SizedWorker


def make(worker, dset_size=120, **options):
    options = {"batch_size": 4, "num_workers": 2, "shuffle": True, "seed": 3, "out_type": "null",
               "timeout": 60, "buffer": 10, **options}  # 10 slots: the workers stay within an
    # epoch of the consumer, and a poison sample's first batch is the one that kills twice
    return ShmSequence(worker, dset_size, **options)


def seen(batch) -> tuple:
    """A batch's labels and the marker its images carry."""
    images, labels = batch
    return labels.tolist(), images[:, 0, 0, 0].tolist()


def reference(tmp_path, epochs, **options) -> list:
    """The same stream built serially, by a worker that kills nobody."""
    seq = make(KillOnce(tmp_path, at=[]), num_workers=0, **options).start_test("numpy")
    return [[seen(b) for b in seq] for _ in range(epochs)]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_killed_once_are_replaced_and_the_stream_is_unchanged(tmp_path, method):
    seq = make(KillOnce(tmp_path, at=[13, 61]), start_method=method, worker_restarts=2)
    with pytest.warns(RuntimeWarning) as caught:
        with seq.start():
            got = [[seen(b) for b in seq] for _ in range(2)]
    assert got == reference(tmp_path, 2)
    deaths = [re.search(r"worker \d \(pid \d+\) was killed by signal SIGKILL while building "
                        r"batch \d+ of epoch \d \(sample indices \[([^)]*)\]\): a new worker takes its place",
                        str(w.message)) for w in caught]
    assert seq.stats.restarts == len(deaths) == 2 and all(deaths), [str(w.message) for w in caught]
    killed = [{int(i) for i in death[1].replace(",", " ").split()} for death in deaths]
    assert sorted(len(samples & {13, 61}) for samples in killed) == [1, 1]


@pytest.mark.parametrize("how, died", [("SIGSEGV", "was killed by signal SIGSEGV"),
                                       ("SIGABRT", "was killed by signal SIGABRT"),
                                       ("exit", "exited with code 3")])
def test_a_batch_that_kills_its_worker_twice_is_not_sent_a_third_time(how, died):
    seq = make(Crash(how, at=13), worker_restarts=3)
    run_until_it_dies(seq, "a new worker takes its place",
                      rf"{died} while building batch \d+ of epoch \d \(sample indices .*13.*\).*"
                      "had already killed a worker")
    assert seq.stats.restarts == 1


def run_until_it_dies(seq, warned: str, raised: str) -> list:
    """Iterate ``seq`` until it raises a ``WorkerDied`` matching ``raised``, each death before
    it warned of, matching ``warned``: the warnings."""
    with pytest.warns(RuntimeWarning, match=warned) as caught:
        with pytest.raises(WorkerDied, match=raised):
            with seq.start():
                for batch in seq:
                    del batch
    return caught


def test_sigkill_from_outside_is_not_charged_to_the_batch_being_built():
    """SIGKILL is sent from outside (a user's kill, a killer of random processes) but for the
    kernel's out-of-memory killer: it says nothing of the batch being built. A batch whose
    worker is SIGKILLed every time ends the run only once the restarts are used."""
    seq = make(Crash("SIGKILL", at=13), worker_restarts=3)
    warned = run_until_it_dies(seq, "a new worker takes its place",
                               r"killed by signal SIGKILL while building batch .*"
                               r"\(and worker_restarts=3 were used\)")
    assert seq.stats.restarts == 3 and "out-of-memory" not in str(warned[0].message)


MEMORY_CGROUP = "/sys/fs/cgroup/memory"


@pytest.fixture
def memory_cgroup():
    """A memory cgroup (v1) of 256 MiB that a worker can move itself into; skipped where this
    process may not make one."""
    path = os.path.join(MEMORY_CGROUP, f"shmseq-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"needs a memory cgroup of its own ({exc})")
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as limit:
            limit.write(str(256 << 20))
        yield path
    finally:
        for _ in range(100):  # its processes are gone once the sequence finished
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.05)


def test_a_batch_that_the_out_of_memory_killer_kills_twice_is_poison(memory_cgroup):
    """A batch too large for the memory there is: the kernel's out-of-memory killer SIGKILLs
    each worker that builds it, and the death is charged to it (the kernel counts its kills)."""
    seq = make(workers.EatsMemory(memory_cgroup, at=13, megabytes=512), worker_restarts=3,
               start_method="fork")
    run_until_it_dies(seq, "out-of-memory killer",
                      r"killed by signal SIGKILL \(the kernel's out-of-memory killer\) while "
                      "building batch .*had already killed")
    assert seq.stats.restarts == 1


def test_once_the_restarts_are_used_up_a_death_is_raised(tmp_path):
    seq = make(KillOnce(tmp_path, at=[13, 61]), worker_restarts=1)
    run_until_it_dies(seq, "a new worker takes its place",
                      r"killed by signal SIGKILL .*worker_restarts=1 were used")
    assert seq.stats.restarts == 1


def test_an_exception_in_the_worker_is_not_a_death():
    seq = make(SizedWorker([]), slot_bytes=4096, worker_restarts=2)
    with seq.start():
        with pytest.raises(ZeroDivisionError, match="modulo"):
            next(iter(seq))
    assert seq.stats.restarts == 0


def test_a_worker_dying_while_it_starts_is_not_replaced():
    with pytest.raises(WorkerDied, match="while starting"):
        make(ExitInInit, worker_restarts=2).start()


@pytest.mark.filterwarnings("ignore:worker .* a new worker takes its place")
def test_restarts_keep_a_resumed_rollover_run_the_same(tmp_path):
    options = {"dset_size": 30, "batch_size": 4, "last_batch": "rollover"}
    expected = [b for epoch in reference(tmp_path / "none", 4, **options) for b in epoch]
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = make(KillOnce(tmp_path / "first", at=[13, 22]), worker_restarts=4, **options)
    delivered = []
    with first.start():
        for _ in range(2):
            for batch in first:
                delivered.append(seen(batch))
                if len(delivered) == 11:  # mid-epoch 1
                    break
        state = first.state_dict()
    resumed = make(KillOnce(tmp_path / "second", at=[1, 17]), worker_restarts=4, **options)
    resumed.load_state_dict(state)
    with resumed.start():
        while len(delivered) < len(expected):
            delivered += [seen(b) for b in resumed]
    assert delivered[:len(expected)] == expected
    assert first.stats.restarts >= 1 and resumed.stats.restarts >= 1


def test_a_replacement_dying_in_its_constructor_uses_a_restart_and_blames_no_batch(
        tmp_path, monkeypatch):
    monkeypatch.setattr(workers.DiesStartingAfterAKill, "marks", str(tmp_path))
    seq = make(workers.DiesStartingAfterAKill, start_method="fork", worker_restarts=2)
    with pytest.warns(RuntimeWarning) as caught:
        with seq.start():
            got = [[seen(b) for b in seq] for _ in range(2)]
    assert got == reference(tmp_path / "none", 2)
    warned = [str(w.message) for w in caught]
    assert seq.stats.restarts == 2 and "while starting, in place of a dead worker" in warned[1]


START_SECONDS = 0.5


def _since(marks, pid: int, stage: str) -> float | None:
    """Seconds since worker ``pid`` reached ``stage`` of its start (see ``workers.slow_start``)."""
    try:
        return time.time() - os.stat(os.path.join(marks, f"{pid}.{stage}")).st_mtime
    except FileNotFoundError:
        return None


def _kill_pairs(marks, pairs: int, rng: random.Random) -> int:
    """Kill a worker at work, then 20-200 ms later a replacement while it starts, ``pairs``
    times: how many were killed. A worker is killed at work only once it has been ready for
    0.2 s, long past the batch it took over from a dead one: a batch that kills two workers is
    not sent again, by design, and random kills must not make one."""
    killed: list[int] = []

    def kill_one(eligible) -> None:
        for _ in range(1000):
            pids = [p.pid for p in multiprocessing.active_children()
                    if p.name.startswith("shmseq-worker") and p.pid not in killed]
            chosen = [pid for pid in pids if eligible(pid)]
            if chosen:
                killed.append(rng.choice(chosen))
                os.kill(killed[-1], signal.SIGKILL)
                return
            time.sleep(0.005)
        raise AssertionError(f"no worker to kill in 5 s after killing {killed}")

    for _ in range(pairs):
        time.sleep(rng.uniform(0.05, 0.2))
        kill_one(lambda pid: (_since(marks, pid, "ready") or 0) > 0.2)
        time.sleep(rng.uniform(0.02, 0.2))
        kill_one(lambda pid: _since(marks, pid, "ready") is None
                 and (_since(marks, pid, "starting") or START_SECONDS) < START_SECONDS - 0.1)
    return len(killed)


@pytest.mark.parametrize("method, seed", [("fork", 0), ("spawn", 1), ("forkserver", 2)])
def test_kills_in_quick_pairs_cost_restarts_never_the_run(tmp_path, method, seed):
    """A worker killed at work, then its replacement while it starts (an out-of-memory killer
    taking both): every batch once and in order, no WorkerDied while restarts remain. Whole
    epochs run until the last kill and one more after it, so every dead worker is needed again."""
    seq = make(KillOnce(tmp_path, at=[], seconds=0.004), dset_size=800, start_method=method,
               worker_restarts=100,
               worker_init_fn=functools.partial(workers.slow_start, str(tmp_path), START_SECONDS))
    got = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "worker .* a new worker takes its place")
        with seq.start():
            killer = concurrent.futures.ThreadPoolExecutor(1).submit(
                _kill_pairs, str(tmp_path), 3, random.Random(seed))
            while not killer.done():
                got.append([seen(b) for b in seq])
            got.append([seen(b) for b in seq])
    assert got == reference(tmp_path, len(got), dset_size=800)
    assert seq.stats.restarts == killer.result() == 6


def _kill_at_random(seconds: float, rng: random.Random, stop: threading.Event) -> int:
    """SIGKILL a worker, any of them (at work, between batches, starting), every 50-150 ms for
    ``seconds`` (or until ``stop``): how many kills found a worker."""
    killed, until = 0, time.monotonic() + seconds
    while time.monotonic() < until and not stop.wait(rng.uniform(0.05, 0.15)):
        pids = [p.pid for p in multiprocessing.active_children()
                if p.name.startswith("shmseq-worker")]
        if pids:
            try:
                os.kill(rng.choice(pids), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_random_kills_never_make_an_innocent_batch_poison(tmp_path, method):
    """Kills from outside land on whatever is being built: two of them on one batch must not
    judge it poison. Every batch once and in order, epoch after epoch, for 4 s of kills and an
    epoch after them."""
    seq = make(KillOnce(tmp_path, at=[], seconds=0.02), dset_size=160, start_method=method,
               worker_restarts=10**6)
    got, stop = [], threading.Event()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "worker .* a new worker takes its place")
        with seq.start(), concurrent.futures.ThreadPoolExecutor(1) as pool:
            killer = pool.submit(_kill_at_random, 4.0, random.Random(method), stop)
            try:
                while not killer.done():
                    got.append([seen(b) for b in seq])
                got.append([seen(b) for b in seq])
            finally:
                stop.set()
    assert got == reference(tmp_path, len(got), dset_size=160)
    assert 10 < seq.stats.restarts <= killer.result()  # a kill may find a dead worker not reaped


def test_restarts_need_processes():
    with pytest.raises(ValueError, match="worker_restarts=1 replaces worker processes.*thread_type"):
        make(KillOnce("/tmp", at=[]), worker_restarts=1, thread_type="thread")
