"""Remote objects through fsspec: byte ranges and whole objects, each request under a timeout,
transient failures retried with back-off, and counters that a caller reads.

What the shard reader and the node-local shard cache call::

    read_range(url, start, end, *, storage_options=None, counters=None, policy=None) -> bytes
        bytes start to end (end excluded) of the object; fewer where it ends before ``end``, as
        a file's read (none when it ends before ``start``). One request per attempt.
    fetch(url, path, *, storage_options=None, counters=None, policy=None, stop=None) -> int
        the whole object into the local file ``path``, in ranges of ``FETCH_CHUNK_BYTES``, each
        retried on its own (over HTTP, a server that ignores Range answers the first with the
        whole object: taken whatever its size, written as it comes, each ``FETCH_CHUNK_BYTES`` of
        it within the policy's timeout, as a range would be); written under a temporary name in
        ``path``'s folder and renamed, so a reader never sees part of an object. Returns its
        size. ``stop`` (a ``threading.Event``): once set, the fetch ends within ``STOP_POLL_S``,
        its request cancelled, its back-off cut short, nothing written, with ``FetchStopped``;
        so that a loader that closes does not wait for fetches nobody needs any more (a request
        may take ``timeout`` seconds, and a retried one several times that).
    size(url, *, storage_options=None, counters=None, policy=None) -> int
    version(url, *, storage_options=None, counters=None, policy=None, stop=None) -> str: the object's
        size and ETag (or generation, version id, time of change): a shard cache's way to see
        that an object it copied was rewritten, with one request and no read (over
        ``http(s)://`` and ``s3://``, a HEAD through the same streamed path as a fetch).
    open_file(url, storage_options=None, *, policy=None) -> a binary file object (its opening
        retried; its reads are fsspec's own): for tar headers (``ShardIndex.scan``), an index.

Local paths (and ``file://``) are read with ``open``, without fsspec; a fetch or a range of an
``http(s)://`` or ``s3://`` object too goes without it, streamed from the socket in the calling
thread (``shmseq.remote_stream``; ``shmseq.remote_sources`` says which
``storage_options`` it honours, and refuses the others by name), at about half the CPU; and so
do its ``size`` and ``version``, so that a process's first shard does not wait for fsspec's
imports, session and event loop thread (0.15 s over HTTP, 0.4 s over S3, in each worker and
fetch process).

``policy`` (a ``RemotePolicy``; by default ``RemotePolicy()``) bounds each attempt, the
retries and their back-offs, and ``counters`` (a ``Counters``) adds up what the calls did:
both are ``shmseq.remote_policy``'s. Which failures are retried, and what each error says:
``shmseq.remote_answers``. Their names stay importable from here.

s3fs and botocore retry on their own, uncounted and with back-offs of their own: for ``s3://``
both make one attempt per call (``config_kwargs={"retries": {"total_max_attempts": 1}}`` unless
``storage_options`` sets retries), so that the attempts are this module's, bounded and counted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import io
import itertools
import os
import shutil
import tempfile
import threading
import time
from email.message import Message
from typing import IO, Any, Callable, Coroutine, TypeVar

from . import remote_sources
from .remote_answers import (DENIED_CODES, MESSAGE_CHARS, MISSING_CODES, RETRIED_CODES, RETRIED_STATUS,
                             TRANSIENT, RangeIgnored, _BadAnswer, _failure, _http_range, _judge,
                             _tries, _whole_size, reason)
from .remote_policy import DEFAULT_POLICY, SEQUENCE_SHARE, Counters, RemotePolicy, fit_to_timeout
from .remote_stream import STOP_POLL_S, FetchStopped, answer_head, get_range

__all__ = ["DEFAULT_POLICY", "DENIED_CODES", "FETCH_CHUNK_BYTES", "MESSAGE_CHARS", "MISSING_CODES",
           "RETRIED_CODES", "RETRIED_STATUS", "SEQUENCE_SHARE", "STOP_POLL_S", "TRANSIENT",
           "VERSION_KEYS", "Counters", "FetchStopped", "RangeIgnored", "RemotePolicy", "fetch",
           "fetch_versioned",
           "fit_to_timeout", "is_remote", "open_file", "read_range", "reason", "size", "version"]

FETCH_CHUNK_BYTES = 32 << 20  # one request of a whole-object fetch: a retry's loss (streamed to
# the file as it comes; a server that ignores Range sends the whole object at once)
_S3 = ("s3", "s3a")
T = TypeVar("T")


def is_remote(url: str) -> bool:
    """A URL with a protocol other than ``file://``: read through fsspec."""
    return "://" in url and not url.startswith("file://")


def _local_path(url: str) -> str:
    return url.removeprefix("file://")


def read_range(url: str, start: int, end: int, *, storage_options: dict | None = None,
               counters: Counters | None = None, policy: RemotePolicy | None = None,
               stop: threading.Event | None = None) -> bytes:
    """Bytes ``start`` to ``end`` of an object (fewer where it ends first), retried (and
    stopped by ``stop``, as ``fetch``)."""
    if not is_remote(url):
        with open(_local_path(url), "rb") as file:
            file.seek(start)
            return file.read(end - start)
    counters, policy = counters or Counters(), policy or DEFAULT_POLICY
    if _streamed(url):
        source = remote_sources.source(url, storage_options)
        ranged: Callable[[float | None], bytes] = functools.partial(
            _streamed_range, source, start, end, stop=stop)
    else:
        ranged = functools.partial(_range, *_filesystem(url, storage_options), start, end,
                                   stop=stop)

    def request(timeout: float | None) -> bytes:
        data = ranged(timeout)
        counters.add(bytes=len(data))
        return data

    return _with_retries(url, request, policy, counters, stop)


def _streamed_range(source: remote_sources.Source, start: int, end: int, timeout: float | None,
                    stop: threading.Event | None) -> bytes:
    """One request for bytes ``start`` to ``end`` over ``remote_stream``: none past the
    object's end (HTTP 416), never more than asked (a server that ignores Range is refused)."""
    if end <= start:
        return b""
    out = io.BytesIO()
    url, headers = source.request(start, end)
    _or_nothing(lambda: get_range(url, headers, source.transport, source.refusal, start,
                                  end - start, out, timeout, stop, whole_object=False), (0, False))
    return out.getvalue()


def _range(fs: Any, path: str, start: int, end: int, timeout: float | None,
           stop: threading.Event | None) -> bytes:
    """One request for bytes ``start`` to ``end``: none past the object's end (HTTP 416),
    never more than asked."""
    if end <= start:
        return b""
    if _is_http(fs):
        return _or_nothing(lambda: _await(fs, _http_range(fs, path, start, end), timeout, stop,
                                          path), b"")
    data = _or_nothing(lambda: _call(fs, "cat_file", path, timeout, stop, start=start, end=end),
                       b"")
    if len(data) > end - start:
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({end - start:,} bytes), "
                                   f"the server sent {len(data):,}")
    return data


def _or_nothing(request: Callable[[], T], nothing: T) -> T:
    """``request()``, or ``nothing`` where the object ends before the bytes it asks for (HTTP
    416): a fetch's last chunk, when the object's size is a multiple of the chunk's."""
    try:
        return request()
    except Exception as exc:  # noqa: BLE001 - judged, and raised again unless past the end
        if _judge(exc)[0] != "range":
            raise
        return nothing


def _is_http(fs: Any) -> bool:
    """fsspec's HTTP file system, whose range answers ``_http_range`` checks itself."""
    protocol = fs.protocol
    return "http" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def fetch(url: str, path: str | os.PathLike, *, storage_options: dict | None = None,
          counters: Counters | None = None, policy: RemotePolicy | None = None,
          stop: threading.Event | None = None) -> int:
    """The whole object into the local file ``path`` (atomically: renamed into place); its size."""
    return fetch_versioned(url, path, storage_options=storage_options, counters=counters,
                           policy=policy, stop=stop)[0]


def fetch_versioned(url: str, path: str | os.PathLike, *, storage_options: dict | None = None,
                    counters: Counters | None = None, policy: RemotePolicy | None = None,
                    stop: threading.Event | None = None,
                    part_path: str | None = None) -> tuple[int, str | None]:
    """``fetch``, and the object's ``version`` as its first answer said it (over ``http(s)://``
    and ``s3://``; None elsewhere): the version of the bytes received, without a request more
    (a later change of the object shows in ``version``). ``part_path``: where the bytes go
    until the object is whole (made 0600, a link there refused; default a fresh temporary name
    beside ``path``), for a caller that owns the name and lets others read what has come."""
    part, part_path = _part_file(path, part_path)
    heads: list[Message] = []
    try:
        with part:
            if is_remote(url):
                size = _fetch_ranges(url, part, storage_options, counters, policy, stop, heads)
            else:
                with open(_local_path(url), "rb") as source:
                    shutil.copyfileobj(source, part)
                size = part.tell()
        os.replace(part_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part_path)
        raise
    return size, _version_of(size, heads[0]) if heads else None


def _part_file(path: str | os.PathLike, part_path: str | None) -> tuple[IO[bytes], str]:
    """The file a fetch writes into until the object is whole, and its path."""
    if part_path is None:
        folder, name = os.path.split(os.path.abspath(path))
        part = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", suffix=".part",
                                           delete=False)
        return part, part.name
    fd = os.open(part_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    return open(fd, "w+b"), part_path


# one attempt at a fetch's chunk: (start, out, timeout, stop) -> (bytes written, whole object)
_Chunk = Callable[[int, IO[bytes], "float | None", "threading.Event | None"], "tuple[int, bool]"]


def _fetch_ranges(url: str, out: IO[bytes], storage_options: dict | None, counters: Counters | None,
                  policy: RemotePolicy | None, stop: threading.Event | None,
                  heads: list[Message]) -> int:
    """Chunk after chunk until one comes short (no request for the size first), each retried
    on its own; over HTTP, a server that ignores Range answers the first with the whole object,
    taken as it comes. The streamed answers' heads go to ``heads``."""
    counters, policy = counters or Counters(), policy or DEFAULT_POLICY
    if _streamed(url):
        chunk = functools.partial(_streamed_chunk, remote_sources.source(url, storage_options),
                                  heads)
    else:
        chunk = functools.partial(_fsspec_chunk, *_filesystem(url, storage_options))
    end, done = 0, False
    while not done:
        end, done = _with_retries(url, functools.partial(_fetch_chunk, chunk, out, end, counters,
                                                         stop), policy, counters, stop)
    return end


def _fetch_chunk(chunk: _Chunk, out: IO[bytes], start: int, counters: Counters,
                 stop: threading.Event | None, timeout: float | None) -> tuple[int, bool]:
    """One attempt at the fetch's chunk from byte ``start``, written to ``out`` after the chunks
    before it (what an attempt before it wrote goes first): where the bytes written end, and
    whether the object is whole with them. None past the object's end (HTTP 416): the last
    chunk, when the object's size is a multiple of the chunk's."""
    out.seek(start)
    out.truncate()
    came, everything = _or_nothing(lambda: chunk(start, out, timeout, stop), (0, False))
    counters.add(bytes=came)
    return start + came, everything or came < FETCH_CHUNK_BYTES


def _streamed_chunk(source: remote_sources.Source, heads: list[Message], start: int,
                    out: IO[bytes], timeout: float | None,
                    stop: threading.Event | None) -> tuple[int, bool]:
    """A chunk over HTTP from the socket to the file, in this thread (``remote_stream``)."""
    url, headers = source.request(start, start + FETCH_CHUNK_BYTES)
    return get_range(url, headers, source.transport, source.refusal, start, FETCH_CHUNK_BYTES,
                     out, timeout, stop, heads)


def _fsspec_chunk(fs: Any, path: str, start: int, out: IO[bytes], timeout: float | None,
                  stop: threading.Event | None) -> tuple[int, bool]:
    """A chunk through fsspec (other protocols than ``remote_sources.STREAMED``)."""
    data = _range(fs, path, start, start + FETCH_CHUNK_BYTES, timeout, stop)
    out.write(data)
    return len(data), False


def _streamed(url: str) -> bool:
    """Whether ``url``'s requests go through ``remote_stream`` rather than fsspec."""
    return url.split("://", 1)[0] in remote_sources.STREAMED


def size(url: str, *, storage_options: dict | None = None, counters: Counters | None = None,
         policy: RemotePolicy | None = None) -> int:
    """The object's size in bytes, retried."""
    if not is_remote(url):
        return os.path.getsize(_local_path(url))
    if _streamed(url):
        return _described(url, storage_options, counters, policy, None)[0]
    fs, path = _filesystem(url, storage_options)
    policy = policy or DEFAULT_POLICY
    found = _with_retries(url, lambda timeout: _call(fs, "info", path, timeout).get("size"),
                          policy, counters or Counters())
    if found is None:
        raise OSError(f"{url}: the server does not say the object's size (no Content-Length)")
    return int(found)


VERSION_KEYS = ("ETag", "etag", "generation", "VersionId", "version_id", "Last-Modified",
                "LastModified", "last_modified", "mtime", "updated")


def version(url: str, *, storage_options: dict | None = None, counters: Counters | None = None,
            policy: RemotePolicy | None = None, stop: threading.Event | None = None) -> str:
    """What tells this object's content from a rewritten one's without reading it, retried
    (and stopped by ``stop``, as ``fetch``): its size and the store's ETag, generation or
    version id, else its time of change (a local file's: size and modification time). One
    request.

    Over ``http(s)://`` and ``s3://``, a HEAD (``_described``), said as ``size N ETag E``
    (``VersionId V`` after it where S3's versioning gives one; ``Last-Modified T`` in place
    of an HTTP server's missing ETag). fsspec's answer was worded otherwise: a node cache
    made before this wording fetches each shard once more, then knows it by this one."""
    if not is_remote(url):
        info = os.stat(_local_path(url))
        return f"size {info.st_size} mtime_ns {info.st_mtime_ns}"
    if _streamed(url):
        return _version_of(*_described(url, storage_options, counters, policy, stop))
    fs, path = _filesystem(url, storage_options)
    policy = policy or DEFAULT_POLICY
    found = _with_retries(url, lambda timeout: _call(fs, "info", path, timeout, stop), policy,
                          counters or Counters(), stop)
    marks = [f"{key} {found[key]}" for key in VERSION_KEYS if found.get(key) is not None]
    return f"size {found.get('size')} " + " ".join(marks)


def _described(url: str, storage_options: dict | None, counters: Counters | None,
               policy: RemotePolicy | None, stop: threading.Event | None) -> tuple[int, Message]:
    """The object's size and the head of the answer that says it, retried as a fetch's range
    is (its timeouts, its stop, its counts and its errors)."""
    source, counters = remote_sources.source(url, storage_options), counters or Counters()
    return _with_retries(url, functools.partial(_head, source, counters, stop),
                         policy or DEFAULT_POLICY, counters, stop)


_NO_HEAD = frozenset({405, 501})  # a server that does not take HEAD requests


def _head(source: remote_sources.Source, counters: Counters, stop: threading.Event | None,
          timeout: float | None) -> tuple[int, Message]:
    """One attempt: a HEAD; where the server refuses HEAD (405, 501) or says no Content-Length
    in answer to it, a GET of the object's first byte, whose Content-Range says its size (a
    request more, counted, its body not read)."""
    url, headers = source.head()
    asked, head = answer_head("HEAD", url, headers, source.transport, source.refusal, timeout,
                              stop, accepted=_NO_HEAD)
    length = head.get("Content-Length")
    if asked not in _NO_HEAD and length is not None:
        return int(length), head
    counters.add(requests=1)
    url, headers = source.request(0, 1)
    status, head = answer_head("GET", url, headers, source.transport, source.refusal, timeout,
                               stop, accepted=frozenset({416}))
    return _whole_size(asked, status, head), head


def _version_of(found: int, head: Message) -> str:
    """``version``'s words for an object of ``found`` bytes from the head of its answer: its
    ETag (and S3's version id), else its time of change."""
    marks = {"ETag": head.get("ETag"), "VersionId": head.get("x-amz-version-id")}
    if not marks["ETag"]:
        marks["Last-Modified"] = head.get("Last-Modified")
    return " ".join([f"size {found}", *(f"{key} {value}" for key, value in marks.items() if value)])


def open_file(url: str, storage_options: dict | None = None, *,
              policy: RemotePolicy | None = None) -> IO[bytes]:
    """A binary file object for a local path or any fsspec URL (its opening retried)."""
    if not is_remote(url):
        return open(_local_path(url), "rb")
    fs, path = _filesystem(url, storage_options)
    return _with_retries(url, lambda timeout: fs.open(path, "rb"), policy or DEFAULT_POLICY,
                         Counters())


def _filesystem(url: str, storage_options: dict | None) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the path in it; for S3, one attempt per call."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"reading {url} needs fsspec: pip install fsspec (and aiohttp for "
                          "http://, s3fs for s3://, gcsfs for gs://)") from None
    options = dict(storage_options or {})
    s3 = url.split("://", 1)[0] in _S3
    if s3:
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1},
                                    **options.get("config_kwargs", {})}
    fs, path = fsspec.core.url_to_fs(url, **options)
    if s3:
        fs.retries = 1  # s3fs's own loop around each call (a class attribute, no option)
    return fs, path


def _call(fs: Any, method: str, path: str, timeout: float | None,
          stop: threading.Event | None = None, **kwargs: object) -> Any:
    """One request of fsspec's ``method``: on an asynchronous file system, as ``_await``."""
    if not getattr(fs, "async_impl", False):
        return getattr(fs, method)(path, **kwargs)
    return _await(fs, getattr(fs, f"_{method}")(path, **kwargs), timeout, stop, path)


def _await(fs: Any, request: Coroutine[Any, Any, T], timeout: float | None,
           stop: threading.Event | None, path: str) -> T:
    """``request`` run on fsspec's event loop, cancelled after ``timeout`` seconds or once
    ``stop`` is set."""
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(request, timeout), fs.loop)
    while not concurrent.futures.wait([future], STOP_POLL_S if stop else 1.0).done:
        if stop is not None and stop.is_set():  # a short wait also lets Ctrl-C in
            future.cancel()
            raise FetchStopped(f"{path}: stopped")
    return future.result()


def _with_retries(url: str, request: Callable[[float | None], T], policy: RemotePolicy,
                  counters: Counters, stop: threading.Event | None = None) -> T:
    """``request(timeout)`` until it succeeds, fails for good, or runs out of attempts or of
    the policy's deadline: an attempt's ``timeout`` is the policy's, cut to what is left of the
    deadline, and a back-off that would end past the deadline is not waited."""
    began = time.perf_counter()
    ends = None if policy.deadline is None else began + policy.deadline
    try:
        for attempt in itertools.count(1):
            if stop is not None and stop.is_set():
                raise FetchStopped(f"{url}: stopped")
            counters.add(requests=1)
            try:
                return request(_attempt_timeout(policy.timeout, ends))
            except FetchStopped:
                raise
            except Exception as exc:  # noqa: BLE001 - judged: retried, or raised with the URL
                kind, cause = _judge(exc)
                wait = policy.delay(attempt)
                late = ends is not None and time.perf_counter() + wait >= ends
                if kind not in TRANSIENT or attempt == policy.attempts or late:
                    tries = _tries(attempt, time.perf_counter() - began, policy.deadline,
                                   kind in TRANSIENT and attempt < policy.attempts)
                    raise _failure(url, kind, cause, tries, policy) from exc
            counters.add(retries=1)
            if stop is None:
                time.sleep(wait)
            else:
                stop.wait(wait)  # cut short by a stop, raised at the loop's top
        raise AssertionError("unreachable: the attempts are counted without end")
    finally:
        counters.add(wait_s=time.perf_counter() - began)


def _attempt_timeout(timeout: float | None, ends: float | None) -> float | None:
    """An attempt's timeout: the policy's, at most what is left until ``ends``."""
    if ends is None:
        return timeout
    left = max(ends - time.perf_counter(), 0.0)
    return left if timeout is None else min(timeout, left)
