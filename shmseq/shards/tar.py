"""The tar format of a shard, member by member: WebDataset's names (a sample's members share
a key), and one sample's members parsed in place from its bytes (ustar headers; pax and GNU
ones through ``tarfile``), for readers that start at a sample's offset.
"""
from __future__ import annotations

import io
import posixpath
import tarfile



BLOCK = 512


class ShardError(ValueError):
    """A shard that cannot be read as its index says (missing, truncated, corrupt), or a sample
    in it that does not decode: the message names the shard's URL, the sample and its offset."""


def key_and_field(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name: the key up to the first dot of the base name."""
    folder, base = posixpath.split(name)
    stem, dot, field = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, field if dot else ""


def parse_members(data: memoryview, url: str, at: int) -> dict:
    """The members of one sample's bytes (ustar headers, parsed in place; pax and GNU headers
    through tarfile): field -> bytes, plus ``__key__``."""
    sample: dict = {}
    position = 0
    while position < len(data):
        header = bytes(data[position:position + BLOCK])
        if len(header) < BLOCK or header[156:157] in (b"x", b"g", b"L", b"K"):
            return _parse_with_tarfile(data, url, at)
        try:
            name, size, regular = _ustar_header(header)
        except ValueError as exc:
            sample_key = f"sample {sample['__key__']}" if sample else "the sample"
            raise ShardError(f"shard {url}: {sample_key} at byte {at}: no valid tar header at byte "
                             f"{at + position} ({exc}): the shard is corrupt, or its index is "
                             "stale") from exc
        begin = position + BLOCK
        if begin + size > len(data):
            raise ShardError(f"shard {url}: member {name} at byte {at + position} runs past "
                             "its sample's end: the shard is truncated, or its index is stale")
        if regular:
            _add_member(sample, name, data[begin:begin + size], url, at + position)
        position = begin + -(-size // BLOCK) * BLOCK
    return sample


def _ustar_header(header: bytes) -> tuple[str, int, bool]:
    """(name, size, is a regular file) of a ustar header, read as tarfile reads it (checksum
    included) at a tenth of the cost of ``TarInfo.frombuf``, which decodes every field."""
    if not any(header):
        raise ValueError("an empty block, as at the archive's end")
    stored = int(header[148:156].rstrip(b"\0 ") or b"-1", 8)
    if stored != sum(header) - sum(header[148:156]) + 8 * 32:
        raise ValueError("bad checksum")
    if header[124] & 0x80:
        raise ValueError("a base-256 size: only pax sizes are read")
    size = int(header[124:136].strip(b"\0 ") or b"0", 8)
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar" and header[345] != 0:
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, header[156:157] in (b"0", b"\0", b"7")


def _parse_with_tarfile(data: memoryview, url: str, at: int) -> dict:
    sample: dict = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    file = tar.extractfile(member)
                    assert file is not None  # a regular file's
                    _add_member(sample, member.name, file.read(), url, at + member.offset)
    except tarfile.TarError as exc:
        raise ShardError(f"shard {url}: the sample at byte {at} is not valid tar ({exc}): the "
                         "shard is corrupt, or its index is stale") from exc
    return sample


def _add_member(sample: dict, name: str, data: bytes | memoryview, url: str, at: int) -> None:
    key, field = key_and_field(name)
    if sample.setdefault("__key__", key) != key:
        raise ShardError(f"shard {url}: member {name} at byte {at} belongs to sample {key}, not "
                         f"{sample['__key__']}: the index does not match the shard; scan it again")
    sample[field] = bytes(data)
