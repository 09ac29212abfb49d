"""Where a shard cache lives and what else lives beside it: the job's name, the folder named by
the job and the data, this user's other caches (their budgets, whether they are in use) and
the removal of those nobody uses any more.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np

from .files import open_private_file, user_folder_name
from .locks import is_held

if TYPE_CHECKING:
    from .index import ShardIndex


JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
DRAWN_JOB = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
ABANDONED_AFTER_S = 600     # a drawn job's cache with no live rank, its ledger untouched this long
FINISHED_AFTER_S = 24 * 3600  # any other job's: kept a day for a resume, then removed


def job_name(job: str | None = None) -> str:
    """The job a cache belongs to: ``job``, else the launcher's id of the run, else "default"."""
    if job is not None:
        if not isinstance(job, str):
            raise TypeError(f"job must be a string naming the job, got {job!r} "
                            f"({type(job).__name__})")
        if not job.strip():
            raise ValueError(f"job must be a non-empty string naming the job, got {job!r}")
        return job
    for variable in JOB_VARIABLES:
        value = os.environ.get(variable, "")
        if value and value != "none":  # torchrun's run id when none was given
            return value
    return "default"


def remove_abandoned(root: str, keep: str | None = None) -> list[str]:
    """Remove the caches in this user's folder ``root`` that nobody uses (no live rank, no
    live sequence) and whose ledger nobody changed for ``ABANDONED_AFTER_S`` (a job named by a
    drawn id, which no launch finds again) or ``FINISHED_AFTER_S`` (any other: time enough for
    a resume); never ``keep``. The folders removed. Only real folders are looked into: a link
    or a file in ``root`` is left alone."""
    removed = []
    for job in folders_in(root):
        for folder in folders_in(job.path):
            if folder.path != keep and _abandoned(folder.path, DRAWN_JOB.fullmatch(job.name)):
                shutil.rmtree(folder.path, ignore_errors=True)
                removed.append(folder.path)
        with contextlib.suppress(OSError):
            os.rmdir(job.path)  # if nothing is left in it
    return removed


def folders_in(path: str) -> list[os.DirEntry]:
    """The folders in ``path``, links not followed (none where ``path`` is gone)."""
    try:
        with os.scandir(path) as entries:
            return [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _abandoned(folder: str, drawn: object) -> bool:
    """Unused, and its ledger older than a drawn job's or another job's age limit: a job
    starting, not on the board yet, has just touched it (``prepare``)."""
    try:
        changed = os.lstat(os.path.join(folder, "ledger")).st_mtime
    except FileNotFoundError:
        return False
    age = ABANDONED_AFTER_S if drawn else FINISHED_AFTER_S
    return time.time() - changed > age and not in_use(folder)


def in_use(folder: str) -> bool:
    """A live sequence holds the cache (its budget file), or a live rank its progress file."""
    ranks = os.path.join(folder, "ranks")
    try:
        names = [os.path.join(ranks, name) for name in os.listdir(ranks)]
    except FileNotFoundError:
        names = []
    paths = [os.path.join(folder, "budget"), *names]
    return any(os.path.lexists(path) and is_held(path, shared=True) for path in paths)


def bytes_in(folder: str) -> int:
    """What a cache's shards take on disk."""
    try:
        with os.scandir(os.path.join(folder, "shards")) as entries:
            return sum(entry.stat(follow_symlinks=False).st_size for entry in entries)
    except FileNotFoundError:
        return 0


def free_bytes(folder: str) -> int:
    """What the file system of ``folder`` has free for this user."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def default_cache_dir() -> str:
    """``$TMPDIR`` (a scheduler's node-local scratch) or else /var/tmp (on disk, where /tmp may
    be memory): the caches go into this user's folder in it (``shmseq.shards.files``)."""
    return os.environ.get("TMPDIR") or "/var/tmp"


def user_root(cache_dir: str | os.PathLike | None = None) -> str:
    """This user's folder of caches under ``cache_dir`` (the path only: ``prepare`` makes it)."""
    return os.path.join(os.path.abspath(os.fspath(cache_dir or default_cache_dir())),
                        user_folder_name())


def cache_folder(index: ShardIndex, cache_dir: str | os.PathLike | None = None,
                 job: str | None = None, storage_options: dict | None = None) -> str:
    """The folder of ``index``'s cache for ``job``: one per job and per data set, the data set
    named by what its bytes are (each shard's URL, size and checksum) and where they come from
    (an ``endpoint_url`` in ``storage_options``): another data set at the same URLs, or the
    same keys behind another endpoint, gets a cache of its own."""
    described = [_endpoint(storage_options)] + [
        f"{shard.url} {shard.end} {shard.size} {shard.sha256}" for shard in index.shards]
    digest = hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job_name(job))
    if name in (".", ".."):
        raise ValueError(f"the job name {job_name(job)!r} (from job=, SLURM_JOB_ID or "
                         "TORCHELASTIC_RUN_ID) would name a folder outside the cache's: pass "
                         "job= with a name of letters, digits, '.', '_' or '-'")
    return os.path.join(user_root(cache_dir), name, digest)  # neither can leave its folder


def _endpoint(storage_options: dict | None) -> str:
    """The endpoint the shards' URLs are resolved against, where the options name one."""
    options = storage_options or {}
    client = options.get("client_kwargs") or {}
    return f"endpoint {options.get('endpoint_url') or client.get('endpoint_url') or ''}"


def caches_in_use(root: str, besides: str) -> list[tuple[str, int, int]]:
    """(folder, budget, bytes held) of this user's caches in use under ``root``, but ``besides``:
    what each was promised is what a new cache's budget must leave them."""
    found = []
    for job in folders_in(root):
        for folder in folders_in(job.path):
            if folder.path == besides or not in_use(folder.path):
                continue
            with contextlib.suppress(OSError, ValueError), \
                    open_private_file(os.path.join(folder.path, "budget")) as file:
                budget = int(np.frombuffer(file.read(8), np.int64)[0])
                found.append((folder.path, budget, bytes_in(folder.path)))
    return found


def holders(root: str) -> str:
    """What this user's caches under ``root`` hold, the largest first, for messages."""
    held = []
    for job in folders_in(root):
        for folder in folders_in(job.path):
            age = time.time() - os.lstat(folder.path).st_mtime
            state = "in use" if in_use(folder.path) else f"unused for {age / 3600:.1f} h"
            held.append((bytes_in(folder.path), f"{folder.path}: {bytes_in(folder.path):,} bytes, "
                                                 f"{state}"))
    return "; ".join(text for _, text in sorted(held, reverse=True)) or "none"
