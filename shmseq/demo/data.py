"""Synthetic image datasets for the demo and the tests, made once and reused.

Each class has its own shape and colour, drawn at a random place and size over a
noisy background of random tint, so a small CNN can learn the classes while a
decoder still sees photo-like, incompressible noise.

* ``make_array_store``: decoded uint8 images of one size in ``images.npy`` (memory-
  mapped by ``shmseq.vision.ImageArrayWorker``) and their ``labels.npy``;
* ``make_jpeg_folder``: JPEG files in the ImageFolder layout, 160 to 320 pixels a
  side as photos vary, so that reduced-scale decoding matters.

Both are built in a scratch folder and renamed into place, so an interrupted or
concurrent run never leaves (or reads) a half-written dataset.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .._apps.data import SHAPES, made_once

MIN_SIDE, MAX_SIDE = 160, 320
QUALITY = 90


def class_colour(label: int, classes: int) -> np.ndarray:
    """A hue per class, evenly spread around the colour wheel."""
    angle = 2.0 * math.pi * label / classes + np.array([0.0, 2.0, 4.0]) * math.pi / 3.0
    return 127.5 + 127.5 * np.cos(angle)


def draw(rng: np.random.Generator, label: int, classes: int,
         side: int | None = None) -> np.ndarray:
    """One uint8 HxWx3 image of class ``label``: ``side`` x ``side``, or of a random size."""
    height, width = ((side, side) if side else
                     (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2)))
    yy, xx = np.ogrid[:height, :width]
    cy, cx = rng.uniform(0.35, 0.65, size=2) * (height, width)
    radius = rng.uniform(0.25, 0.45) * min(height, width)
    mask = SHAPES[label % len(SHAPES)]((yy - cy) / radius, (xx - cx) / radius)
    tint = rng.integers(32, 160, size=3)
    colour = class_colour(label, classes) + rng.uniform(-20.0, 20.0, size=3)
    image = rng.integers(-24, 25, size=(height, width, 3), dtype=np.int16)
    image += np.where(mask[..., None], colour, tint).astype(np.int16)
    return np.clip(image, 0, 255).astype(np.uint8)


def make_array_store(root: str | os.PathLike, images: int, classes: int, side: int,
                     seed: int = 0) -> Path:
    """``images`` decoded ``side`` x ``side`` images and their labels under ``root``, or a
    complete earlier store."""
    def write(folder: Path) -> None:
        folder.mkdir(parents=True)
        rng = np.random.default_rng(seed)
        store = np.lib.format.open_memmap(folder / "images.npy", "w+", np.uint8,
                                          (images, side, side, 3))
        for i in range(images):
            store[i] = draw(rng, i % classes, classes, side)
        store.flush()
        del store
        np.save(folder / "labels.npy", np.arange(images, dtype=np.int64) % classes)

    return made_once(Path(root), write)


def make_jpeg_folder(root: str | os.PathLike, images: int, classes: int, seed: int = 0) -> Path:
    """``images`` JPEGs under ``root/class_NN/``, or a complete earlier set."""
    import simplejpeg

    def write(folder: Path) -> None:
        rng = np.random.default_rng(seed)
        names = [f"class_{label:02d}" for label in range(classes)]
        for name in names:
            (folder / name).mkdir(parents=True)
        for i in range(images):
            label = i % classes
            data = simplejpeg.encode_jpeg(draw(rng, label, classes), quality=QUALITY,
                                          colorsubsampling="420")
            (folder / names[label] / f"{i:06d}.jpg").write_bytes(data)

    return made_once(Path(root), write)
