"""Two ranks under torchrun: together they cover the dataset once per epoch, in step."""
import json
import sys
from pathlib import Path

import pytest

from jobs import output_of

pytest.importorskip("torch.distributed")

EXAMPLE = Path(__file__).parent.parent / "examples" / "ddp_train.py"


def test_ddp_example_ranks_cover_every_epoch_exactly_once(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLE), "--samples", "301", "--epochs", "2", "--batch-size", "16",
               "--report", str(tmp_path)]
    output_of(command, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["seen"] for r in (0, 1)]
    for epoch in range(2):
        first, second = ranks[0][epoch], ranks[1][epoch]
        assert len(first) == len(second) == 151  # 301 dealt to 2 ranks, padded by wrapping
        assert set(first).isdisjoint(set(second)) or len(set(first) & set(second)) == 1
        assert set(first) | set(second) == set(range(301))
    assert ranks[0][0] != ranks[0][1]  # reshuffled by set_epoch
