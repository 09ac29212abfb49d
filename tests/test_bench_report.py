"""The bench's report, from made-up runs (no loader runs here): spreads, the × limit column and
its mark, and the limit's rule (the faster of 1 and 2 processes); the streaming bench's remote
mode: its columns, budgets and lines from made-up runs, its parts (windows, servers, PSS) and
one short run end to end."""
import contextlib
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import re
import urllib.request
from dataclasses import replace

import numpy as np
import pytest

from shmseq._apps import load
from shmseq._apps.report import machine
from shmseq.bench import (autotune, autotune_matrix, limit, memory, remote_streaming, report, runner,
                          streaming, systems)
from shmseq.bench.__main__ import ALL_SYSTEMS, main, parse_args
from shmseq.bench.memory import pss_bytes, tree_pss_bytes
from shmseq.bench.runner import LIMIT, Run, run_matrix
from shmseq.bench.workloads import WORKLOADS
from shmseq.shards import Shard, ShardIndex

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
    markdown = report.markdown(cells, machine(), {"buffer": 10, "repeats": 1, "seconds": 0.5},
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
    head = report.markdown(cells, machine(), {"buffer": 10, "repeats": 3, "seconds": 2.0},
                           "python -m shmseq.bench").split("\n", 1)[0]
    assert "3 interleaved repeats of 2 s, medians (min-max)" in head


@pytest.mark.parametrize("repeats, said", [
    (1, "one run each: no spread"),                                 # --quick, --repeats 1
    (3, "median of 3 runs, bars: min-max"),
])
def test_the_chart_says_only_the_spread_its_runs_have(repeats, said):
    """One run (the quick bench's) has no min-max: the chart claimed one, with bars of zero."""
    pytest.importorskip("matplotlib").use("Agg")
    from matplotlib.container import BarContainer
    rates = {LIMIT: [1000.0 + 10 * r for r in range(repeats)],
             "serial": [500.0 - 10 * r for r in range(repeats)],
             "shmseq-proc": [800.0 + 20 * r for r in range(repeats)]}
    figure = report.chart_figure(report.summarize(runs(rates)))
    try:
        axes = figure.axes[0]
        title = axes.get_title()
        bars = [bar.errorbar is not None for bar in axes.containers if isinstance(bar, BarContainer)]
    finally:
        from matplotlib import pyplot
        pyplot.close(figure)
    assert title == (f"Batches delivered to the consumer, {systems.NUM_WORKERS} workers ({said})")
    assert bars == [repeats > 1] * 2


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
    text = report.markdown(cells, machine(), {"buffer": 10, "repeats": 1, "seconds": 0.5},
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


@contextlib.contextmanager
def child_holding(megabytes: int):
    """A forked child that holds ``megabytes`` of pages of its own until the block ends."""
    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_hold_pages, args=(ready, done, megabytes))
    child.start()
    try:
        assert ready.wait(30)
        yield child
    finally:
        done.set()
        child.join()


def test_the_tree_pss_counts_the_processes_under_the_trainer():
    """What the streaming report's PSS column sums: this process and every one under it (a
    loader's workers), each page they share counted once."""
    with child_holding(64) as child:
        assert pss_bytes(child.pid) > 64 << 20
        assert tree_pss_bytes() - pss_bytes(os.getpid()) > 64 << 20


# -- the streaming bench's remote mode -------------------------------------------------------------
REMOTE_PACKAGES = ("werkzeug", "fsspec", "aiohttp", "moto", "boto3", "s3fs", "torch")


def test_the_remote_mode_reads_each_shard_once_an_epoch_and_reports_its_traffic(monkeypatch, tmp_path):
    """End to end, on raw 32 x 32 images (9 MB of shards, a cache of 0.78 of them) and 2 batches
    timed apart after the first (torch's loaders read a request a sample): every system runs
    and checks its batches; shmseq's remote runs fetch each shard at most once an epoch within
    their budget, one request a shard; torch's read each sample in place."""
    for package in REMOTE_PACKAGES:
        pytest.importorskip(package)
    monkeypatch.setitem(streaming.STREAM_WORKLOADS, "shards-uint8",
                        replace(streaming.STREAM_WORKLOADS["shards-uint8"], side=32,
                                early_batches=2))
    main(["--streaming", "--quick", "--remote", "http,s3", "--workloads", "shards-uint8",
          "--images", "2048", "--repeats", "1", "--seconds", "0.2", "--delay-ms", "1",
          "--out", str(tmp_path)])
    text = (tmp_path / "streaming.md").read_text()
    assert "| tree PSS MB | requests/sample | read amp. | peak cache MB |" in text
    assert "× limit" not in text.split("\n\n| workload")[1].split("\n")[0]
    assert row(text, "shmseq-local")[-3:] == ["", "", ""]
    document = json.loads((tmp_path / "streaming.json").read_text())
    runs = {run["system"]: run for run in document["runs"]}
    assert set(runs) == set(remote_streaming.SYSTEM_NAMES)
    budget = document["settings"]["remote"]["budgets"]["shards-uint8"]
    assert budget["raised"] and budget["bytes"] < budget["set_bytes"]
    for backend in ("http", "s3"):
        ours, theirs = runs[f"shmseq-{backend}"], runs[f"torch-{backend}"]
        assert 0 < ours["read_amplification"] <= 1.05
        assert 0 < ours["requests_per_sample"] <= 2 / 64  # a shard's version, then its bytes
        assert 0 < ours["cache_peak_bytes"] <= budget["bytes"]
        assert theirs["requests_per_sample"] > 0.5 and 0.8 < theirs["read_amplification"] < 1.2
        assert runs[f"ceiling-{backend}"]["requests_per_sample"] == 1 / 64
        assert f"shards-uint8 over {backend}: shmseq-{backend}" in text
    assert "WARNING: a shard cache held more than its budget" not in text


def remote_runs(repeat: int, rate: float, amplification: float, peak: int) -> list[Run]:
    """One repeat of the remote mode's systems on the uint8 shards, made up."""
    workload = "shards-uint8"
    return [Run("ceiling-http", workload, repeat, 40.0, requests_per_sample=1 / 64,
                read_amplification=1.0),
            Run("shmseq-local", workload, repeat, 400.0, 300.0, 0.05, 0.5, 300_000_000),
            Run("shmseq-http", workload, repeat, rate, 3000.0, 0.5, 0.5, 400_000_000,
                requests_per_sample=amplification / 64, read_amplification=amplification,
                cache_peak_bytes=peak),
            Run("torch-http", workload, repeat, 1.0, 1500.0, 2.0, 1.0, 300_000_000,
                requests_per_sample=0.9, read_amplification=1.0)]


def remote_markdown(runs: list[Run], budget_bytes: int = 300_000_000) -> str:
    """The streaming report of ``runs`` on 8,192 raw images, a cache of ``budget_bytes``."""
    workload = remote_streaming.workload(streaming.STREAM_WORKLOADS["shards-uint8"], 8192)
    budget = remote_streaming.Budget(budget_bytes / 1e9, 1_000_000_000, 1)
    part = remote_streaming.Report(["http"], 30.0, None, {workload.name: budget},
                                   {workload.name: workload})
    info = {"nproc": 2, "cpu": "x", "ram": "1 GiB", "python": "3", "numpy": "2", "torch": "2"}
    return streaming.markdown(runs, part.workloads, info, {"repeats": 2, "seconds": 3.0, "buffer": 10},
                              ["shards"], ["idle"], "cmd", remote=part)


def test_the_remote_columns_give_each_remote_figure_with_its_spread_and_none_for_local_reads():
    text = remote_markdown(remote_runs(0, 30.0, 0.9, 250_000_000)
                           + remote_runs(1, 34.0, 1.0, 260_000_000))
    assert "| tree PSS MB | requests/sample | read amp. | peak cache MB |" in text
    assert row(text, "shmseq-local")[-3:] == ["", "", ""]
    assert row(text, "shmseq-http")[-3:] == ["0.015 (0.014-0.016)", "0.95 (0.90-1.00)",
                                            "255 (250-260)"]
    assert row(text, "ceiling-http")[2:4] == ["2,560 (2,560-2,560)", "40.0"]
    assert "× limit" not in text  # no limit ran: neither its column nor its legend


def test_the_remote_line_compares_with_local_disk_torch_and_the_ceiling_repeat_by_repeat():
    text = remote_markdown(remote_runs(0, 30.0, 0.9, 250_000_000)
                           + remote_runs(1, 34.0, 1.0, 260_000_000))
    line = next(line for line in text.splitlines() if line.startswith("- shards-uint8 over http"))
    assert "shmseq-http 2,048 images/s, 0.08x (0.07-0.09) shmseq-local's (25,600)" in line
    assert "32.00x (30.00-34.00) torch-http's (64) with 2.00x (2.00-2.00) more trainer CPU" in line
    assert "read amplification 0.95 (targets per epoch: at most 0.035 and 1.05: met)" in line
    assert "torch-http 0.900 and 1.00" in line
    assert "the server sent 0.76x (0.68-0.85) the bytes a second of its ceiling" in line
    assert "transport-bound, by the endpoint" in line
    assert "WARNING: a shard cache" not in text


def test_a_cache_above_its_budget_or_traffic_above_the_targets_is_said():
    text = remote_markdown(remote_runs(0, 30.0, 1.2, 320_000_000), budget_bytes=300_000_000)
    assert "WARNING: a shard cache held more than its budget: shards-uint8 shmseq-http 320 MB" in text
    assert "(targets per epoch: at most 0.035 and 1.05: not met)" in text


def test_the_cache_budget_is_the_fraction_unless_the_batches_in_flight_need_more():
    def budget(images: int) -> remote_streaming.Budget:
        shards = [Shard(f"train-{n}.tar", np.arange(64) * 1024, 64 * 1024)
                  for n in range(images // 64)]
        workload = remote_streaming.workload(streaming.STREAM_WORKLOADS["shards-uint8"], images)
        return remote_streaming.budget(streaming.Prepared(workload, ShardIndex(shards), None), 0.25)

    large, small = budget(remote_streaming.IMAGES), budget(remote_streaming.QUICK_IMAGES)
    assert not large.raised and large.bytes == math.ceil(large.set_bytes / 4)
    assert "(--cache-fraction 0.25)" in large.describe("w")
    assert small.raised and large.set_bytes / 4 > small.bytes > small.set_bytes / 2
    assert "raised from --cache-fraction 0.25: what 13 batches in flight read" in small.describe("w")
    whole = remote_streaming.Budget(0.25, 1000, 1000)
    assert whole.bytes == 1000 and "the whole set" in whole.describe("w")


def test_a_window_of_whole_epochs_begins_and_ends_at_an_epochs_edge():
    observed = []

    class Edges(runner.Window):
        def begin(self, k):
            observed.append(k)

        def end(self, k):
            observed.append(k)
            return {"requests_per_sample": 0.5}

    run = runner.timed_run("s", "w", 0, lambda: contextlib.nullcontext(itertools.count()),
                           lambda k, batch: None, 0.01, 0.0, early_batches=3, whole=7,
                           window=Edges())
    assert observed[0] == 7 and observed[1] % 7 == 0 and observed[1] - observed[0] >= 7
    assert run.requests_per_sample == 0.5


@pytest.mark.parametrize("argv, said", [
    (["--streaming", "--delay-ms", "5"], "--delay-ms: with --remote"),
    (["--remote"], "--remote http,s3: with --streaming"),
    (["--streaming", "--remote", "ftp"], "choose among http, s3"),
    (["--streaming", "--remote", "--cache-fraction", "0"], "--cache-fraction 0: a fraction"),
    (["--streaming", "--remote", "s3", "--systems", "shmseq-http"], "runs ceiling-s3, shmseq-local"),
])
def test_the_remote_options_are_checked(argv, said, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert said in capsys.readouterr().err


def test_a_process_left_apart_is_not_in_the_trees_pss():
    with child_holding(64) as child:
        with_child = tree_pss_bytes()
        with memory.apart(child.pid):
            assert with_child - tree_pss_bytes() > 64 << 20
        assert tree_pss_bytes() > with_child - (32 << 20)  # counted again after the block


def test_a_server_in_a_process_of_its_own_counts_what_it_serves(tmp_path):
    servers = pytest.importorskip("shmseq.bench.servers")  # needs werkzeug
    (tmp_path / "data.bin").write_bytes(bytes(5000))
    with servers.ServerProcess("http", tmp_path, delay=0.001) as server:
        assert server.storage_options is None and server.process.pid != os.getpid()
        with urllib.request.urlopen(f"{server.url}/data.bin") as answer:
            assert len(answer.read()) == 5000
        assert server.counts() == (1, 5000)
        server.clear_log()
        assert server.counts() == (0, 0)
        with pytest.raises(AttributeError, match="upload"):
            server.upload(tmp_path, "bucket")  # a file server has no buckets
    assert not server.process.is_alive() and server.process.exitcode == 0


# -- the autotune mode -------------------------------------------------------------------------------
def table_rows(text: str, workload: str) -> dict[str, list[str]]:
    """The autotune table's rows of one workload, by setting."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {workload} |")]
    return {cells[1]: cells for cells in rows}


def test_the_autotune_mode_runs_each_workloads_settings_and_reports_them(monkeypatch, tmp_path):
    """End to end, with short sweeps and windows: every setting of each workload (its sweep,
    the static rules' picks, the self-tuned one where ShmSequence has it, else a line saying
    why not) has a row; the lines of what it shows and the JSON's runs say the same."""
    monkeypatch.setattr(autotune_matrix, "WORKER_SWEEP", (1, 2))
    monkeypatch.setattr(autotune_matrix, "RING_SWEEP", (2, 3))
    main(["--autotune", "--quick", "--workloads", "latency,ring-cifar", "--seconds", "0.1",
          "--settle", "0.3", "--out", str(tmp_path)])
    text = (tmp_path / "autotune.md").read_text()
    matrix = autotune.matrix(["latency", "ring-cifar"], 0.3, lambda line: None)
    for workload, settings in matrix.settings.items():
        rows = table_rows(text, workload)
        assert list(rows) == list(settings)
        assert sum("best of the sweep" in cells[2] for cells in rows.values()) == 1
        assert "torch's default" in rows["num_workers=0"][2]
        assert rows["num_workers=0"][-2] == "—"  # no ring: built in the trainer's process
    assert table_rows(text, "ring-cifar")["num_workers=2, buffer=3"][-2] == "3"
    for line in matrix.left_out:
        assert line in text
    assert ("num_workers='auto' not run" in text) == (autotune.auto_refused() is not None)
    charted = autotune.auto_refused() is None and importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "autotune.png").exists() == charted  # the chart needs matplotlib
    assert re.search(r"^- ring-cifar: GB/s by ring slots \(2 workers\): 2: [\d.]+, 3: [\d.]+",
                     text, re.MULTILINE)
    assert re.search(r"^- latency: torch's default \(num_workers=0\): [\d.]+x the sweep's best",
                     text, re.MULTILINE)
    document = json.loads((tmp_path / "autotune.json").read_text())
    assert {(r["workload"], r["system"]) for r in document["runs"]} == {
        (workload, name) for workload, settings in matrix.settings.items() for name in settings}
    assert all(isinstance(r["trace"], list) for r in document["runs"])


def test_a_self_tuned_loader_is_timed_after_it_settles_and_its_workers_charted(monkeypatch,
                                                                               tmp_path):
    """A stand-in for num_workers='auto' (2 workers, which say their count in
    ``seq.stats.workers``): its window starts ``--settle`` seconds after its loader was made,
    its trace (every 0.5 s) and its workers reach the table, the lines and the chart."""
    real_loader, real_started = autotune.loader, autotune.started

    def loader(workload, setting):
        return real_loader(workload, autotune.Setting(2) if setting.workers == autotune.AUTO
                           else setting)

    @contextlib.contextmanager
    def started(seq):
        with real_started(seq) as batches:
            seq.stats.workers = 2
            yield batches

    monkeypatch.setattr(autotune_matrix, "auto_refused", lambda: None)
    monkeypatch.setattr(autotune_matrix, "loader", loader)
    monkeypatch.setattr(autotune_matrix, "started", started)
    monkeypatch.setattr(autotune_matrix, "WORKER_SWEEP", (1,))
    main(["--autotune", "--quick", "--workloads", "latency", "--seconds", "0.1", "--settle",
          "1.1", "--out", str(tmp_path)])
    text = (tmp_path / "autotune.md").read_text()
    assert table_rows(text, "latency")["num_workers='auto'"][6] == "2 max, 2 last"
    assert re.search(r"^- latency: num_workers='auto' [\d,.]+ batches/s from 1.1 s after its "
                     r"start, [\d.]+x the sweep's best .*; target >= 0.90x: (met|not met)"
                     "; 2 workers at most, 2 at the end$", text, re.MULTILINE)
    auto = next(r for r in json.loads((tmp_path / "autotune.json").read_text())["runs"]
                if r["system"] == "num_workers='auto'")
    times = [t for t, workers, rate in auto["trace"]]
    assert len(times) >= 2 and times == sorted(times) and times[-1] >= 1.0
    assert all(workers == 2 and rate > 0 for _, workers, rate in auto["trace"])
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "autotune.png").stat().st_size > 0


def test_the_autotune_lines_hold_each_case_to_its_target():
    """From made-up runs: auto against the sweep's best (0.9x), the trainer-bound case's fewest
    workers within 2 % of the best, the default ring against the best ring (0.95x); a static
    rule's pick outside the sweep is held against it, and may beat it."""
    auto, ring, inline = autotune.Setting(autotune.AUTO), autotune.Setting(2), autotune.Setting(0)
    fixed = [autotune.Setting(w, autotune.in_flight(w)) for w in (1, 2, 4)]
    slots = [autotune.Setting(2, b) for b in (3, 4)]
    swept = {"latency": fixed, "trainer": fixed, "ring-cifar": slots}
    tuned = {"latency": auto, "trainer": auto, "ring-cifar": ring}
    matrix = autotune.Matrix(
        [autotune.AUTOTUNE_WORKLOADS[name] for name in swept],
        {w: {s.name: s for s in (*found, tuned[w], inline)} for w, found in swept.items()},
        {w: [s.name for s in found] for w, found in swept.items()},
        {w: {inline.name: ["torch's default"]} for w in swept}, 10.0, [])
    rates = {"latency": [[40, 40], [80, 80], [100, 120], [95, 105], [30, 30]],
             "trainer": [[39.5, 39.4], [40, 40], [40, 40], [40, 40], [20, 20]],
             "ring-cifar": [[100, 100], [90, 90], [90, 90], [120, 120]]}
    runs = [autotune.TunedRun(name, w, repeat, rate, 50.0, 0.01, workers_final=2, workers_max=4)
            for w, found in rates.items() for name, pair in zip(matrix.settings[w], found)
            for repeat, rate in enumerate(pair)]
    text = autotune.markdown(runs, matrix, machine(), {"repeats": 2, "seconds": 2.0},
                             "python -m shmseq.bench --autotune", ["idle"])
    assert ("latency: num_workers='auto' 100.0 (95.0-105.0) batches/s from 10 s after its start, "
            "0.91x (0.88-0.95) the sweep's best (num_workers=4, buffer=10: 110.0 "
            "(100.0-120.0) batches/s), repeat by repeat; target >= 0.90x: met; 4 workers at "
            "most, 2 at the end") in text
    assert ("trainer: the fewest workers within 2 % of the sweep's best rate: 1; "
            "num_workers='auto' ended with 2 (target: 1)") in text
    assert ("ring-cifar: num_workers=2, buffer=default 90.0 (90.0-90.0) batches/s, 0.90x "
            "(0.90-0.90) the sweep's best (num_workers=2, buffer=3") in text
    assert "target >= 0.95x: not met" in text
    assert "ring-cifar: torch's default (num_workers=0): 1.20x (1.20-1.20) the sweep's best" in text
    assert table_rows(text, "latency")[fixed[2].name][2] == "best of the sweep"
    assert table_rows(text, "ring-cifar")[inline.name][2:6] == [
        "torch's default", "120.0 (120.0-120.0)", "0.095", "1.20"]


def test_the_static_rules_pick_as_torch_and_grain_do(monkeypatch):
    """torch's default is num_workers=0; Grain's rule, as many workers as batches fit in the RAM
    budget (this machine's RAM here), at most cpu_count(); a fixed setting of W workers keeps
    2W + 2 slots."""
    monkeypatch.setattr(autotune_matrix, "ram_mb", lambda: 1024)
    monkeypatch.setattr(autotune.multiprocessing, "cpu_count", lambda: 16)
    assert autotune.grain_workers(38_535_168) == 16           # 27 batches of 36.75 MiB fit
    assert autotune.grain_workers(100 * 2**20) == 10
    assert autotune.grain_workers(2048 * 2**20) == 0
    assert autotune.in_flight(3) == 8
    picks = autotune.static_picks(autotune.AUTOTUNE_WORKLOADS["ring-imagenet256"])
    assert {s.name: who for s, who in picks.items()} == {
        "num_workers=0": ["torch's default"],
        "num_workers=2, buffer=6": ["torch, 2 workers: prefetch_factor=2"],
        "num_workers=16, buffer=34": ["Grain's rule"]}
    monkeypatch.setattr(autotune_matrix, "ram_mb", lambda: 10)
    picks = autotune.static_picks(autotune.AUTOTUNE_WORKLOADS["ring-imagenet256"])
    assert picks[autotune.Setting(0)] == ["torch's default", "Grain's rule"]
