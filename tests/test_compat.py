import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmseq import MPSequence, MSequence, MTSequence
from workers import IndexWorker

EXAMPLE = Path(__file__).parent.parent / "examples" / "mdnc_example.py"


def test_the_mdnc_documentation_example_prints_every_index_in_order():
    pytest.importorskip("torch")  # the example prints torch tensors
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1024
    parallel = [line for line in lines[:512]]
    assert parallel == [f"data: tensor([{i}])" for i in range(512)]
    assert lines[512:] == [f"data: [{i}]" for i in range(512)]
    assert "CUDA is not available" in done.stderr or "cuda" in done.stderr.lower()


@pytest.mark.parametrize("cls, backend", [(MPSequence, "proc"), (MTSequence, "thread")])
def test_drop_in_names_take_mdnc_positional_arguments(cls, backend):
    seq = cls(IndexWorker, 20, 2, None, 5, 4, False, "null", 3)
    assert seq.thread_type == backend and seq.batch_size == 5 and seq.buffer == 4
    assert seq.seed == 3 and seq.out_type == "null" and seq.length == 4
    with seq.start() as running:
        assert [b.tolist() for b in running] == [list(range(i, i + 5)) for i in range(0, 20, 5)]


def test_msequence_keeps_dtypes_unlike_mdnc():
    seq = MSequence(IndexWorker, 8, num_workers=1, batch_size=4, shuffle=False, out_type="null")
    with seq.start():
        assert all(batch.dtype == np.int64 for batch in seq)
