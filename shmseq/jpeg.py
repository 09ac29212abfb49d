"""The decode stage's image operations, apart from its batches and devices (``shmseq.decode``).

* ``nvjpeg_decoder`` and ``decoded_rows``: torchcodec's batched ``decode_jpeg`` on a CUDA
  device, one call a batch, the images that fail it found and named one by one;
* ``exif_orientation`` and ``as_stored``: the EXIF turn torchcodec applies, read from the JPEG's
  bytes and undone, so that both decoders crop the pixels as the JPEG stores them;
* ``crop_resized`` and ``transform``: the crop to a box, the antialiased bilinear resize and
  the flip that both decoders share.

Functions of bytes and tensors only: what a ``DecodeStage`` draws and holds stays in
``shmseq.decode``.
"""
from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Callable

import numpy as np

from .engine import Ragged

if TYPE_CHECKING:
    import torch

# decode(encoded, device): 1-D uint8 CPU tensors of JPEGs to (3, H, W) uint8 RGB images on
# device, as torchcodec's decode_jpeg(list, device=...) does; a RuntimeError if any one fails
JpegsDecode = Callable[[list, object], list]


def nvjpeg_decoder() -> JpegsDecode:
    """torchcodec's ``decode_jpeg`` in RGB: a batch in one nvJPEG call on a CUDA device."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError) as exc:  # OSError: a build of torchcodec for another torch
        why = f"{exc}: {exc.__cause__}" if exc.__cause__ else str(exc)
        raise ImportError(
            "DecodeStage(device='cuda') decodes with torchcodec's decode_jpeg, which failed to "
            f"import ({why}): install the torchcodec built for your torch, from the same index "
            "(PyPI's is a CUDA 13 build), or pass device='cpu'") from exc
    return lambda encoded, device: decode_jpeg(encoded, mode="RGB", device=device)


def decoded_rows(decode: JpegsDecode, encoded: Ragged, failed: list[str | None],
                 device: torch.device) -> list[torch.Tensor | None]:
    """Each image whose header passed (``failed`` None), all in one ``decode`` call; when that
    fails, one by one, to name the ones that fail (in ``failed``). None for every other row."""
    import torch
    rows = [row for row, why in enumerate(failed) if why is None]
    items = [torch.from_numpy(encoded[row]) for row in rows]
    try:
        images = decode(items, device) if items else []
    except RuntimeError:
        images = [_decoded_alone(decode, item, row, failed, device) for row, item in zip(rows, items)]
    decoded: list[torch.Tensor | None] = [None] * len(failed)
    for row, image in zip(rows, images):
        decoded[row] = image
    return decoded


def _decoded_alone(decode: JpegsDecode, item: torch.Tensor, row: int, failed: list[str | None],
                   device: torch.device) -> torch.Tensor | None:
    try:
        return decode([item], device)[0]
    except RuntimeError as exc:
        failed[row] = failure_reason(exc)
        return None


_CHECK_PLACE = re.compile(r"^\w+, \S+:\d+, ")  # "function, file.cpp:line, " of a C++ check


def failure_reason(exc: Exception) -> str:
    """A decoder's error as a message's reason: its first line, without the C++ source place
    torch's checks begin with."""
    lines = str(exc).splitlines()
    return (_CHECK_PLACE.sub("", lines[0]) if lines else "") or type(exc).__name__


_SOS, _EOI, _APP1 = 0xDA, 0xD9, 0xE1
_ORIENTATION_TAG = 0x0112


def exif_orientation(data: np.ndarray) -> int:
    """The EXIF orientation (1 to 8) of a JPEG's first Exif segment before its scan, read as
    torchcodec's CUDA decoder reads it (DecodeJpegCuda.cpp); 1 where there is none."""
    view = memoryview(data)  # type: ignore[arg-type]  # numpy declares the buffer protocol from 3.12
    if view[:2] != b"\xff\xd8":
        return 1
    place = 2
    while place + 4 <= len(view) and view[place] == 0xFF and view[place + 1] not in (_SOS, _EOI):
        length = int.from_bytes(view[place + 2:place + 4], "big")
        if length < 2 or place + 2 + length > len(view):
            break
        if view[place + 1] == _APP1 and length >= 8 and view[place + 4:place + 10] == b"Exif\0\0":
            return _tiff_orientation(view[place + 10:place + 2 + length])
        place += 2 + length
    return 1


def _tiff_orientation(tiff: memoryview) -> int:
    """The orientation tag of an Exif segment's first IFD; 1 where it has none, or a bad one."""
    order = "<" if tiff[:2] == b"II" else ">"
    try:
        mark, first = struct.unpack_from(order + "HI", tiff, 2)
        if mark != 0x2A:
            return 1
        (entries,) = struct.unpack_from(order + "H", tiff, first)
        for entry in range(first + 2, first + 2 + 12 * entries, 12):
            tag, _, _, value = struct.unpack_from(order + "HHIH", tiff, entry)
            if tag == _ORIENTATION_TAG:
                return value if 1 <= value <= 8 else 1
    except struct.error:  # past the segment's end
        pass
    return 1


def as_stored(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` as its JPEG stores it: torchcodec turns every image by its EXIF orientation
    (Exif.h, ``exif_orientation_transform``: a transpose for 5 to 8, then flips), which simplejpeg,
    so the CPU path, and every decoder of ``shmseq.vision`` ignore; undone here, so that both
    paths crop the same pixels."""
    flips = {2: (-1,), 3: (-2, -1), 4: (-2,), 6: (-1,), 7: (-2, -1), 8: (-2,)}.get(orientation)
    if flips:
        image = image.flip(flips)
    return image.transpose(-1, -2) if orientation >= 5 else image


def transform(decoded: list[torch.Tensor | None], boxes: np.ndarray, images: torch.Tensor,
              size: int) -> None:
    """Each decoded ``(3, H, W)`` ``uint8`` image cropped to its box, resized bilinearly (with
    antialiasing) to ``size``, maybe flipped, into its row of ``images`` (any device); rows
    of images that did not decode (None) are left as they are."""
    for image, box, row in zip(decoded, boxes.tolist(), images):
        if image is not None:
            row.copy_(crop_resized(image, box, size, float_crop=True))


def crop_resized(image: torch.Tensor, box: list, size: int,
                 float_crop: bool = False) -> torch.Tensor:
    """``image`` (3, H, W) cropped to ``box`` (``top, left, height, width, flip``), resized
    bilinearly with antialiasing to ``size`` x ``size``, maybe flipped; in the image's dtype,
    or (``float_crop``: only the crop converted) in float32."""
    import torch.nn.functional as functional
    top, left, height, width, flipped = box
    crop = image[None, :, top:top + height, left:left + width]
    crop = crop.float() if float_crop else crop
    resized = functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True,
                                     align_corners=False)[0]
    return resized.flip(-1) if flipped else resized
