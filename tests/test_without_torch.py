import subprocess
import sys
import textwrap


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
