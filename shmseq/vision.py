"""Images from files (JPEG, PNG and the other formats Pillow reads), or from a pre-decoded
array store, each written once, straight into its row of the slot.

``ImageArrayWorker`` reads a store of decoded ``uint8`` images (``images.npy``, N x H x W x
3, memory-mapped, and ``labels.npy``), as FFCV-style and downsampled-ImageNet setups keep
them: a random crop, maybe flipped, copied straight into the slot row. The rest of this
module is the image-file path:

``ImageFolderWorker`` reads the ImageFolder layout (``root/<class>/**/<image>``, classes
sorted into label ids, as torchvision's ``ImageFolder``) and is an in-place worker: each image
is decoded, cropped at random (random-resized-crop), maybe flipped, and written once, into its
row of the slot's ``uint8`` N x H x W x 3 array (``augment=False``: the central crop, never
flipped, for evaluation). Labels arrive as ``int64``. ``normalize`` turns such a batch into
the float N x 3 x H x W input a CNN takes.

Per JPEG image: the JPEG header gives the size; the crop is drawn; the image is decoded
at the strongest reduction (1/2, 1/4 or 1/8, done inside the inverse DCT) that
keeps the crop at least the output size, into a per-thread scratch buffer reused
for every image; a nearest-neighbour index map then writes the crop, resized and
flipped, into the row. No full-size image is allocated per sample. Other formats (PNG, ...)
are decoded whole by Pillow, then go through the same crop, resize and flip.

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

import io
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .checks import check_int
from .engine import SlotAllocator, warn_user

if TYPE_CHECKING:
    import torch

JPEG_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif")
IMAGE_EXTENSIONS = JPEG_EXTENSIONS + (".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".avif",
                                      ".ppm", ".pgm", ".pbm", ".pnm", ".tga")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
REDUCTIONS = (8, 4, 2, 1)
MAX_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS: 256 MiB decoded as RGB
_JPEG_MAGIC = b"\xff\xd8\xff"
_scratch = threading.local()


class ImageDecodeError(ValueError):
    """A file that is not a readable image; the message names it."""


class SkippedFilesWarning(UserWarning):
    """Files in the class folders of an image folder that are not images, left out."""


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """Refuse an image whose header claims more than ``max_pixels`` pixels, before anything is
    allocated for it: a few hundred bytes can claim gigabytes (a decompression bomb)."""
    if width * height > max_pixels:
        raise ImageDecodeError(
            f"its header claims {width} x {height} pixels ({width * height:,}), more than "
            f"max_pixels={max_pixels:,}: a decompression bomb, or an image larger than expected; "
            "pass a larger max_pixels to read it")


def _simplejpeg() -> ModuleType:
    try:
        import simplejpeg
    except ImportError as exc:
        raise ImportError("shmseq.vision needs simplejpeg for JPEG files: "
                          "pip install 'shmseq[vision]'") from exc
    return simplejpeg


def _jpeg_decoder() -> ModuleType | None:
    """simplejpeg, or None where it is not installed (Pillow then decodes JPEGs too)."""
    try:
        return _simplejpeg()
    except ImportError:
        return None


def _pillow(why: str = "images other than JPEG") -> ModuleType:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(f"shmseq.vision needs Pillow for {why}: "
                          "pip install 'shmseq[vision]'") from exc
    return Image


def _files_under(folder: Path) -> list[str]:
    """Every file under ``folder``, in torchvision's order (folders sorted, then the names in
    each), symbolic links followed; hidden files and folders (``.DS_Store``,
    ``.ipynb_checkpoints``) left out."""
    walked = []
    for here, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        walked.append((here, sorted(name for name in names if not name.startswith("."))))
    return [os.path.join(here, name) for here, names in sorted(walked) for name in names]


@dataclass(frozen=True, eq=False)
class ImageFolder:
    """The images of ``root/<class>/**/<image>`` and their labels (classes sorted by name).

    As torchvision's ``ImageFolder``: each folder of ``root`` is a class, its images (in
    sub-folders too) are its samples, and files whose extension is not an image's
    (``IMAGE_EXTENSIONS``) are left out, but not silently: ``scan`` warns
    (``SkippedFilesWarning``) with their number and names, and ``skipped`` lists them.
    Hidden files and folders (names starting with ``.``) are ignored.
    """

    root: str
    classes: tuple[str, ...]
    files: tuple[str, ...]
    labels: np.ndarray
    skipped: tuple[str, ...] = ()

    @classmethod
    def scan(cls, root: str | os.PathLike) -> "ImageFolder":
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {root} does not exist")
        classes = tuple(sorted(entry.name for entry in os.scandir(root)
                               if entry.is_dir() and not entry.name.startswith(".")))
        files, labels, skipped = [], [], []
        for label, name in enumerate(classes):
            for path in _files_under(root / name):
                if path.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(path)
                    labels.append(label)
                else:
                    skipped.append(path)
        if not files:
            raise ValueError(f"no image files in the class folders of {root} (expected "
                             f"root/<class>/<image>, images being {' '.join(IMAGE_EXTENSIONS)})")
        if skipped:
            shown = [os.path.relpath(path, root) for path in skipped[:5]]
            more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            warn_user(f"{len(skipped)} file(s) in the class folders of {root} are not images and "
                      f"were left out: {', '.join(shown)}{more} (images are "
                      f"{' '.join(IMAGE_EXTENSIONS)}; the folder's .skipped lists them all)",
                      SkippedFilesWarning)
        return cls(str(root), classes, tuple(files), np.array(labels, np.int64), tuple(skipped))

    def __len__(self) -> int:
        return len(self.files)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Each class name's label, as torchvision's ``ImageFolder.class_to_idx``."""
        return {name: label for label, name in enumerate(self.classes)}


class Uniforms(Protocol):
    """What draws a crop: ``uniform(low, high)``, as a numpy ``Generator`` has it."""

    def uniform(self, low: float, high: float) -> float:
        """A number drawn uniformly from [low, high)."""


def random_resized_crop(rng: Uniforms, width: int, height: int,
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


def center_crop(width: int, height: int, fraction: float
                ) -> tuple[float, float, float, float]:
    """The central square ``(left, top, width, height)`` whose side is ``fraction`` of the
    shorter side: with 0.875, torchvision's ``Resize(256)`` then ``CenterCrop(224)``."""
    side = fraction * min(width, height)
    return (width - side) / 2, (height - side) / 2, side, side


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


def normalize(images: np.ndarray | torch.Tensor, mean: tuple[float, ...] = IMAGENET_MEAN,
              std: tuple[float, ...] = IMAGENET_STD, *, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A batch of ``uint8`` (N, H, W, C) images, as the image workers deliver it, as the float
    (N, C, H, W) input a CNN takes: ``(images / 255 - mean) / std``, channel by channel.

    ``images``: a torch tensor (CPU, pinned or CUDA) or a numpy array. It is moved to
    ``device`` first, as ``uint8`` (a quarter of the bytes of float32) and with
    ``non_blocking=True``, then converted there into a new tensor (``dtype``, by default
    ``torch.float32``): nothing returned is a view of the slot, so the slot goes back to the
    ring once you drop ``images``. The result has the shape (N, C, H, W) and channels-last
    strides, which convolutions take as they are; ``.contiguous()`` makes it NCHW in memory.
    ImageNet's mean and standard deviation by default; ``mean=(0.5,) * 3, std=(0.5,) * 3``
    gives [-1, 1], ``mean=(0,) * 3, std=(1,) * 3`` gives [0, 1].
    """
    import torch

    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[3] != len(mean):
        raise ValueError(f"normalize takes uint8 images (N, H, W, {len(mean)}), got "
                         f"{images.dtype} {tuple(images.shape)}")
    if len(std) != len(mean):
        raise ValueError(f"mean and std differ in length: {len(mean)} and {len(std)}")
    dtype = torch.float32 if dtype is None else dtype
    if device is not None:
        images = images.to(device, non_blocking=True)
    inputs = images.permute(0, 3, 1, 2).to(dtype)   # a new tensor: uint8 never aliases a float
    shape = (1, len(mean), 1, 1)
    shift = torch.tensor(mean, dtype=dtype, device=inputs.device).mul_(255).view(shape)
    scale = torch.tensor(std, dtype=dtype, device=inputs.device).mul_(255).view(shape)
    return inputs.sub_(shift).div_(scale)


class _RowWorker:
    """What both image workers share: a batch is ``size`` x ``size`` rows, each loaded
    straight into the slot by ``load_into``, with randomness drawn from the batch's indices."""

    size: int
    seed: int

    @property
    def labels(self) -> np.ndarray:
        """Each sample's label."""
        raise NotImplementedError

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
    ``(images, labels)``: ``uint8`` (N, size, size, 3) and ``int64`` (N,). ``classes`` holds
    the class names (a label is an index into it), ``class_to_idx`` the reverse.

    JPEG files are decoded by simplejpeg, at reduced scale, into a reused buffer; other images
    (PNG, BMP, GIF, TIFF, WebP, ... : ``IMAGE_EXTENSIONS``) by Pillow, converted to RGB as
    torchvision's loader does; then both go through the same crop, resize and flip. A file's
    content decides, not its name: a PNG named ``.jpg`` is read too. Files that are not images
    are left out with a ``SkippedFilesWarning`` (see ``ImageFolder``).

    Augmentation (``augment=True``, for training) is random-resized-crop (``scale`` of the
    area, ``ratio`` of aspect) then a horizontal flip with probability 1/2 (``flip``). Its
    randomness comes from a generator seeded by ``seed`` and the batch's sample indices, so a
    batch is augmented the same way whichever worker builds it, in any run with that seed;
    epochs differ because shuffling gives them different batches (with ``shuffle=False`` every
    epoch repeats the same crops). ``augment=False``, for validation and test sets, is
    deterministic: the central square whose side is ``crop_fraction`` of the shorter side
    (0.875: torchvision's ``Resize(256)`` + ``CenterCrop(224)``), resized, never flipped.

    An image whose header claims more than ``max_pixels`` pixels (default ``MAX_PIXELS``,
    Pillow's own default limit) is an ``ImageDecodeError`` naming the file and that size,
    raised before anything is allocated for it; Pillow's limit, twice its
    ``Image.MAX_IMAGE_PIXELS``, applies to the files it opens as well.
    """

    def __init__(self, root: str | os.PathLike | ImageFolder, size: int = 64, *, seed: int = 0,
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True,
                 augment: bool = True, crop_fraction: float = 0.875,
                 max_pixels: int = MAX_PIXELS) -> None:
        if size < 1:
            raise ValueError(f"size must be a positive number of pixels, got {size!r}")
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}")
        check_int("max_pixels", max_pixels, 1)
        self.folder = root if isinstance(root, ImageFolder) else ImageFolder.scan(root)
        self.size = int(size)
        self.seed = int(seed)
        self.scale = scale
        self.ratio = ratio
        self.flip = flip
        self.augment = bool(augment)
        self.crop_fraction = float(crop_fraction)
        self.max_pixels = int(max_pixels)
        others = [path for path in self.folder.files if not path.lower().endswith(JPEG_EXTENSIONS)]
        if len(others) < len(self.folder.files):
            _simplejpeg()
        if others:
            _pillow(f"images other than JPEG ({len(others)} here, such as {others[0]})")

    def __len__(self) -> int:
        return len(self.folder)

    @property
    def labels(self) -> np.ndarray:
        return self.folder.labels

    @property
    def classes(self) -> tuple[str, ...]:
        """The class names, sorted: label ``k`` is ``classes[k]``."""
        return self.folder.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.folder.class_to_idx

    def load_into(self, index: int, row: np.ndarray, rng: np.random.Generator) -> None:
        """Decode sample ``index``, crop, resize and maybe flip it into ``row`` (size x size x 3)."""
        path = self.folder.files[index]
        data = Path(path).read_bytes()
        try:
            simplejpeg = _jpeg_decoder() if data.startswith(_JPEG_MAGIC) else None
            if simplejpeg is not None:
                image, box = self._decode_jpeg(simplejpeg, data, rng)
            else:
                image, box = self._decode_other(data, rng)
        except (ValueError, OSError, SyntaxError, EOFError) as exc:
            raise ImageDecodeError(f"cannot decode {path} as an image: {exc}") from exc
        _resize_into(image, box, row, self.augment and self.flip and rng.random() < 0.5)

    def _crop(self, rng: np.random.Generator, width: int, height: int
              ) -> tuple[float, float, float, float]:
        if self.augment:
            return random_resized_crop(rng, width, height, self.scale, self.ratio)
        return center_crop(width, height, self.crop_fraction)

    def _decode_jpeg(self, simplejpeg: ModuleType, data: bytes, rng: np.random.Generator
                     ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """The image at reduced scale, in the scratch buffer, and the crop in its coordinates."""
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        check_pixels(width, height, self.max_pixels)
        left, top, crop_w, crop_h = self._crop(rng, width, height)
        k = _reduction(crop_w, crop_h, self.size)
        min_h, min_w = -(-height // k), -(-width // k)
        out_h, out_w, _, _ = simplejpeg.decode_jpeg_header(data, min_height=min_h, min_width=min_w)
        image = simplejpeg.decode_jpeg(data, min_height=min_h, min_width=min_w,
                                       buffer=_scratch_buffer(out_h * out_w * 3))
        fy, fx = image.shape[0] / height, image.shape[1] / width
        return image, (left * fx, top * fy, crop_w * fx, crop_h * fy)

    def _decode_other(self, data: bytes, rng: np.random.Generator
                      ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """The whole image, decoded by Pillow as RGB, and the crop."""
        image_module = _pillow()
        try:
            opened = image_module.open(io.BytesIO(data))  # reads the header only
        except image_module.DecompressionBombError as exc:
            raise ImageDecodeError(f"Pillow refused it: {exc} (its limit is twice "
                                   "PIL.Image.MAX_IMAGE_PIXELS: raise that to read it)") from exc
        with opened:
            width, height = opened.size
            check_pixels(width, height, self.max_pixels)
            box = self._crop(rng, width, height)
            image = np.asarray(opened.convert("RGB"))
        return image, box


class ImageArrayWorker(_RowWorker):
    """An in-place shmseq worker over a store of decoded images: a random ``size`` x ``size``
    crop of each, flipped with probability 1/2 (``flip``), copied straight into its row;
    with ``augment=False`` (evaluation), the central crop, never flipped.

    ``root`` holds ``images.npy`` (uint8, N x H x W x 3, H and W at least ``size``) and
    ``labels.npy`` (N integers); both are memory-mapped in each worker when first used, so
    the store is read through the page cache that every process shares, never pickled.
    Augmentation is seeded by ``seed`` and the batch's indices, as ``ImageFolderWorker``'s.
    """

    def __init__(self, root: str | os.PathLike, size: int = 224, *, seed: int = 0,
                 flip: bool = True, augment: bool = True) -> None:
        self.root = Path(root)
        self.size = int(size)
        self.seed = int(seed)
        self.flip = flip
        self.augment = bool(augment)
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
        """A crop of image ``index`` (random, or central), maybe flipped, copied into ``row``."""
        image = self._opened()[0][index]
        if self.augment:
            top = int(rng.integers(0, image.shape[0] - self.size + 1))
            left = int(rng.integers(0, image.shape[1] - self.size + 1))
        else:
            top, left = (image.shape[0] - self.size) // 2, (image.shape[1] - self.size) // 2
        crop = image[top:top + self.size, left:left + self.size]
        row[...] = crop[:, ::-1] if self.augment and self.flip and rng.random() < 0.5 else crop
