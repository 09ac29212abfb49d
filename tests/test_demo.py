"""The main job, end to end: ``python -m shmseq.demo --quick``. Its structure, not its figures."""
import json
import re
import subprocess
import sys

import pytest

for module in ("torch", "tqdm", "simplejpeg", "matplotlib"):
    pytest.importorskip(module)

LOADERS = {"shmseq", "torch DataLoader", "torch DataLoader, batch-level"}


@pytest.mark.parametrize("form", ["store", "jpeg"])
def test_quick_demo_trains_then_sweeps_every_loader_and_step_time(tmp_path, form):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "shmseq.demo", "--quick", "--format", form,
                           "--workdir", str(tmp_path / "data"), "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"epoch 1: loss \d+\.\d+, accuracy \d+\.\d%, [\d,]+ img/s", done.stdout)
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert {(s["loader"], s["step_ms"]) for s in summary} == {
        (loader, step) for loader in LOADERS for step in (20.0, 5.0, 1.0)}
    for s in summary:
        assert 0 <= s["stall"] <= 1 and s["images_per_s"] > 0 and s["cpu_us_per_batch"] > 0
    for loader in LOADERS:
        assert re.search(rf"^\s+1\s+{re.escape(loader)}\s+[\d,]+ \(", done.stdout, re.MULTILINE)
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "results.md").is_file()
    assert any((tmp_path / "data").iterdir())  # made once, reused by later runs
