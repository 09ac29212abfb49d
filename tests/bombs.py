"""Decompression bombs for the pixel-limit tests: tiny image files whose header claims far more
pixels than their bytes hold, and the peak memory a block of code took."""
from __future__ import annotations

import contextlib
import io
import struct
import zlib

import numpy as np


def jpeg_claiming(width: int, height: int) -> bytes:
    """An 8 x 8 baseline JPEG whose SOF0 header says ``width`` x ``height``."""
    import simplejpeg
    data = bytearray(simplejpeg.encode_jpeg(np.zeros((8, 8, 3), np.uint8), quality=50))
    at = data.index(b"\xff\xc0")  # SOF0: marker, length (2), precision (1), height, width
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png_claiming(width: int, height: int) -> bytes:
    """An 8 x 8 PNG whose IHDR chunk says ``width`` x ``height`` (its checksum made to match)."""
    from PIL import Image
    written = io.BytesIO()
    Image.new("RGB", (8, 8)).save(written, "PNG")
    data = bytearray(written.getvalue())
    fields = data[16:29]  # after the signature (8), the IHDR length (4) and type (4)
    fields[0:8] = struct.pack(">II", width, height)
    data[16:29] = fields
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(fields)))
    return bytes(data)


def _peak_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@contextlib.contextmanager
def peak_memory():
    """``grown[0]``: how far this process's peak resident memory rose above its resident
    memory at entry, in bytes (the kernel's high-water mark, reset at entry)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark starts again from the resident size
    start, grown = _peak_kib(), [0]
    try:
        yield grown
    finally:
        grown[0] = (_peak_kib() - start) << 10
