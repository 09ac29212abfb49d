"""Images from JPEG files, or from a pre-decoded array store, each written once, straight into
its row of the slot.

``ImageArrayWorker`` reads a store of decoded ``uint8`` images (``images.npy``, N x H x W x
3, memory-mapped, and ``labels.npy``), as FFCV-style and downsampled-ImageNet setups keep
them: a random crop, maybe flipped, copied straight into the slot row. The rest of this
module is the JPEG path:

``ImageFolderWorker`` reads the ImageFolder layout (``root/<class>/*.jpg``, classes
sorted into label ids) and is an in-place worker: each image is decoded, cropped
at random (random-resized-crop), maybe flipped, and written once, into its row of
the slot's ``uint8`` N x H x W x 3 array. Labels arrive as ``int64``.

Per image: the JPEG header gives the size; the crop is drawn; the image is decoded
at the strongest reduction (1/2, 1/4 or 1/8, done inside the inverse DCT) that
keeps the crop at least the output size, into a per-thread scratch buffer reused
for every image; a nearest-neighbour index map then writes the crop, resized and
flipped, into the row. No full-size image is allocated per sample.

Decoder, chosen by measurement: read + decode + crop + flip of 600 synthetic JPEGs
into preallocated 64 x 64 rows, one process, best of 5 interleaved rounds, images/s:

======================  =================  ===========================
decoder                 160-320 px, 25 kB  375-500 px, 79 kB
======================  =================  ===========================
simplejpeg 1.9          2,790              1,090 (910 at full scale)
PyTurboJPEG 1.8         2,640              1,070
Pillow 13, draft        1,800              890
======================  =================  ===========================

simplejpeg decodes into a given buffer (``buffer=``) at reduced scale
(``min_height``/``min_width``), from a wheel with libjpeg-turbo inside. PyTurboJPEG
needs the system's libturbojpeg (and a wrapper version to match it) for no gain;
Pillow allocates an image per sample and is the slowest. Entropy decoding is most of
the cost, so the reduced scale gains about 20 % on photo-sized files, not more.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .layout import SlotAllocator

EXTENSIONS = (".jpg", ".jpeg")
REDUCTIONS = (8, 4, 2, 1)
_scratch = threading.local()


class ImageDecodeError(ValueError):
    """A file that is not a readable JPEG; the message names it."""


def _simplejpeg():
    try:
        import simplejpeg
    except ImportError as exc:
        raise ImportError("shmseq.vision needs simplejpeg: pip install 'shmseq[vision]'") from exc
    return simplejpeg


@dataclass(frozen=True, eq=False)
class ImageFolder:
    """The files of ``root/<class>/*.jpg`` and their labels (classes sorted by name)."""

    root: str
    classes: tuple[str, ...]
    files: tuple[str, ...]
    labels: np.ndarray

    @classmethod
    def scan(cls, root: str | os.PathLike) -> "ImageFolder":
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {root} does not exist")
        classes = tuple(sorted(entry.name for entry in os.scandir(root) if entry.is_dir()))
        files, labels = [], []
        for label, name in enumerate(classes):
            found = sorted(entry.path for entry in os.scandir(root / name)
                           if entry.is_file() and entry.name.lower().endswith(EXTENSIONS))
            files += found
            labels += [label] * len(found)
        if not files:
            raise ValueError(f"no {'/'.join(EXTENSIONS)} files in the class folders of {root} "
                             "(expected root/<class>/<image>.jpg)")
        return cls(str(root), classes, tuple(files), np.array(labels, np.int64))

    def __len__(self) -> int:
        return len(self.files)


def random_resized_crop(rng: np.random.Generator, width: int, height: int,
                        scale: tuple[float, float], ratio: tuple[float, float]
                        ) -> tuple[float, float, float, float]:
    """A crop ``(left, top, width, height)`` of a random share of the area and aspect ratio.

    Ten tries, then the largest centred crop of an allowed ratio, as is customary.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if w <= width and h <= height:
            return rng.uniform(0, width - w), rng.uniform(0, height - h), w, h
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = min(width, height * aspect), min(height, width / aspect)
    return (width - w) / 2, (height - h) / 2, w, h


def _reduction(crop_w: float, crop_h: float, size: int) -> int:
    """The largest DCT reduction that still leaves the crop at least ``size`` pixels a side."""
    return next(k for k in REDUCTIONS
                if k == 1 or (crop_w / k >= size and crop_h / k >= size))


def _scratch_buffer(nbytes: int) -> np.ndarray:
    """This thread's decode buffer, grown when an image needs more (threads share workers)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _scratch.buffer = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buffer


def _resize_into(image: np.ndarray, box: tuple[float, float, float, float],
                 row: np.ndarray, flip: bool) -> None:
    """Nearest-neighbour resize of ``image[box]`` written straight into ``row``."""
    height, width = image.shape[:2]
    left, top, crop_w, crop_h = box
    centres = (np.arange(row.shape[0]) + 0.5) / row.shape[0]
    ys = np.minimum(top + centres * crop_h, height - 1).astype(np.intp)
    xs = np.minimum(left + centres * crop_w, width - 1).astype(np.intp)
    if flip:
        xs = xs[::-1]
    np.take(image.reshape(-1, 3), ys[:, None] * width + xs, axis=0, out=row, mode="clip")


class _RowWorker:
    """What both image workers share: a batch is ``size`` x ``size`` rows, each loaded
    straight into the slot by ``load_into``, with randomness drawn from the batch's indices."""

    size: int
    seed: int
    labels: np.ndarray

    def rng_for(self, indices: np.ndarray) -> np.random.Generator:
        """The batch's generator: a function of the seed and the batch's indices only."""
        return np.random.default_rng([self.seed, *np.asarray(indices, np.int64).tolist()])

    def fill_batch(self, indices: np.ndarray, out: SlotAllocator) -> tuple[np.ndarray, np.ndarray]:
        """Load every sample of the batch into its row of a slot array (shmseq calls this)."""
        rng = self.rng_for(indices)
        images = out.empty((len(indices), self.size, self.size, 3), np.uint8)
        for row, index in zip(images, indices):
            self.load_into(int(index), row, rng)
        labels = out.empty(len(indices), np.int64)
        labels[:] = self.labels[indices]
        return images, labels

    def load_into(self, index: int, row: np.ndarray, rng: np.random.Generator) -> None:
        raise NotImplementedError


class ImageFolderWorker(_RowWorker):
    """An in-place shmseq worker over an ImageFolder: each image decoded into its slot row.

    ``ShmSequence(ImageFolderWorker(root, 64, seed=0), len(worker), ...)`` yields
    ``(images, labels)``: ``uint8`` (N, size, size, 3) and ``int64`` (N,).

    Augmentation is random-resized-crop (``scale`` of the area, ``ratio`` of aspect)
    then a horizontal flip with probability 1/2 (``flip``). Its randomness comes from
    a generator seeded by ``seed`` and the batch's sample indices, so a batch is
    augmented the same way whichever worker builds it, in any run with that seed;
    epochs differ because shuffling gives them different batches (with
    ``shuffle=False`` every epoch repeats the same crops).
    """

    def __init__(self, root: str | os.PathLike | ImageFolder, size: int = 64, *, seed: int = 0,
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True):
        _simplejpeg()
        if size < 1:
            raise ValueError(f"size must be a positive number of pixels, got {size!r}")
        self.folder = root if isinstance(root, ImageFolder) else ImageFolder.scan(root)
        self.size = int(size)
        self.seed = int(seed)
        self.scale = scale
        self.ratio = ratio
        self.flip = flip

    def __len__(self) -> int:
        return len(self.folder)

    @property
    def labels(self) -> np.ndarray:
        return self.folder.labels

    def load_into(self, index: int, row: np.ndarray, rng: np.random.Generator) -> None:
        """Decode sample ``index``, crop, resize and maybe flip it into ``row`` (size x size x 3)."""
        path = self.folder.files[index]
        image, box = self._decode(path, rng)
        _resize_into(image, box, row, self.flip and rng.random() < 0.5)

    def _decode(self, path: str, rng: np.random.Generator
                ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """The image at reduced scale, in the scratch buffer, and the crop in its coordinates."""
        simplejpeg = _simplejpeg()
        data = Path(path).read_bytes()
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            left, top, crop_w, crop_h = random_resized_crop(rng, width, height,
                                                            self.scale, self.ratio)
            k = _reduction(crop_w, crop_h, self.size)
            min_h, min_w = -(-height // k), -(-width // k)
            out_h, out_w, _, _ = simplejpeg.decode_jpeg_header(
                data, min_height=min_h, min_width=min_w)
            image = simplejpeg.decode_jpeg(data, min_height=min_h, min_width=min_w,
                                           buffer=_scratch_buffer(out_h * out_w * 3))
        except ValueError as exc:
            raise ImageDecodeError(f"cannot decode {path} as a JPEG image: {exc}") from exc
        fy, fx = image.shape[0] / height, image.shape[1] / width
        return image, (left * fx, top * fy, crop_w * fx, crop_h * fy)


class ImageArrayWorker(_RowWorker):
    """An in-place shmseq worker over a store of decoded images: a random ``size`` x ``size``
    crop of each, flipped with probability 1/2 (``flip``), copied straight into its row.

    ``root`` holds ``images.npy`` (uint8, N x H x W x 3, H and W at least ``size``) and
    ``labels.npy`` (N integers); both are memory-mapped in each worker when first used, so
    the store is read through the page cache that every process shares, never pickled.
    Augmentation is seeded by ``seed`` and the batch's indices, as ``ImageFolderWorker``'s.
    """

    def __init__(self, root: str | os.PathLike, size: int = 224, *, seed: int = 0,
                 flip: bool = True):
        self.root = Path(root)
        self.size = int(size)
        self.seed = int(seed)
        self.flip = flip
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        images, _ = self._opened()
        if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
            raise ValueError(f"{self.root / 'images.npy'} holds {images.dtype} {images.shape}: "
                             "expected uint8 images, N x H x W x 3")
        if min(images.shape[1:3]) < self.size:
            raise ValueError(f"size={size} is larger than the stored images "
                             f"({images.shape[1]} x {images.shape[2]}): crop a smaller size")

    def _opened(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = (np.load(self.root / "images.npy", mmap_mode="r"),
                            np.load(self.root / "labels.npy", mmap_mode="r"))
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}  # each process maps the store itself

    def __len__(self) -> int:
        return len(self._opened()[1])

    @property
    def labels(self) -> np.ndarray:
        return self._opened()[1]

    def load_into(self, index: int, row: np.ndarray, rng: np.random.Generator) -> None:
        """A random crop of image ``index``, maybe flipped, copied into ``row``."""
        image = self._opened()[0][index]
        top = int(rng.integers(0, image.shape[0] - self.size + 1))
        left = int(rng.integers(0, image.shape[1] - self.size + 1))
        crop = image[top:top + self.size, left:left + self.size]
        row[...] = crop[:, ::-1] if self.flip and rng.random() < 0.5 else crop
