"""The shard cache's files, on a disk that other users can reach (/var/tmp, ``$TMPDIR``,
/dev/shm): nothing there is trusted until checked.

Threat model: processes of the same user are trusted (they could change the training code
anyway); other users are not. So the cache lives in a folder of the user's own,
``<cache_dir>/shmseq-cache-<uid>``, made 0700, and every folder under it 0700 and every file
0600; a folder or file is refused (``UnsafeCacheError``) when it is a symbolic link, is owned by
another user, or is writable by others; files are opened with ``O_NOFOLLOW``, so a link planted
where a file is expected is never followed (names from the outside, a job's, are kept inside
their folder by ``shmseq.shards.place``). ``cache_dir`` itself may be shared (/tmp, /dev/shm):
it must belong to this user or to root, and if others may write to it, carry the sticky bit
(so that nobody else can rename or remove what is ours in it). What is in a file is checked
by its reader: a shard against its index's checksum (``shmseq.shards.cache``)."""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import IO, BinaryIO, cast

USER_FOLDER = "shmseq-cache-{uid}"
FOLDER_MODE, FILE_MODE = 0o700, 0o600
DIGEST_CHUNK_BYTES = 8 << 20  # what a checksum reads at a time
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeCacheError(PermissionError):
    """A folder or file of the shard cache that another user could have put there or changed:
    the message names it, says what is wrong and what to do."""


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path: str, problem: str) -> UnsafeCacheError:
    return UnsafeCacheError(
        f"{path}: {problem}: the shard cache refuses it, since another user could have put or "
        "changed what is in it. Remove it (if it is yours to remove), or pass another cache_dir")


def check_shared(path: str) -> None:
    """``cache_dir``, which other users may share: this user's or root's, and sticky if others
    may write to it; made (0700) if missing. A symbolic link to it (a scratch folder, say) is
    followed: the user named it."""
    os.makedirs(path, FOLDER_MODE, exist_ok=True)
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "cache_dir is not a folder: pass a folder", path)
    if info.st_uid not in (os.getuid(), 0):
        raise _refuse(path, f"cache_dir belongs to {_owner(info.st_uid)}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"cache_dir is writable by others (mode {stat.S_IMODE(info.st_mode):o}) "
                            "without the sticky bit, so they could replace this user's folder in it")


def user_folder_name() -> str:
    """The name of this user's folder in a ``cache_dir``."""
    return USER_FOLDER.format(uid=os.getuid())


def user_folder(cache_dir: str) -> str:
    """This user's folder under ``cache_dir``, made if missing, checked (``private_folder``)."""
    check_shared(cache_dir)
    return private_folder(os.path.join(cache_dir, user_folder_name()))


def private_folder(path: str) -> str:
    """``path``, a folder made 0700 if missing; refused if it is a link, another user's, or
    writable by others (a folder made before this user's by someone else, say)."""
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        pass
    check_folder(path)
    return path


def check_folder(path: str) -> None:
    """Refuse ``path`` unless it is a folder of this user's that nobody else may write to."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, "a symbolic link stands where the cache expects its own folder")
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, "a file that is not a folder stands where the cache expects its own folder")
    _check_owned(path, info)


def _check_owned(path: str, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise _refuse(path, f"it belongs to {_owner(info.st_uid)}, not to this user "
                            f"({_owner(os.getuid())})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, f"others may write to it (mode {stat.S_IMODE(info.st_mode):o})")


def open_private(path: str, flags: int) -> int:
    """A descriptor of the regular file ``path`` (made 0600 with ``os.O_CREAT`` in ``flags``),
    opened without following a link, refused if it is another user's or writable by others."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link stands where the cache expects its own file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, "it is not a regular file")
        _check_owned(path, info)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(path: str, mode: str = "rb") -> BinaryIO:
    """``open_private`` as a Python file object: ``"rb"``, or ``"r+b"`` to change it in place."""
    flags = os.O_RDWR if "+" in mode else os.O_RDONLY
    return cast(BinaryIO, os.fdopen(open_private(path, flags), mode))


def file_digest(file: IO[bytes]) -> tuple[int, str]:
    """(size, SHA-256 in hex) of a whole file, read from its start in chunks."""
    file.seek(0)
    digest, size = hashlib.sha256(), 0
    while chunk := file.read(DIGEST_CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()
