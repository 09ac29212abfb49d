"""What the applications' reports print alike: the machine they measured on, and a figure with
its spread over repeats."""
from __future__ import annotations

import os
import platform

import numpy as np


def with_spread(value: float, spread: tuple[float, float], spec: str, runs: int) -> str:
    """``value (min-max)`` over two or more runs; one run has no spread: just ``value``."""
    if runs < 2:
        return format(value, spec)
    low, high = spread
    return f"{value:{spec}} ({low:{spec}}-{high:{spec}})"


def _read(path: str, key: str) -> str:
    with open(path) as file:
        for line in file:
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return "unknown"


def machine() -> dict:
    """What the figures were measured on."""
    kib = int(_read("/proc/meminfo", "MemTotal").split()[0])
    try:
        import torch
        torch_version: str = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {"nproc": len(os.sched_getaffinity(0)),
            "cpu": _read("/proc/cpuinfo", "model name"),
            "ram": f"{kib / 2**20:.1f} GiB",
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch_version}
