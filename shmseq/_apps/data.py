"""The applications' synthetic data: the shapes that tell the classes of their images apart,
and data sets written once, into a scratch folder renamed into place, so that an interrupted
or concurrent run never leaves (or reads) a half-written one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np


def _disc(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    return dy * dy + dx * dx < 1.0


def _square(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    return np.maximum(abs(dy), abs(dx)) < 0.8


def _triangle(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    return (dy > -1.0) & (dy < 0.8) & (abs(dx) < (dy + 1.0) * 0.55)


def _ring(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    d2 = dy * dy + dx * dx
    return (d2 > 0.35) & (d2 < 1.0)


def _cross(dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    return ((abs(dy) < 0.25) & (abs(dx) < 1.0)) | ((abs(dx) < 0.25) & (abs(dy) < 1.0))


SHAPES = (_disc, _square, _triangle, _ring, _cross)


def made_once(root: Path, write: Callable[[Path], object]) -> Path:
    """``root`` if it exists, else ``write`` it into a scratch folder and rename that."""
    if root.is_dir():
        return root
    scratch = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        write(scratch)
        scratch.rename(root)
    except OSError:
        if not root.is_dir():
            raise
    finally:  # left over only when interrupted, or when another run finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return root
