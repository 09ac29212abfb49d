"""The main job, end to end: ``python -m shmseq.demo --quick``."""
import re
import subprocess
import sys

import pytest

for module in ("torch", "tqdm", "simplejpeg"):
    pytest.importorskip(module)

ROW = r"\s+(\d+)\s+(\d+)%\s+(\d+)\s+([\d.]+)\s+([\d.]+)%$"


def test_quick_demo_trains_and_compares_both_loaders(tmp_path):
    done = subprocess.run([sys.executable, "-m", "shmseq.demo", "--quick", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("shmseq demo: 200 images in 10 classes") for line in lines)
    for name in ("shmseq", "torch DataLoader"):
        row = next((re.match(re.escape(name) + ROW, line) for line in lines
                    if re.match(re.escape(name) + ROW, line)), None)
        assert row, f"no summary row for {name} in:\n{done.stdout}"
        train_rate, stall, alone_rate = (int(v) for v in row.groups()[:3])
        assert train_rate > 0 and alone_rate > 0 and 0 <= stall <= 100
    assert any(line.startswith("shmseq / DataLoader: training ") for line in lines)
    assert (tmp_path / "synthetic-200-10").is_dir()  # made once, reused by later runs
