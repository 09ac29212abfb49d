"""LoaderStats' window: the fractions of where the time went, from ticks of a fake clock."""
import time

import pytest

from shmseq.engine.trainer.stats import SNAPSHOTS, Breakdown, LoaderStats

TICK_S = 0.5


def feed(stats: LoaderStats, seconds: float, now: float, *, rate: float = 100.0,
         wait: float = 0.0, busy: float | None = None, cpu: float = 1.0, full: float = 0.0,
         storage: float = 0.0, decode: float = 0.0, copy: float = 0.0) -> float:
    """``seconds`` of a pipeline ticked every half second: ``rate`` batches/s, the trainer
    waiting ``wait`` of the time, each worker busy ``busy`` of it, ``cpu`` of that on a CPU
    and ``storage`` waiting on remote reads; each idle for want of a slot ``full`` of it, decode and
    copies taking ``decode`` and ``copy`` of it (``busy`` by default: the rest of ``full``). The
    clock's time at the end."""
    busy = 1.0 - full if busy is None else busy
    for _ in range(round(seconds / TICK_S)):
        busy_s = stats.workers * TICK_S * busy
        stats.batches += round(rate * TICK_S)
        stats.consumer_wait_s += wait * TICK_S
        stats.worker_busy_s += busy_s
        stats.worker_cpu_s += busy_s * cpu
        stats.remote_wait_s += busy_s * storage
        stats.worker_idle_s += stats.workers * TICK_S * full
        stats.decode_s += decode * TICK_S
        stats.copy_s += copy * TICK_S
        now += TICK_S
        stats.tick(now)
    stats.clock = lambda: now  # the summary is read right after the last tick
    return now


def test_the_fractions_say_where_the_time_went():
    stats = LoaderStats(started=0.0, workers=4)
    feed(stats, 20, 0.0, wait=0.38, busy=0.9, cpu=0.5, full=0.1, storage=0.2, decode=0.05,
         copy=0.02)
    window = stats.breakdown()
    assert window.window_s == pytest.approx(20)
    assert window.batches_per_s == pytest.approx(100)
    assert window.trainer_wait_fraction == pytest.approx(0.38)
    assert window.worker_busy_fraction == pytest.approx(0.9)
    assert window.worker_cpu_fraction == pytest.approx(0.5)
    assert window.ring_full_fraction == pytest.approx(0.1)
    assert window.remote_wait_fraction == pytest.approx(0.2)
    assert window.decode_fraction == pytest.approx(0.05)
    assert window.copy_fraction == pytest.approx(0.02)
    assert window.mean_workers == pytest.approx(4)


def test_the_window_drops_what_is_older_than_its_length():
    stats = LoaderStats(started=0.0, workers=4)
    now = feed(stats, 40, 0.0, wait=0.5)
    feed(stats, 30, now, wait=0.0, full=0.9)
    window = stats.breakdown()
    assert 30 <= window.window_s <= 30 + TICK_S
    assert window.trainer_wait_fraction == 0 and window.ring_full_fraction == pytest.approx(0.9)


def test_ticks_closer_than_the_window_needs_keep_the_deque_small():
    stats = LoaderStats(started=0.0, workers=2, clock=lambda: 100.0)
    for tick in range(1, 100_001):
        stats.batches += 1
        stats.tick(tick / 1000)
    assert len(stats._snapshots) <= SNAPSHOTS + 2  # a seam: the bound is the point, unseen outside
    assert stats.breakdown().batches_per_s == pytest.approx(1000)  # the newest tick counts


def test_the_ring_is_full_for_the_share_of_the_time_workers_reported():
    """Idle time comes with a worker's next reply: one given no task (tasks packed on another)
    reports nothing, and its wait is no share of the workers' wall time."""
    stats = LoaderStats(started=0.0, workers=4)
    feed(stats, 10, 0.0, busy=0.02, full=0.23)  # one of four reports its time: busy 8 %
    assert stats.breakdown().ring_full_fraction == pytest.approx(0.92)


def test_workers_added_count_from_the_tick_after():
    stats = LoaderStats(started=0.0, workers=2)
    now = feed(stats, 10, 0.0)
    stats.workers = 4
    feed(stats, 10, now)
    assert stats.breakdown().worker_busy_fraction == pytest.approx(1)


def test_batches_taken_since_the_last_tick_count():
    """A run shorter than a tick: three batches, and the summary read at once."""
    now = 1.2
    stats = LoaderStats(started=0.0, workers=2, clock=lambda: now)
    stats.tick(0.5)
    stats.batches, stats.worker_idle_s = 3, 1.0
    assert stats.breakdown().batches_per_s == pytest.approx(2.5)
    assert stats.summary().startswith("trainer-bound: the ring was full 100 % of the last 1.2 s")


def test_a_devices_counts_are_read_up_to_the_tick_they_came_in_with():
    """Added at ticks only: over a window that runs on to now, the copies since the last tick
    would be missing from the fraction."""
    stats = LoaderStats(started=0.0, workers=2)
    feed(stats, 2, 0.0, copy=0.9)
    stats.clock = lambda: 2.4  # read 0.4 s after the last tick
    assert stats.breakdown().window_s == pytest.approx(2.4)
    assert stats.breakdown().copy_fraction == pytest.approx(0.9)



    stats = LoaderStats(started=time.perf_counter() - 10)
    stats.consumer_wait_s, stats.batches = 5.0, 100
    window = stats.breakdown()
    assert window.window_s == pytest.approx(10, abs=0.5)
    assert window.trainer_wait_fraction == pytest.approx(0.5, abs=0.03)


def test_the_summary_names_the_bound_and_the_fix():
    stats = LoaderStats(started=0.0, workers=4)
    feed(stats, 30, 0.0, wait=0.38, busy=0.97, cpu=0.3)
    assert stats.summary() == ("input-bound: the trainer waited 38 % of the last 30 s; workers "
                               "busy 97 %; add workers or cores")
    feed(stats, 30, 30.0, wait=0.0, full=0.92)
    assert stats.summary() == ("trainer-bound: the ring was full 92 % of the last 30 s; the "
                               "loader keeps up, fewer workers would too")


def breakdown(**fractions: float) -> Breakdown:
    return Breakdown(**{"window_s": 30.0, "batches_per_s": 100.0,
                        "trainer_wait_fraction": 0.3, "worker_busy_fraction": 0.95,
                        "worker_cpu_fraction": 0.3, "ring_full_fraction": 0.0,
                        "decode_fraction": 0.0, "copy_fraction": 0.0,
                        "remote_wait_fraction": 0.0, "mean_workers": 4.0, **fractions})


@pytest.mark.parametrize("fractions, verdict, fix", [
    ({"trainer_wait_fraction": 0.0, "ring_full_fraction": 0.92}, "trainer-bound: the ring was "
     "full 92 %", "fewer workers would too"),
    ({"trainer_wait_fraction": 0.0, "ring_full_fraction": 0.92, "mean_workers": 1.0},
     "trainer-bound: the ring was full 92 %", "the loader keeps up"),
    ({"trainer_wait_fraction": 0.03}, "trainer-bound: the trainer waited 3 %", "keeps up"),
    ({"trainer_wait_fraction": 0.0, "batches_per_s": 0.0}, "no batches asked for", "30 s"),
    ({"window_s": 0.0}, "no time measured yet", ""),
    ({"ring_full_fraction": 0.8}, "slot-bound: the trainer waited 30 %", "more slots"),
    ({"remote_wait_fraction": 0.6}, "remote reads: the trainer waited 30 %",
     "storage 60 % of their time; add workers"),
    ({"decode_fraction": 0.4}, "decode-bound", "on the GPU"),
    ({"copy_fraction": 0.4}, "copy-bound: host-to-device copies ran 40 % of the last 30 s, "
     "and the trainer waited 30 %", "fewer bytes"),
    ({"trainer_wait_fraction": 0.0, "ring_full_fraction": 0.9, "copy_fraction": 0.95},
     "copy-bound: host-to-device copies ran 95 %", "fewer bytes"),
    ({"trainer_wait_fraction": 0.0, "ring_full_fraction": 0.9, "decode_fraction": 0.9},
     "decode-bound: decoding ran 90 %", "on the GPU"),
    ({"trainer_wait_fraction": 0.0, "ring_full_fraction": 0.9, "copy_fraction": 0.5},
     "trainer-bound: the ring was full 90 %", "keeps up"),
    ({"trainer_wait_fraction": 0.0, "copy_fraction": 0.95}, "copy-bound: host-to-device "
     "copies ran 95 %", "fewer bytes"),
    ({"trainer_wait_fraction": 0.0, "copy_fraction": 0.7}, "trainer-bound: the trainer "
     "waited 0 %", "keeps up"),
    ({"worker_busy_fraction": 0.4}, "input-bound: the trainer waited 30 %", "busy only 40 %"),
    ({"worker_cpu_fraction": 0.95}, "input-bound: the trainer waited 30 %", "add cores"),
    ({"workers_limit": "memory_budget"}, "input-bound: the trainer waited 30 %",
     "runs all that memory_budget allows: raise it"),
    ({"workers_limit": "max_workers", "worker_busy_fraction": 0.7}, "input-bound: the trainer "
     "waited 30 % of the last 30 s; workers busy 70 %", "all that max_workers allows"),
    ({}, "input-bound: the trainer waited 30 % of the last 30 s; workers busy 95 %",
     "add workers"),
    ({"workers_growing": True}, "input-bound: the trainer waited 30 %",
     "'auto' is still adding workers"),
    ({"workers_growing": True, "worker_cpu_fraction": 0.95}, "input-bound: the trainer "
     "waited 30 %", "'auto' is still adding workers"),
    ({"window_s": 0.5, "ring_full_fraction": 0.8}, "too short to judge: 0.5 s measured", "1 s"),
])
def test_the_verdict_follows_the_fractions(fractions, verdict, fix):
    line = breakdown(**fractions).verdict()
    assert line.startswith(verdict) and fix in line, line


@pytest.mark.parametrize("seconds", [0.033, 0.5, 0.99])
def test_a_window_too_short_to_judge_gives_no_advice(seconds):
    """0.033 s after start, the trainer waiting and the ring full read 'give the ring more
    slots'; what a window that short measured says nothing of the run."""
    stats = LoaderStats(started=0.0, workers=2, clock=lambda: seconds)
    stats.batches, stats.consumer_wait_s = 2, 0.9 * seconds
    stats.worker_busy_s, stats.worker_idle_s = 0.1 * seconds, 1.8 * seconds
    assert stats.summary() == (f"too short to judge: {seconds:g} s measured, a verdict "
                               "needs 1 s")


def test_auto_still_adding_workers_is_told_neither_to_add_workers_nor_cores():
    """Workers that sleep, and num_workers='auto' adding more of them: neither the count nor
    the cores are the user's to change yet."""
    stats = LoaderStats(started=0.0, workers=4)
    stats.workers_growing = True
    feed(stats, 30, 0.0, wait=0.38, busy=0.97, cpu=0.02)
    line = stats.summary()
    assert line == ("input-bound: the trainer waited 38 % of the last 30 s; workers busy 97 %; "
                    "num_workers='auto' is still adding workers (4 on average over the "
                    "window): look again once it has settled")


def test_one_worker_that_keeps_up_is_not_told_fewer_would():
    stats = LoaderStats(started=0.0, workers=1)
    feed(stats, 30, 0.0, wait=0.0, full=0.9)
    assert stats.summary() == ("trainer-bound: the ring was full 90 % of the last 30 s; the "
                               "loader keeps up")


def test_as_dict_keeps_its_keys_and_adds_the_window():
    stats = LoaderStats(started=0.0, workers=2)
    stats.add_counts({"decode_s": 1.5, "worker_cpu_s": 2.0})
    feed(stats, 10, 0.0, wait=0.1)
    found = stats.as_dict()
    assert {"batches", "bytes", "worker_busy_s", "consumer_wait_s", "remote_wait_s",
            "shard_wait_s", "elapsed_s", "stall_fraction", "cache_peak_bytes"} <= set(found)
    assert found["decode_s"] == 1.5 and found["worker_cpu_s"] > 2.0
    assert found["window_s"] == pytest.approx(10)
    assert found["trainer_wait_fraction"] == pytest.approx(0.1)
    assert set(Breakdown._fields) <= set(found)
