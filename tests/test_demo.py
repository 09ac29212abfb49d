"""The main job, end to end: ``python -m shmseq.demo --quick``. Its structure, not its figures;
and what it leaves behind: its results, and the dataset only where asked to keep it."""
import json
import os
import re
import subprocess
import sys

import pytest

from leaks import SHM_DIR, made_by

for module in ("torch", "tqdm", "simplejpeg", "matplotlib"):
    pytest.importorskip(module)

from shmseq._apps import load  # noqa: E402
from shmseq.demo import report  # noqa: E402
from shmseq.demo.__main__ import cache_dir, dataset, parse_args  # noqa: E402
from shmseq.demo.sweep import Summary  # noqa: E402

LOADERS = {"shmseq", "torch DataLoader", "torch DataLoader, batch-level"}
RESULTS = {"results.md", "results.json", "sweep.png"}


def files_under(folder):
    return sorted(os.path.relpath(os.path.join(parent, name), folder)
                  for parent, folders, names in os.walk(folder) for name in folders + names)


def run_demo(tmp_path, *options):
    """The quick demo from an empty working directory, with temporary files, the cache and the
    home directory in folders of their own: whatever it leaves anywhere shows. The libraries'
    own caches go elsewhere: torch makes its compiler's cache folder in the temporary directory
    as it imports its optimizers, matplotlib its configuration and font cache in the home."""
    places = {name: tmp_path / name for name in ("cwd", "tmp", "cache", "home", "libraries")}
    for place in places.values():
        place.mkdir()
    env = {**os.environ, "TMPDIR": str(places["tmp"]), "XDG_CACHE_HOME": str(places["cache"]),
           "HOME": str(places["home"]), "MPLCONFIGDIR": str(places["libraries"] / "matplotlib"),
           "TORCHINDUCTOR_CACHE_DIR": str(places["libraries"] / "torchinductor")}
    demo = subprocess.Popen([sys.executable, "-m", "shmseq.demo", "--quick", *options],
                            cwd=places["cwd"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = demo.communicate(timeout=180)
    assert demo.returncode == 0, stderr[-3000:]
    assert not [name for name in os.listdir(SHM_DIR) if made_by(name, {demo.pid})]
    return stdout, places


def check_results(stdout, out):
    assert re.search(r"epoch 1: loss \d+\.\d+, accuracy \d+\.\d%, [\d,]+ img/s", stdout)
    # a quick epoch may be shorter than the second summary() judges from
    assert re.search(r"the loader \(seq.stats.summary\(\)\): (\w+-bound|too short to judge): ",
                     stdout)
    making = stdout.index("making the synthetic dataset: 96 ")
    assert making < stdout.index("dataset made in ") < stdout.index("training a small CNN")
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert {(s["loader"], s["step_ms"]) for s in summary} == {
        (loader, step) for loader in LOADERS for step in (20.0, 5.0, 1.0)}
    for s in summary:
        assert 0 <= s["stall"] <= 1 and s["images_per_s"] > 0 and s["cpu_us_per_batch"] > 0
    for loader in LOADERS:  # one repeat: a value, no spread
        assert re.search(rf"^\s+1\s+{re.escape(loader)}\s+[\d,]+\s+\d+%\s+[\d,]+$", stdout,
                         re.MULTILINE)
    assert (out / "sweep.png").stat().st_size > 10_000
    # the machine's cores and load, at the start and the end, in the output and results.md
    assert re.search(r"^machine: \d+ usable cores \(os.cpu_count: \d+\), load average [\d.]+ ",
                     stdout, re.MULTILINE)
    text = (out / "results.md").read_text()
    assert re.search(r"usable cores .*at the start load average [\d.]+ .*at the end load average",
                     text)
    machine = results["setup"]["machine"]
    assert machine["usable_cores"] >= 1 and len(machine["load_at_start"]) == 3
    assert ("WARNING: the machine was busy" in text) == bool(machine["busy"])
    assert re.search(r"^results: results.md, results.json, sweep.png in \S+ \([\d,]+ KiB\)$",
                     stdout, re.MULTILINE)


def test_quick_demo_leaves_only_its_results_behind(tmp_path):
    """By default the dataset is made in a temporary directory and deleted; the results go to
    ``demo-results`` in the working directory, and nothing else is left anywhere."""
    stdout, places = run_demo(tmp_path)
    check_results(stdout, places["cwd"] / "demo-results")
    assert files_under(places["cwd"]) == ["demo-results", *sorted(f"demo-results/{name}"
                                                                  for name in RESULTS)]
    assert files_under(places["tmp"]) == files_under(places["cache"]) == []
    assert files_under(places["home"]) == []
    assert re.search(r"^dataset: [\d,]+ KiB, made in a temporary directory and deleted",
                     stdout, re.MULTILINE)


def test_quick_demo_keeps_its_dataset_in_the_cache_when_asked(tmp_path):
    stdout, places = run_demo(tmp_path, "--format", "jpeg", "--keep", "--out", "out")
    check_results(stdout, places["cwd"] / "out")
    kept = places["cache"] / "shmseq" / "demo"
    assert [path for path in files_under(kept) if os.sep not in path] == ["jpeg-96-10-0"]
    assert f"dataset kept: {kept / 'jpeg-96-10-0'} (" in stdout
    assert f"delete it with: rm -r {kept / 'jpeg-96-10-0'}" in stdout
    assert files_under(places["tmp"]) == files_under(places["home"]) == []
    assert sorted(os.listdir(places["cwd"])) == ["out"]


def test_the_dataset_says_what_it_makes_before_it_makes_it_and_what_it_reuses(tmp_path, capsys):
    """Making the full demo's store takes seconds, which passed without a word."""
    args = parse_args(["--quick"])
    _, root = dataset(args, tmp_path)
    made = capsys.readouterr().out
    assert made.startswith(f"making the synthetic dataset: 96 images of 40x40 (decoded, a store "
                           f"of 450 KiB) in {root}...\n")
    assert re.search(r"^dataset made in \d+\.\d s$", made, re.MULTILINE)
    dataset(args, tmp_path)
    assert capsys.readouterr().out == f"reusing the synthetic dataset made earlier in {root}\n"


def test_the_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "shmseq" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "shmseq" / "demo"


def snapshots(others_seconds, wall=10.0, own=15.0, load_start=(0.1, 0.1, 0.1), load_end=(3, 2, 1)):
    start = load.Snapshot(100.0, load_start, 1000.0, 50.0)
    busy = None if others_seconds is None else 1000.0 + own + others_seconds
    return start, load.Snapshot(100.0 + wall, load_end, busy, 50.0 + own)


def test_busy_rule_counts_the_cpu_that_others_took_beyond_the_cores_the_job_leaves_free():
    # 2 cores, 2 workers + the trainer: no core left free, half a core of slack
    assert load.busy(*snapshots(4.0), workers=2, cores=2) == []          # 0.4 cores of others
    assert load.others_cores(*snapshots(4.0)) == pytest.approx(0.4)
    found = load.busy(*snapshots(6.0), workers=2, cores=2)               # 0.6 cores
    assert len(found) == 1 and "0.60 cores" in found[0]
    # 16 cores, 2 workers + the trainer: 13 free, so 13 cores of others still leave it its own
    assert load.busy(*snapshots(130.0), workers=2, cores=16) == []
    assert load.busy(*snapshots(140.0), workers=2, cores=16) != []
    # the load average, a minute's decaying average, is judged only without /proc/stat
    assert load.busy(*snapshots(0.0, load_start=(5, 5, 5)), workers=2, cores=2) == []
    assert load.busy(*snapshots(None, load_start=(0.4, 0, 0), load_end=(3.4, 0, 0)),
                     workers=2, cores=2) == []
    assert len(load.busy(*snapshots(None, load_start=(0.6, 0, 0), load_end=(3.6, 0, 0)),
                         workers=2, cores=2)) == 2


def test_the_snapshot_reads_this_machine():
    start = load.snapshot()
    sum(range(200_000))
    end = load.snapshot()
    assert end.wall > start.wall and end.own_seconds >= start.own_seconds
    assert load.usable_cores() >= 1
    if start.busy_seconds is not None:
        assert load.others_cores(start, end) >= 0


def test_a_single_run_prints_no_spread():
    one = Summary("shmseq", 5.0, 1234.0, (1234.0, 1234.0), 0.02, (0.02, 0.02), 150.0)
    three = Summary("shmseq", 5.0, 1234.0, (1200.0, 1300.0), 0.02, (0.01, 0.03), 150.0, runs=3)
    assert "(" not in report.table([one]).splitlines()[1]
    assert "img/s (min-max)" not in report.table([one])
    assert "1,234 (1,200-1,300)" in report.table([three])
    assert "2% (1%-3%)" in report.table([three])


def test_the_chart_says_the_machine_was_busy_and_that_its_bars_are_min_max(monkeypatch, tmp_path):
    from matplotlib import pyplot, text

    texts = []
    close = pyplot.close

    def closing(figure):
        texts.extend(shown.get_text() for shown in figure.findobj(text.Text))
        close(figure)

    monkeypatch.setattr(pyplot, "close", closing)
    summaries = [Summary(loader, step, 1234.0, (1200.0, 1300.0), 0.02, (0.01, 0.03), 150.0, runs=3)
                 for loader in ("shmseq", "torch DataLoader") for step in (5.0, 1.0)]
    warning = load.warning(["other work kept 1.20 cores busy on average while the job ran"])
    assert report.chart(tmp_path / "sweep.png", summaries, "2 workers", warning)
    shown = " ".join(texts).replace("\n", " ")
    assert "WARNING: the machine was busy (other work kept 1.20 cores busy" in shown
    assert "median of 3 runs, bars: min-max" in shown
