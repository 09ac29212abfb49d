"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process.

A block runs from a file in an empty temporary folder, with this checkout first on the path,
under ``-W error::RuntimeWarning``: a warning of shmseq's (a CUDA fallback, a batch copied out
of the ring, a worker replaced) fails it as an error would. A block that is not meant to run
(a signature, a command) is fenced as ```text or ```bash, never skipped here. A block that
needs an optional package that is not installed is skipped, naming it: torch where it imports
torch or ``shmseq.torch``, or asks for torch tensors (``out_type`` 'cpu' or 'cuda'); werkzeug,
fsspec and aiohttp where it serves with ``shmseq.bench.servers``. Whether it is installed is
looked up, not imported: Lightning, transformers and accelerate would add 200 MB to the suite's
process, whose page tables every worker forked after them copies.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 60
OPTIONAL = ("torch", "lightning", "accelerate", "fsspec", "aiohttp", "simplejpeg", "PIL",
            "matplotlib", "tqdm", "s3fs", "werkzeug", "moto", "boto3")  # the modules of
# pyproject.toml's optional dependencies
IMPORTS = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.MULTILINE)
TORCH_OUTPUT = re.compile(r"""out_type\s*=\s*["'](cpu|cuda)|\bshmseq\.torch\b""")
TEST_SERVERS = re.compile(r"\bshmseq\.bench\.servers\b")  # needs werkzeug, and a client
SERVED = {"werkzeug", "fsspec", "aiohttp"}


def snippets() -> list:
    """One parameter per block: the document, the block's line and its code; named by the
    document and the block's number in it."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, block in enumerate(FENCE.finditer(text), 1):
            line = text.count("\n", 0, block.start()) + 1
            name = document.relative_to(ROOT).as_posix()
            found.append(pytest.param(name, line, block.group(1), id=f"{name}#{number}"))
    return found


SNIPPETS = snippets()


def needs(code: str) -> list[str]:
    """The optional packages a block needs."""
    found = {name for name in IMPORTS.findall(code) if name in OPTIONAL}
    found |= {"torch"} if TORCH_OUTPUT.search(code) else set()
    return sorted(found | (SERVED if TEST_SERVERS.search(code) else set()))


def test_the_documents_have_snippets():
    assert {param.values[0] for param in SNIPPETS} >= {"README.md", "docs/reference.md",
                                                        "docs/from-pytorch.md"}


@pytest.mark.parametrize("document, line, code", SNIPPETS)
def test_snippet_runs(document, line, code, tmp_path):
    missing = [module for module in needs(code) if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    assert not re.search(r"^\s*(import|from)\s+torchvision\b", code, re.MULTILINE), (
        f"{document}:{line} imports torchvision, which no torch build installs alongside "
        "(see docs/from-pytorch.md)")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", script.name],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        output = [text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                  for text in (expired.stdout, expired.stderr)]
        pytest.fail(f"the snippet at {document}:{line} ran past {TIMEOUT_S} s\n{''.join(output)}")
    assert done.returncode == 0, (
        f"the snippet at {document}:{line} failed (exit {done.returncode}):\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")


def test_a_snippet_needs_the_optional_packages_it_imports_and_torch_for_torch_tensors():
    assert needs("import numpy\nfrom shmseq import ShmSequence\nShmSequence(W, 9, out_type='null')") == []
    assert needs('ShmSequence(W, 9, out_type="cpu")') == ["torch"]
    assert needs("from shmseq.torch import DataLoader") == ["torch"]
    assert needs("import lightning as L\nfrom PIL import Image") == ["PIL", "lightning"]
    assert needs("from shmseq.bench.servers import FileServer") == ["aiohttp", "fsspec", "werkzeug"]
