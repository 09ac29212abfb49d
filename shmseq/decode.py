"""JPEG images decoded in the trainer's process, on its GPU, straight from the ring.

Decoding JPEGs costs far more CPU than moving them: about 390 images/s per CPU thread against
thousands per second for a GPU decoding in batches. So here the workers only read each
image's encoded bytes (``EncodedImageWorker`` for an image folder, ``encoded_sample`` for tar
shards) into the slot, as one ragged leaf, with the labels and the sample ids; a
``DecodeStage``, given to ``ShmSequence(..., device=stage)``, then turns each batch into the
dense, augmented input a CNN takes, in the trainer's process:

* with CUDA, torchcodec's batched ``decode_jpeg(list, device=...)`` (nvJPEG) reads the encoded
  bytes from the page-locked slot; random-resized-crop, flip and normalize follow as GPU
  operations on one of the stage's streams, which waits for the decode, and the slot is free
  again once an event recorded after the decode has completed (the ring's tracked copies);
* without CUDA, a pool of threads decodes with simplejpeg (which releases the GIL), crops
  and resizes with torch, and the slot is free again once every image of it is decoded.
  torchcodec's CPU decode gives the same pixels, no faster (``bench/cpu_jpeg_decoders.py``),
  and needs the torchcodec built for the installed torch.

Both paths read every image's JPEG header first, on the CPU (simplejpeg): an image whose
header claims more than ``max_pixels`` fails there, as one that does not decode, before a
decoder allocates what it claims. Both draw the same crop boxes for the same seed (from the
batch's sample ids and the image sizes) and resize bilinearly with antialiasing; the CPU path
rounds the resized image to ``uint8`` before normalizing, so pixels differ by at most one level
of 255 there, plus what two JPEG decoders' inverse DCTs differ by. Both crop an image as its JPEG
stores it, whatever its EXIF orientation says (torchcodec's turn is undone).

The operations on bytes and tensors that both decoders call (torchcodec's batched decode, the
EXIF turn undone, the crop and resize) are ``shmseq.jpeg``'s; their names stay importable here.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .checks import check_choice, check_int
from .engine import CudaDevice, GpuTimer, Ragged, cuda_available
from .vision import (IMAGENET_MEAN, IMAGENET_STD, JPEG_EXTENSIONS, MAX_PIXELS, ImageDecodeError,
                     ImageFolder, _simplejpeg, center_crop, check_pixels, random_resized_crop)
from .jpeg import (JpegsDecode, as_stored, crop_resized, decoded_rows, exif_orientation,
                   failure_reason, nvjpeg_decoder, transform)

if TYPE_CHECKING:
    import torch

    from .engine import Ring, Wrap

__all__ = ["DTYPES", "ON_ERROR", "CudaDecoder", "DecodeStage", "Decoding", "EncodedImageWorker",
           "HostDecoder", "JpegsDecode", "as_stored", "crop_resized", "decoded_rows",
           "encoded_sample", "exif_orientation", "failure_reason", "nvjpeg_decoder", "source_batch",
           "transform"]

DTYPES = ("float32", "float16", "bfloat16")
ON_ERROR = ("raise", "skip")
_DRAWS = 23  # uniforms an image may use: ten crop tries of two, the crop's place, the flip


class EncodedImageWorker:
    """A shmseq worker over an ImageFolder that reads each JPEG's bytes and decodes nothing.

    ``worker[indices]`` is ``(encoded, labels, indices)``: the files' bytes as one ragged
    ``uint8`` leaf (each written once into the slot), ``int64`` labels and the sample ids, as
    a ``DecodeStage`` takes them. ``name_of(index)`` is the file, for the stage's messages."""

    def __init__(self, root: str | os.PathLike | ImageFolder) -> None:
        self.folder = root if isinstance(root, ImageFolder) else ImageFolder.scan(root)
        others = [path for path in self.folder.files if not path.lower().endswith(JPEG_EXTENSIONS)]
        if others:
            raise ValueError(f"{len(others)} file(s) of {self.folder.root} are not JPEGs (such as "
                             f"{others[0]}): a DecodeStage decodes JPEG only; convert them, or "
                             "decode in the workers with shmseq.vision.ImageFolderWorker")

    def __len__(self) -> int:
        return len(self.folder)

    @property
    def labels(self) -> np.ndarray:
        return self.folder.labels

    def name_of(self, index: int) -> str:
        return self.folder.files[index]

    def __getitem__(self, indices: np.ndarray) -> tuple[Ragged, np.ndarray, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        encoded = [Path(self.folder.files[index]).read_bytes() for index in indices.tolist()]
        return Ragged.from_items(encoded), self.folder.labels[indices], indices


@dataclass(frozen=True)
class encoded_sample:
    """A ``ShardSequence`` decode function that decodes nothing: a sample becomes its
    ``field`` member's encoded bytes, its ``label`` member as an int and its global id, stacked
    per batch into what a ``DecodeStage`` takes."""

    field: str = "jpg"
    label: str = "cls"

    def __call__(self, sample: dict) -> tuple[bytes, int, int]:
        return sample[self.field], int(sample[self.label]), sample["__id__"]


class _Draws:
    """A row of uniforms in [0, 1), handed out as ``random_resized_crop`` asks for them."""

    def __init__(self, row: np.ndarray) -> None:
        self._row = iter(row.tolist())

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * next(self._row)

    def random(self) -> float:
        return next(self._row)


class DecodeStage:
    """Decodes batches of encoded JPEGs in the trainer, into float ``(N, 3, size, size)``.

    Give it to ``ShmSequence(worker, n, device=stage)`` with a worker that yields
    ``(encoded, labels, ids)`` (``EncodedImageWorker``, or a ``ShardSequence`` with
    ``encoded_sample()``); each batch then arrives as ``(images, labels)`` on ``device``.

    Args:
        size: the side of the output images.
        device: ``'cuda'``/``'cuda:N'`` (torchcodec's nvJPEG decoder) or ``'cpu'``
            (simplejpeg in a thread pool); None: CUDA where there is one.
        seed, augment, scale, ratio, flip: random-resized-crop (``scale`` of the area, ``ratio``
            of aspect), then a horizontal flip with probability 1/2, drawn from ``seed`` and the
            batch's sample ids (the same boxes on both devices); ``augment=False``: the central
            square of ``crop_fraction`` of the shorter side, never flipped.
        mean, std: ``(x / 255 - mean) / std`` per channel.
        dtype: ``'float32'``, ``'float16'`` or ``'bfloat16'``; channels_last: that memory format.
        on_error: ``'raise'`` an ``ImageDecodeError`` naming the image, or ``'skip'`` it (the
            batch is then smaller; a ``SkippedSamplesWarning``, counted in ``stats``).
        max_pixels: an image whose JPEG header claims more pixels fails as one that does not
            decode (``on_error``), its header read on the CPU before either decoder allocates
            anything: a few hundred bytes can claim gigabytes. Pillow's default limit.
        names: ``names(id)`` names a sample in messages (a worker's ``name_of``).
        threads: the CPU decoder's threads (None: one per core); streams: CUDA streams.
    """

    def __init__(self, size: int = 224, *, device: str | None = None, seed: int = 0,
                 augment: bool = True, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True,
                 crop_fraction: float = 0.875, mean: tuple[float, ...] = IMAGENET_MEAN,
                 std: tuple[float, ...] = IMAGENET_STD, dtype: str = "float32",
                 channels_last: bool = False, on_error: str = "raise",
                 max_pixels: int = MAX_PIXELS, names: Callable[[int], str] | None = None,
                 threads: int | None = None, streams: int = 1) -> None:
        check_choice("dtype", dtype, DTYPES)
        check_choice("on_error", on_error, ON_ERROR)
        check_int("max_pixels", max_pixels, 1)
        if int(size) < 1:
            raise ValueError(f"size must be a positive number of pixels, got {size!r}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std take one value per RGB channel, got {mean!r}, {std!r}")
        if threads is not None and int(threads) < 1:
            raise ValueError(f"threads must be at least 1 (or None: one per core), got {threads!r}")
        self.size = int(size)
        self.device = device or ("cuda" if cuda_available() else "cpu")
        if not self.device.startswith(("cuda", "cpu")):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        self.seed, self.augment, self.flip = int(seed), bool(augment), bool(flip)
        self.scale, self.ratio, self.crop_fraction = scale, ratio, float(crop_fraction)
        self.mean, self.std = tuple(mean), tuple(std)
        self.dtype, self.channels_last, self.on_error = dtype, bool(channels_last), on_error
        self.max_pixels = int(max_pixels)
        self.names = names
        self.threads = threads or os.cpu_count() or 1
        self.streams = int(streams)

    def __call__(self) -> CudaDecoder | HostDecoder:
        """A device for one run of a pipeline (``ShmSequence`` makes one at each start)."""
        return CudaDecoder(self) if self.device.startswith("cuda") else HostDecoder(self)

    def describe(self, sample_id: int) -> str:
        """A sample as messages name it: its file (``names``) and its id."""
        if self.names is None:
            return f"sample {sample_id}"
        return f"{self.names(sample_id)} (sample {sample_id})"

    def boxes(self, sizes: Sequence[tuple[int, int] | None], ids: np.ndarray) -> np.ndarray:
        """``(top, left, height, width, flip)`` per image of ``(height, width)`` (None: an image
        that did not decode, skipped without changing the others' draws)."""
        draws = np.random.default_rng([self.seed, *np.asarray(ids, np.int64).tolist()]).random(
            (len(sizes), _DRAWS))
        boxes = np.zeros((len(sizes), 5), np.int64)
        for row, size in enumerate(sizes):
            if size is not None:
                boxes[row] = self._box(*size, _Draws(draws[row]))
        return boxes

    def _box(self, height: int, width: int, draws: _Draws) -> tuple[int, ...]:
        if self.augment:
            left, top, crop_w, crop_h = random_resized_crop(draws, width, height, self.scale,
                                                            self.ratio)
        else:
            left, top, crop_w, crop_h = center_crop(width, height, self.crop_fraction)
        crop_w, crop_h = max(1, min(width, round(crop_w))), max(1, min(height, round(crop_h)))
        left, top = min(int(left), width - crop_w), min(int(top), height - crop_h)
        flipped = self.augment and self.flip and draws.random() < 0.5
        return top, left, crop_h, crop_w, int(flipped)

    def normalizer(self, torch_device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, shift)``: ``x * scale - shift`` is ``(x / 255 - mean) / std``."""
        import torch
        std = torch.tensor(self.std, dtype=torch.float32, device=torch_device).view(3, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=torch_device).view(3, 1, 1)
        return 1 / (255 * std), mean / std

    def empty_images(self, count: int, torch_device: str | torch.device) -> torch.Tensor:
        import torch
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty((count, 3, self.size, self.size), dtype=getattr(torch, self.dtype),
                           device=torch_device, memory_format=memory_format)


def source_batch(views: object) -> tuple[Ragged, np.ndarray, np.ndarray]:
    """A decode stage's input, checked: ``(encoded, labels, ids)``."""
    if not (isinstance(views, (tuple, list)) and len(views) == 3 and isinstance(views[0], Ragged)
            and views[0].values.dtype == np.uint8):
        raise TypeError(
            "a DecodeStage takes batches of (encoded JPEGs as a uint8 Ragged, labels, sample ids), "
            "as EncodedImageWorker and encoded_sample() build them; the worker returned "
            f"{type(views).__name__}: use one of those, or drop device=DecodeStage(...)")
    return views[0], np.asarray(views[1]), np.asarray(views[2], np.int64)


@dataclass
class Decoding:
    """A batch on its way: rows fill ``images`` as they decode; ``failed[i]`` says why row
    ``i`` could not be."""
    images: torch.Tensor
    labels: torch.Tensor
    ids: np.ndarray
    failed: list[str | None]


class _DecodingDevice:
    """What both decoders share: input views as numpy (``wrap``), the images' headers read
    first, and the end of a batch (a failed image raised or left out)."""

    wrap: Wrap | None = None  # the encoded bytes are read as numpy views of the slot

    def __init__(self, stage: DecodeStage) -> None:
        self.stage = stage
        self.simplejpeg = _simplejpeg()
        self._skipped: list[str] = []

    def headers(self, encoded: Ragged) -> tuple[list[tuple[int, int] | None], list[str | None]]:
        """``(height, width)`` of each image from its JPEG header, or None with the reason in
        the second list: a header that does not read, or claims more than ``max_pixels`` (then
        the image is never handed to a decoder, which would allocate what it claims)."""
        sizes: list[tuple[int, int] | None] = []
        failed: list[str | None] = []
        for data in encoded:
            try:
                height, width, _, _ = self.simplejpeg.decode_jpeg_header(data)
                check_pixels(width, height, self.stage.max_pixels)
                sizes.append((height, width))
                failed.append(None)
            except ValueError as exc:
                sizes.append(None)
                failed.append(str(exc) or type(exc).__name__)
        return sizes, failed

    def finished(self, batch: Decoding) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)``, or the first failure raised (``on_error='raise'``)."""
        failures = [(row, why) for row, why in enumerate(batch.failed) if why is not None]
        if not failures:
            return batch.images, batch.labels
        described = [f"cannot decode {self.stage.describe(int(batch.ids[row]))} as a JPEG: {why}"
                     for row, why in failures]
        if self.stage.on_error == "raise" or len(failures) == len(batch.failed):
            raise ImageDecodeError("; ".join(described) if self.stage.on_error == "skip"
                                   else described[0])
        self._skipped += described
        keep = [row for row, why in enumerate(batch.failed) if why is None]
        return batch.images[keep], batch.labels[keep]

    def pop_skipped(self) -> list[str]:
        """The images left out since the last call (the converter reports them with the batch)."""
        skipped, self._skipped = self._skipped, []
        return skipped


class HostDecoder(_DecodingDevice):
    """simplejpeg in a thread pool; the slot is read until every row of it is done."""

    def __init__(self, stage: DecodeStage) -> None:
        super().__init__(stage)
        import torch
        self.torch = torch
        self.scale, self.shift = stage.normalizer("cpu")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._job_seconds: deque[float] = deque()  # each job's wall time, from the pool's threads
        self._blocked_s = 0.0  # the consumer's wait for rows still decoding, at hand-over

    def attach(self, ring: Ring) -> None:
        """Nothing to page-lock: the slot is read in place by the pool."""

    def convert(self, views: object) -> tuple[Decoding, list[concurrent.futures.Future]]:
        encoded, labels, ids = source_batch(views)
        sizes, failed = self.headers(encoded)
        boxes = self.stage.boxes(sizes, ids)
        images = self.stage.empty_images(len(encoded), "cpu")
        batch = Decoding(images, self.torch.from_numpy(labels.astype(np.int64)), ids.copy(), failed)
        rows = [(encoded[row], boxes[row], row) for row in range(len(encoded)) if failed[row] is None]
        pool, parts = self._running_pool(), self.stage.threads
        jobs = [pool.submit(self._decode_rows, rows[part::parts], images, failed)
                for part in range(min(parts, len(rows)))]
        return batch, jobs

    def _running_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.stage.threads, "shmseq-decode")
        return self._pool

    def _decode_rows(self, rows: list, images: torch.Tensor, failed: list[str | None]) -> None:
        began = time.perf_counter()
        for data, box, row in rows:
            try:
                self._decode_row(data, box, images[row])
            except ValueError as exc:
                failed[row] = str(exc) or type(exc).__name__
        self._job_seconds.append(time.perf_counter() - began)

    def _decode_row(self, data: np.ndarray, box: np.ndarray, out: torch.Tensor) -> None:
        """Decoded, then resized as ``uint8`` (torch's fast CPU path), rounded, then normalized."""
        image = self.torch.from_numpy(self.simplejpeg.decode_jpeg(data, colorspace="RGB"))
        out.copy_(crop_resized(image.permute(2, 0, 1), box.tolist(), self.stage.size))
        out.mul_(self.scale).sub_(self.shift)

    def wait(self, jobs: list[concurrent.futures.Future]) -> None:
        concurrent.futures.wait(jobs)

    def pop_counts(self) -> dict[str, float]:
        """Since the last call: ``decode_s``, the pool's busy time per thread (a pool busy
        throughout adds the wall time); ``consumer_wait_s``, the consumer's wait at hand-over
        for rows still decoding, a wait for the loader as any (the consumer's thread only)."""
        seconds, jobs = 0.0, self._job_seconds
        while jobs:
            seconds += jobs.popleft()
        blocked, self._blocked_s = self._blocked_s, 0.0
        return {"decode_s": seconds / self.stage.threads, "consumer_wait_s": blocked}

    def hand_over(self, batch: Decoding,
                  jobs: list[concurrent.futures.Future]) -> tuple[torch.Tensor, torch.Tensor]:
        began = time.perf_counter()
        for job in jobs:
            job.result()  # a failure other than a bad image (memory, a bug) is raised here
        self._blocked_s += time.perf_counter() - began
        return self.finished(batch)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class CudaDecoder(_DecodingDevice):
    """torchcodec's batched nvJPEG decode from the page-locked slot, then the crops, on one of
    the stage's streams; the slot is free once an event after the decode completes."""

    def __init__(self, stage: DecodeStage) -> None:
        super().__init__(stage)
        self.decode_jpegs = nvjpeg_decoder()
        self.gpu = CudaDevice(stage.device, stage.streams)  # crops. streams, page lock, hand-over
        self.torch, self.device = self.gpu.torch, self.gpu.device
        self._decoding = self.torch.cuda.Stream(self.device)  # torchcodec's alone: owns its memory
        self.timer = GpuTimer(self.torch)  # the decoding stream's busy time: ``decode_s``
        self.scale, self.shift = stage.normalizer(self.device)

    def attach(self, ring: Ring) -> None:
        self.gpu.attach(ring)

    def convert(self, views: object) -> tuple[Decoding, tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The decode runs on a stream that runs nothing but torchcodec's calls. torchcodec
        allocates its output on the current stream, and nvJPEG's hardware engine writes it
        without waiting for that stream's queued work, so torchcodec (0.17 on) first synchronizes
        that stream: on the crops' stream, this thread would wait there for the previous batch's
        crops. The decoded images are marked as used by the crops' stream, so their blocks come
        back to the decoding stream once the crops that read them are done, not at once, when
        the next decode could write them under a queued crop (as torchvision's decoder did on any
        stream: pytorch/vision#9606). The EXIF turn is undone on the crops' stream, for the
        decoding stream to run torchcodec alone."""
        torch = self.torch
        encoded, labels, ids = source_batch(views)
        _, failed = self.headers(encoded)
        stream = self.gpu.next_stream()
        began = self.timer.mark(self._decoding)
        with torch.cuda.stream(self._decoding):
            decoded = decoded_rows(self.decode_jpegs, encoded, failed, self.device)
        self.timer.span(began, self.timer.mark(self._decoding))
        with torch.cuda.stream(stream):
            stream.wait_stream(self._decoding)
            for image in decoded:
                if image is not None:
                    image.record_stream(stream)
            labels = torch.from_numpy(labels.astype(np.int64)).to(self.device, non_blocking=True)
            read = torch.cuda.Event()
            read.record(stream)
            decoded = [None if image is None else as_stored(image, exif_orientation(data))
                       for image, data in zip(decoded, encoded)]
            sizes = [None if image is None else (image.shape[1], image.shape[2]) for image in decoded]
            images = self.stage.empty_images(len(decoded), self.device)
            transform(decoded, self.stage.boxes(sizes, ids), images, self.stage.size)
            images.mul_(self.scale).sub_(self.shift)
            done = torch.cuda.Event()
            done.record(stream)
        return Decoding(images, labels, ids.copy(), failed), (read, done)

    def wait(self, events: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        events[0].synchronize()

    def pop_counts(self) -> dict[str, float]:
        return {"decode_s": self.timer.pop_seconds()}

    def hand_over(self, batch: Decoding, events: tuple[torch.cuda.Event, torch.cuda.Event]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        self.gpu.hand_over((batch.images, batch.labels), events[1])
        return self.finished(batch)

    def close(self) -> None:
        self.gpu.close()
