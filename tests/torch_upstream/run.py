"""Runs PyTorch's own DataLoader tests (``test/test_dataloader.py`` of a PyTorch source tree of
the installed version) with torch's ``DataLoader``, then with ``shmseq.torch.DataLoader`` in its
place, and reports what shmseq's class fails of what torch's passes here::

    python tests/torch_upstream/run.py /path/to/pytorch/test/test_dataloader.py [pytest args]

The file is not part of this repository; it needs ``expecttest`` and ``psutil`` (torch's test
helpers import them). Each run is a pytest process of its own, with this folder's
``sitecustomize`` on ``PYTHONPATH``, so that shmseq's class is the one imported everywhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def outcomes(test_file: Path, as_shmseq: bool, extra: list[str]) -> dict[str, str]:
    """Test id -> 'passed', 'failed', 'skipped' or 'xfailed', from one pytest run."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        env = {**os.environ, "SHMSEQ_AS_TORCH_DATALOADER": "1" if as_shmseq else "0",
               "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
                        "-c", os.devnull, "--rootdir", str(test_file.parent), "--timeout", "600",
                        f"--junitxml={report}", *extra], env=env, check=False)
        return {f"{case.get('classname')}.{case.get('name')}": _outcome(case)
                for case in ElementTree.parse(report).iter("testcase")}


def _outcome(case) -> str:
    for child in case:
        if child.tag == "skipped":
            return "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        if child.tag in ("failure", "error"):
            return "failed"
    return "passed"


def main() -> int:
    test_file, extra = Path(sys.argv[1]).resolve(), sys.argv[2:]
    torchs = outcomes(test_file, False, extra)
    ours = outcomes(test_file, True, extra)
    passed = sorted(name for name, outcome in torchs.items() if outcome == "passed")
    failed = [name for name in passed if ours.get(name) != "passed"]
    for name, outcome in (("torch's DataLoader", torchs), ("shmseq.torch.DataLoader", ours)):
        counts = {kind: sum(1 for o in outcome.values() if o == kind)
                  for kind in ("passed", "failed", "skipped", "xfailed")}
        print(f"{name}: {counts}")
    print(f"shmseq's class passes {len(passed) - len(failed)} of the {len(passed)} tests "
          "torch's class passes here")
    for name in failed:
        print(f"  {ours.get(name, 'missing')}: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
