"""The bench's report, from made-up runs (no loader runs here): spreads, the × limit column and
its mark, and the limit's rule (the faster of 1 and 2 processes)."""
import multiprocessing
import os
import re

import pytest

from shmseq.bench import limit, report, systems
from shmseq.bench.__main__ import ALL_SYSTEMS, main
from shmseq.bench.memory import pss_bytes, tree_pss_bytes
from shmseq.bench.runner import LIMIT, Run, run_matrix
from shmseq.bench.workloads import WORKLOADS
from shmseq.demo import load

GB = WORKLOADS["imagenet64"].batch_bytes / 1e9


def runs(rates: dict[str, list[float]], workload="imagenet64") -> list[Run]:
    """Runs of each system at these rates (batches/s), one per repeat."""
    return [Run(system, workload, repeat, rate, None if system == LIMIT else 50.0,
                None if system == LIMIT else 0.01)
            for system, found in rates.items() for repeat, rate in enumerate(found)]


def row(text: str, system: str) -> list[str]:
    line = next(line for line in text.splitlines() if f"| {system} |" in line)
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_single_run_prints_its_value_without_a_spread():
    assert report.with_spread(11.954, (11.954, 11.954), ".2f", 1) == "11.95"
    assert report.with_spread(11.954, (10.5, 12.25), ".2f", 3) == "11.95 (10.50-12.25)"
    cells = report.summarize(runs({LIMIT: [1000.0], "serial": [500.0]}))
    assert [c.runs for c in cells] == [1, 1]
    text = report.table(cells)
    assert "GB/s (min-max)" not in text and "| GB/s |" in text
    assert row(text, "serial")[2] == f"{500 * GB:.2f}"
    assert "(" not in row(text, LIMIT)[2]


def test_repeats_print_the_median_and_the_spread():
    cells = report.summarize(runs({LIMIT: [1000.0, 900.0, 1100.0], "serial": [500.0, 400.0, 450.0]}))
    text = report.table(cells)
    assert "| GB/s (min-max) |" in text
    assert row(text, "serial")[2] == f"{450 * GB:.2f} ({400 * GB:.2f}-{500 * GB:.2f})"
    assert row(text, "serial")[-1] == "0.45"
    assert report.drift_note(cells) is None


def test_a_ratio_above_the_limit_is_marked_and_explained():
    cells = report.summarize(runs({LIMIT: [1000.0], "bare-ring": [1150.0], "serial": [1004.0],
                                   "shmseq-inplace": [900.0]}))
    text = report.table(cells)
    assert row(text, LIMIT)[-1] == "1.00"
    assert row(text, "bare-ring")[-1] == "1.15†"
    assert row(text, "serial")[-1] == "1.00"          # 1.004 shows as 1.00: not above it
    assert row(text, "shmseq-inplace")[-1] == "0.90"
    note = report.drift_note(cells)
    assert note.startswith("† Above the limit: imagenet64 bare-ring 1.15.")
    assert "serial" not in note and f"imagenet64 {1000 * GB:.2f} GB/s" in note
    markdown = report.markdown(cells, report.machine(), {"buffer": 10, "repeats": 1, "seconds": 0.5},
                               "python -m shmseq.bench --quick")
    assert note in markdown and "one run of 0.5 s each (no spread)" in markdown
    assert "interleaved repeats" not in markdown.split("\n", 1)[0]


def test_the_legend_says_what_the_limit_is():
    legend = report.COLUMNS.split("× limit:", 1)[1]
    assert "No loader can go faster" not in legend
    assert re.search(r"by 1 and\s+by 2 processes", legend) and "the faster of the two" in legend
    assert "marked †" in legend


def test_the_markdown_names_its_repeats():
    cells = report.summarize(runs({LIMIT: [1000.0, 1000.0, 1000.0]}))
    head = report.markdown(cells, report.machine(), {"buffer": 10, "repeats": 3, "seconds": 2.0},
                           "python -m shmseq.bench").split("\n", 1)[0]
    assert "3 interleaved repeats of 2 s, medians (min-max)" in head


@pytest.mark.parametrize("one, two, expected", [(30.0, 50.0, 50.0), (31.0, 28.0, 31.0)])
def test_the_limit_is_the_faster_of_one_and_two_processes(monkeypatch, one, two, expected):
    asked = []

    def build_rate(workload, processes, seconds, warmup_seconds=0.0):
        asked.append((processes, seconds, warmup_seconds))
        return {1: one, 2: two}[processes]

    monkeypatch.setattr(limit, "build_rate", build_rate)
    assert limit.limit_rate(WORKLOADS["cifar"], 0.5, 0.1) == expected
    assert asked == [(1, 0.5, 0.1), (2, 0.5, 0.1)]


def test_the_matrix_runs_each_system_only_on_the_workloads_it_runs_on():
    measured = []

    def measure(name, workload, repeat, seconds, warmup_seconds):
        measured.append((repeat, workload.name, name))
        return Run(name, workload.name, repeat, 1.0)

    def runs_on(name, workload):
        return name != "jpeg-only" or workload.name == "imagenet64"

    run_matrix(["serial", "jpeg-only"], [WORKLOADS["imagenet64"], WORKLOADS["cifar"]], repeats=2,
               seconds=0.1, warmup_seconds=0.0, log=lambda line: None, measure=measure,
               runs_on=runs_on)
    assert measured == [(0, "imagenet64", "serial"), (0, "imagenet64", "jpeg-only"),
                        (0, "cifar", "serial"), (1, "imagenet64", "jpeg-only"),
                        (1, "imagenet64", "serial"), (1, "cifar", "serial")]


def test_the_markdown_says_what_each_of_its_systems_is():
    cells = report.summarize(runs({LIMIT: [1000.0], "serial": [500.0], "bare-ring": [900.0],
                                   "mp-queue": [50.0]}))
    text = report.markdown(cells, report.machine(), {"buffer": 10, "repeats": 1, "seconds": 0.5},
                           "python -m shmseq.bench")
    said = text.split("What the systems are:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split(":", 1)[0] for line in said] == [f"- {name}" for name in
                                                        (LIMIT, "serial", "bare-ring", "mp-queue")]
    assert "consumer's own thread" in said[1] and "no order" in said[2] and "pickled" in said[3]
    assert set(systems.ABOUT) | {LIMIT} >= set(ALL_SYSTEMS)


@pytest.mark.parametrize("busy", [[], ["other work kept 1.50 cores busy on average"]])
def test_the_bench_warns_when_the_machine_was_busy(monkeypatch, tmp_path, capsys, busy):
    judged = []
    monkeypatch.setattr(load, "busy", lambda start, end, workers, cores: judged.append(workers) or busy)
    main(["--quick", "--workloads", "cifar32", "--systems", "serial", "--seconds", "0.05",
          "--out", str(tmp_path)])
    printed, written = capsys.readouterr().out, (tmp_path / "results.md").read_text()
    assert judged == [systems.NUM_WORKERS]
    warning = "WARNING: the machine was busy (other work kept 1.50 cores busy on average)"
    assert (warning in printed and warning in written) == bool(busy)
    assert re.search(r"^Load: load average [\d.]+ .* at the start, load average [\d.]+ .* at the end",
                     written, re.MULTILINE)


def _hold_pages(ready, done, megabytes: int) -> None:
    held = bytearray(megabytes << 20)
    held[::4096] = b"\1" * len(held[::4096])  # every page touched: its own
    ready.set()
    done.wait(30)


def test_the_tree_pss_counts_the_processes_under_the_trainer():
    """What the streaming report's PSS column sums: this process and every one under it (a
    loader's workers), each page they share counted once."""
    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_hold_pages, args=(ready, done, 64))
    child.start()
    try:
        assert ready.wait(30)
        assert pss_bytes(child.pid) > 64 << 20
        assert tree_pss_bytes() - pss_bytes(os.getpid()) > 64 << 20
    finally:
        done.set()
        child.join()
