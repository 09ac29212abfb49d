"""Every ```python block of README.md and docs/*.md runs as written, each in a process of its own.

A block runs from a file in an empty temporary folder, with this checkout first on the path,
under ``-W error::RuntimeWarning``: a warning of shmseq's (a CUDA fallback, a batch copied out
of the ring, a worker replaced) fails it as an error would. A block that is not meant to run
(a signature, a command) is fenced as ```text or ```bash, never skipped here. A block that
needs an optional package that is not installed is skipped, naming it: torch where it imports
torch or ``shmseq.torch``, or asks for torch tensors (``out_type`` 'cpu' or 'cuda'); werkzeug,
fsspec and aiohttp where it serves with ``shmseq.bench.servers``. Whether it is installed is
looked up, not imported: Lightning, transformers and accelerate would add 200 MB to the suite's
process, whose page tables every worker forked after them copies.

A block whose opening imports import torch (``import torch``, ``from torch ...``,
``shmseq.torch``: torch is loaded before any of its other code runs) runs in a process forked
from one that imported torch and nothing else, under the same flags and environment: it becomes
that process's ``__main__`` (its file, its folder first on the path, its own globals, freed as a
script's are, at exit), as ``python snippet.py`` would make it. Torch's import, 1.5 s of each such
block on 2 cores, is paid once for all of them; every other block starts a fresh interpreter.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
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


def torch_first(code: str) -> bool:
    """Whether the block's opening imports (its statements before the first that is not an
    import) import torch or shmseq.torch."""
    for statement in ast.parse(code).body:
        if isinstance(statement, ast.Import):
            names = [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and not statement.level:
            names = [statement.module] + [f"{statement.module}.{a.name}" for a in statement.names]
        else:
            return False
        if any(name == "torch" or name.startswith("torch.") or name == "shmseq.torch"
               for name in names):
            return True
    return False


def test_the_documents_have_snippets():
    assert {param.values[0] for param in SNIPPETS} >= {"README.md", "docs/reference.md",
                                                        "docs/from-pytorch.md"}


# The process the blocks that import torch first are forked from: it imports torch, says
# "ready", then for each folder it is sent forks a child that runs the folder's snippet.py as its
# __main__ (its output in the files stdout and stderr beside the folder) and says the child's
# pid, then its exit status as subprocess gives it (-N for signal N).
PRELOADED = textwrap.dedent("""
    import os, sys
    import torch  # noqa: F401 - what the blocks share

    def serve():
        print("ready", flush=True)
        for request in sys.stdin:
            folder = request.strip()
            sys.stdout.flush()
            sys.stderr.flush()
            child = os.fork()
            if child == 0:
                return folder
            print("pid", child, flush=True)
            print("exit", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
        sys.exit(0)

    def become(folder):
        \"\"\"Be ``python snippet.py`` run in ``folder``: its streams, folder, path, argv and a
        __main__ holding nothing but the script's globals.\"\"\"
        import importlib.machinery
        os.chdir(folder)
        for fd, name, mode in ((0, os.devnull, os.O_RDONLY),
                               (1, "../stdout", os.O_WRONLY | os.O_CREAT),
                               (2, "../stderr", os.O_WRONLY | os.O_CREAT)):
            opened = os.open(name, mode)
            os.dup2(opened, fd)
            os.close(opened)
        path = os.path.join(folder, "snippet.py")
        sys.argv[:] = ["snippet.py"]
        sys.path[0] = folder
        main = sys.modules["__main__"]
        builtins = main.__dict__["__builtins__"]
        main.__dict__.clear()
        main.__dict__.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", path),
                             __file__=path, __cached__=None, __builtins__=builtins)
        with open(path) as source:
            code = compile(source.read(), path, "exec")
        exec(code, main.__dict__)

    become(serve())
""")


class Preloaded:
    """The process the blocks that import torch first are forked from (PRELOADED)."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-W", "error::RuntimeWarning", "-c", PRELOADED], cwd=ROOT,
            env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        self.said = b""  # read from its stdout, not yet a whole line

    def line(self, seconds: float) -> str | None:
        """Its next line, None if it said none within ``seconds``; its end fails the test."""
        deadline, out = time.monotonic() + seconds, self.process.stdout.fileno()
        while b"\n" not in self.said:
            if not select.select([out], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            more = os.read(out, 4096)
            if not more:
                pytest.fail(f"the preloaded process ended: {self.said.decode()}"
                            f"{self.process.stderr.read().decode(errors='replace')}")
            self.said += more
        line, self.said = self.said.split(b"\n", 1)
        return line.decode()

    def run(self, folder: Path) -> int | None:
        """Run ``folder``'s snippet.py in a child: its exit status as subprocess gives it, None
        if it ran past TIMEOUT_S (it is then killed)."""
        self.process.stdin.write(f"{folder}\n".encode())
        self.process.stdin.flush()
        said = self.line(30) or ""
        assert said.startswith("pid "), f"the preloaded process did not fork: {said!r}"
        status = self.line(TIMEOUT_S)
        if status is None:
            os.kill(int(said.split()[1]), signal.SIGKILL)
            self.line(30)
            return None
        return int(status.split()[1])

    def close(self):
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.fixture(scope="module")
def preloaded():
    """The process that forks the blocks importing torch first, once it imported torch."""
    process = Preloaded()
    try:
        ready = process.line(TIMEOUT_S)
        assert ready == "ready", f"torch's import failed: {ready}"
        yield process
    finally:
        process.close()


def environment() -> dict:
    """This checkout first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("document, line, code", SNIPPETS)
def test_snippet_runs(document, line, code, tmp_path, request):
    missing = [module for module in needs(code) if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    assert not re.search(r"^\s*(import|from)\s+torchvision\b", code, re.MULTILINE), (
        f"{document}:{line} imports torchvision, which no torch build installs alongside "
        "(see docs/from-pytorch.md)")
    folder = tmp_path / "run"  # empty but for the script; the output goes beside it
    folder.mkdir()
    script = folder / "snippet.py"
    script.write_text(code)
    if torch_first(code):
        returncode = request.getfixturevalue("preloaded").run(folder)
        stdout, stderr = ((tmp_path / name).read_text(errors="replace")
                          for name in ("stdout", "stderr"))
    else:
        try:
            done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", script.name],
                                  cwd=folder, env=environment(), capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
            returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, stdout, stderr = None, *(
                text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                for text in (expired.stdout, expired.stderr))
    if returncode is None:
        pytest.fail(f"the snippet at {document}:{line} ran past {TIMEOUT_S} s\n{stdout}{stderr}")
    assert returncode == 0, (
        f"the snippet at {document}:{line} failed (exit {returncode}):\n"
        f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-6000:]}")


def test_a_snippet_needs_the_optional_packages_it_imports_and_torch_for_torch_tensors():
    assert needs("import numpy\nfrom shmseq import ShmSequence\nShmSequence(W, 9, out_type='null')") == []
    assert needs('ShmSequence(W, 9, out_type="cpu")') == ["torch"]
    assert needs("from shmseq.torch import DataLoader") == ["torch"]
    assert needs("import lightning as L\nfrom PIL import Image") == ["PIL", "lightning"]
    assert needs("from shmseq.bench.servers import FileServer") == ["aiohttp", "fsspec", "werkzeug"]
