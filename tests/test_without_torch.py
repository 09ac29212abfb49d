import subprocess
import sys
import textwrap
from pathlib import Path


def test_import_and_numpy_output_without_torch():
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any 'import torch' now fails
        import numpy as np
        import warnings
        import shmseq

        class Worker:
            def __getitem__(self, indices):
                return np.stack([indices, indices * 2], axis=1)

        seq = shmseq.ShmSequence(Worker, 10, batch_size=4, num_workers=2, out_type="null",
                                 shuffle=False)
        with seq.start():
            print([b[:, 1].tolist() for b in seq])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback = shmseq.ShmSequence(Worker, 10, num_workers=1)  # default out_type='cuda'
        print(fallback.out_type, any("not installed" in str(w.message) for w in caught))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]", "null True"]


def test_the_benchmark_runs_without_torch_and_says_what_it_skipped(tmp_path):
    script = textwrap.dedent(f"""
        import runpy, sys
        sys.modules["torch"] = None
        sys.argv = ["shmseq.bench", "--quick", "--workloads", "cifar", "--seconds", "0.2",
                    "--systems", "shmseq-inplace,torch-sample,serial", "--out", {str(tmp_path)!r}]
        runpy.run_module("shmseq.bench", run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch is not installed: torch-sample skipped" in done.stderr
    assert "| cifar | shmseq-inplace |" in done.stdout and "torch-sample |" not in done.stdout
    assert "What the columns mean" in done.stdout and "arget" not in done.stdout
    assert (Path(tmp_path) / "results.json").is_file()


def test_importing_shmseq_torch_without_torch_says_what_to_install_and_what_works_without_it():
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        try:
            import shmseq.torch
        except ModuleNotFoundError as missing:
            print(missing.name)
            print(missing)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    name, message = done.stdout.split("\n", 1)
    assert name == "torch"
    assert "pip install torch" in message
    assert "shmseq.ShmSequence" in message and "shmseq.DataLoader" in message
    assert "out_type='null'" in message
