"""Puts ``shmseq.torch.DataLoader`` in the place of ``torch.utils.data.DataLoader`` in every
Python process started with this folder on ``PYTHONPATH`` and SHMSEQ_AS_TORCH_DATALOADER=1:
torch's test file imports the name in the test process, in the processes it spawns, and in the
scripts it runs with ``subprocess``, and each of them must get shmseq's class (see run.py)."""
import os

if os.environ.get("SHMSEQ_AS_TORCH_DATALOADER") == "1":
    import torch.utils.data

    import shmseq.torch

    torch.utils.data.DataLoader = shmseq.torch.DataLoader
