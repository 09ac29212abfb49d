"""The streaming workloads' data, written once, and the decoders both loaders' workers call.

Two kinds of WebDataset-layout tar shards (``shmseq.shards.write_shards``), every sample's
``cls`` its global id (its place in the shards), so that the consumer can check each batch's
labels against the plan:

* ``jpeg``: photo-like JPEGs, as ImageNet's: sides of 300 to 500 pixels, quality 90, 4:2:0.
  Each is a texture whose spectrum falls as 1/f, the statistics of natural images (which is
  what makes a photo cost what it costs to entropy-code: about 4 bits a pixel, 75 kB a file
  here; a flat colour would cost a tenth), with a shape's edges over it. ``JpegCrop`` decodes
  one with simplejpeg at reduced scale, random-resized-crops it to 224 x 224 and flips half of
  them, through ``shmseq.vision``'s own JPEG path (``ImageFolderWorker``'s): decode-bound.
* ``uint8``: 224 x 224 x 3 images stored raw (the ``rgb`` member, 150,528 bytes), whose first
  and last bytes mark the sample (as ``workloads``' pool rows are marked); ``decode_raw`` only
  wraps the bytes: what is left to measure is the transport.

A set is written into a scratch folder and renamed into place (``shmseq._apps.data.made_once``),
so an interrupted or concurrent run never leaves, or reads, a half-written one.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from shmseq._apps.data import SHAPES, made_once
from shmseq.shards import ShardIndex, write_shards
from shmseq.vision import MAX_PIXELS, ImageFolderWorker, _resize_into, _simplejpeg

from .workloads import _head, _tail

KINDS = ("jpeg", "uint8")
MIN_SIDE, MAX_SIDE = 300, 500
QUALITY = 90
_BANK_SIDE, _BANK_PLANES = 1024, 6
INDEX = "shards.json"


def _texture_bank(rng: np.random.Generator) -> np.ndarray:
    """Planes of 1/f noise (unit variance), which the photos are cut from."""
    fy = np.fft.fftfreq(_BANK_SIDE)[:, None]
    fx = np.fft.rfftfreq(_BANK_SIDE)[None, :]
    frequency = np.sqrt(fy * fy + fx * fx)
    frequency[0, 0] = np.inf
    shape = (_BANK_PLANES, _BANK_SIDE, _BANK_SIDE // 2 + 1)
    spectrum = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / frequency
    planes = np.fft.irfft2(spectrum, s=(_BANK_SIDE, _BANK_SIDE))
    return (planes / planes.std(axis=(1, 2), keepdims=True)).astype(np.float32)


def photo(rng: np.random.Generator, bank: np.ndarray, label: int, height: int,
          width: int) -> np.ndarray:
    """A uint8 ``height`` x ``width`` x 3 image: three texture planes, cut at random places and
    mixed into correlated channels, a shape of its own tint over it, and a little grain."""
    picks = rng.choice(len(bank), 3, replace=False)
    tops = rng.integers(0, _BANK_SIDE - height + 1, 3)
    lefts = rng.integers(0, _BANK_SIDE - width + 1, 3)
    planes = [bank[p, top:top + height, left:left + width] for p, top, left in zip(picks, tops, lefts)]
    mix = rng.uniform(0.3, 1.0, (3, 3)).astype(np.float32)
    mix *= 50 / mix.sum(axis=1, keepdims=True)
    image = np.empty((height, width, 3), np.float32)
    for channel in range(3):
        image[..., channel] = sum(weight * plane for weight, plane in zip(mix[channel], planes))
    yy, xx = np.ogrid[:height, :width]
    cy, cx = rng.uniform(0.3, 0.7, 2) * (height, width)
    radius = rng.uniform(0.2, 0.4) * min(height, width)
    mask = SHAPES[label % len(SHAPES)]((yy - cy) / radius, (xx - cx) / radius)
    image += np.where(mask[..., None], rng.uniform(60, 200, 3), rng.uniform(60, 200, 3)).astype(np.float32)
    image += rng.integers(-5, 6, image.shape, dtype=np.int8)
    return np.clip(image, 0, 255).astype(np.uint8)


def jpeg_samples(images: int, seed: int = 0) -> Iterator[dict]:
    """``write_shards`` samples: ``jpg`` (a photo-like JPEG) and ``cls`` (the sample's id)."""
    simplejpeg = _simplejpeg()
    rng = np.random.default_rng(seed)
    bank = _texture_bank(rng)
    for number in range(images):
        height, width = (int(side) for side in rng.integers(MIN_SIDE, MAX_SIDE + 1, 2))
        data = simplejpeg.encode_jpeg(photo(rng, bank, number, height, width), quality=QUALITY,
                                      colorsubsampling="420")
        yield {"__key__": f"{number:08d}", "jpg": data, "cls": number}


def raw_samples(images: int, side: int, seed: int = 0) -> Iterator[dict]:
    """``write_shards`` samples: ``rgb`` (``side`` x ``side`` x 3 uint8 bytes, marked with the
    sample's id in its first and last bytes) and ``cls`` (the id)."""
    rng = np.random.default_rng(seed)
    for number in range(images):
        image = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        ids = np.array([number])
        image[0, 0, 0], image[-1, -1, -1] = _head(ids)[0], _tail(ids)[0]
        yield {"__key__": f"{number:08d}", "rgb": image.tobytes(), "cls": number}


def make_shards(root: str | os.PathLike, kind: str, images: int, samples_per_shard: int,
                side: int = 224, seed: int = 0) -> Path:
    """The shards of ``kind`` and their index (``root/shards.json``), or a complete earlier
    set made there with the same arguments (the folder's name should say them)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def write(folder: Path) -> None:
        folder.mkdir(parents=True)
        samples = jpeg_samples(images, seed) if kind == "jpeg" else raw_samples(images, side, seed)
        write_shards(samples, str(folder / "train-%05d.tar"), samples_per_shard=samples_per_shard,
                     index=str(folder / INDEX))

    return made_once(Path(root), write)


def load_index(root: str | os.PathLike, warm: bool = True) -> ShardIndex:
    """The shards' index; ``warm``: every shard read through once, so that both loaders find
    them in the page cache (the first run is not the only one to read the disk)."""
    index = ShardIndex.load(str(Path(root) / INDEX))
    if warm:
        for shard in index.shards:
            with open(shard.url, "rb") as file:
                while file.read(1 << 24):
                    pass
    return index


def size_of(index: ShardIndex) -> int:
    """Bytes of the shards."""
    return sum(os.path.getsize(shard.url) for shard in index.shards)


class JpegCrop:
    """``decode`` for the JPEG shards: ``(image, label)``, the image a random-resized crop
    (``scale`` of the area, ``ratio`` of aspect) to ``size`` x ``size`` x 3 uint8, flipped with
    probability 1/2, decoded at the strongest DCT reduction that keeps the crop at least
    ``size`` a side: ``ImageFolderWorker``'s JPEG path itself, the one ``shmseq.vision``'s
    workers run (its ``_crop`` and ``_decode_jpeg``, and ``_resize_into``). The randomness
    comes from ``seed`` and the sample's id, so a sample is cropped alike by any loader."""

    _crop = ImageFolderWorker._crop
    _decode_jpeg = ImageFolderWorker._decode_jpeg

    def __init__(self, size: int = 224, seed: int = 0, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.seed, self.scale, self.ratio = int(size), int(seed), scale, ratio
        self.augment = self.flip = True
        self.max_pixels = MAX_PIXELS  # the image worker's limit, which its JPEG path checks
        _simplejpeg()  # an ImportError with the fix now, not in a worker

    def __call__(self, sample: dict) -> tuple[np.ndarray, int]:
        label = int(sample["cls"])
        rng = np.random.default_rng([self.seed, label])
        # the type ignored: the image worker's method, borrowed; this has what it reads
        image, box = self._decode_jpeg(_simplejpeg(), sample["jpg"], rng)  # type: ignore[misc]
        row = np.empty((self.size, self.size, 3), np.uint8)
        _resize_into(image, box, row, rng.random() < 0.5)
        return row, label


class RawImage:
    """``decode`` for the uint8 shards: the ``rgb`` bytes as a ``side`` x ``side`` x 3 array (a
    view, no copy: the worker's stacking is the one copy), and the label."""

    def __init__(self, side: int = 224) -> None:
        self.shape = (int(side), int(side), 3)

    def __call__(self, sample: dict) -> tuple[np.ndarray, int]:
        return np.frombuffer(sample["rgb"], np.uint8).reshape(self.shape), int(sample["cls"])


def decoder(kind: str, side: int = 224, seed: int = 0) -> JpegCrop | RawImage:
    return JpegCrop(side, seed) if kind == "jpeg" else RawImage(side)


def largest_sample(index: ShardIndex) -> int:
    """Bytes of the largest sample, its members' tar headers included: more than any member
    of it, so that ``batch_size`` of them size a slot of encoded images that none overflows."""
    return max(int(np.diff(np.append(shard.offsets, shard.end)).max()) for shard in index.shards)


def jpeg_stats(index: ShardIndex, samples: int = 64) -> dict:
    """Mean file size, pixels and bits a pixel of the first ``samples`` JPEGs (for the report)."""
    from shmseq.shards import ShardReader
    simplejpeg = _simplejpeg()
    read = ShardReader(index).read(np.arange(min(samples, len(index))))
    sizes = [len(sample["jpg"]) for sample in read]
    pixels = [np.prod(simplejpeg.decode_jpeg_header(sample["jpg"])[:2]) for sample in read]
    return {"kB": float(np.mean(sizes)) / 1e3, "pixels": float(np.mean(pixels)),
            "bits_per_pixel": float(np.sum(sizes) * 8 / np.sum(pixels))}

