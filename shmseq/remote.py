"""Remote objects through fsspec: byte ranges and whole objects, each request under a timeout,
transient failures retried with back-off, and counters that a caller reads.

What the shard reader and the node-local shard cache call::

    read_range(url, start, end, *, storage_options=None, counters=None, policy=None) -> bytes
        bytes start to end (end excluded) of the object; fewer where it ends before ``end``, as
        a file's read (none when it ends before ``start``). One request per attempt.
    fetch(url, path, *, storage_options=None, counters=None, policy=None, stop=None) -> int
        the whole object into the local file ``path``, in ranges of ``FETCH_CHUNK_BYTES``, each
        retried on its own; written under a temporary name in ``path``'s folder and renamed, so
        a reader never sees part of an object. Returns its size. ``stop`` (a
        ``threading.Event``): once set, the fetch ends within ``STOP_POLL_S``, its request
        cancelled, its back-off cut short, nothing written, with ``FetchStopped``; so that a
        loader that closes does not wait for fetches nobody needs any more (a request may
        take ``timeout`` seconds, and a retried one several times that).
    size(url, *, storage_options=None, counters=None, policy=None) -> int
    open_file(url, storage_options=None, *, policy=None) -> a binary file object (its opening
        retried; its reads are fsspec's own): for tar headers (``ShardIndex.scan``), an index.

Local paths (and ``file://``) are read with ``open``, without fsspec.

``policy`` (a ``RemotePolicy``; by default ``RemotePolicy()``): each attempt may take
``timeout`` seconds (30; on fsspec's asynchronous file systems: HTTP, S3, GCS, Azure), and a
transient failure is tried again after a back-off drawn between half and all of
``backoff * 2**(retry - 1)`` seconds, at most ``max_backoff`` (0.5 s doubling to 10 s), up to
``attempts`` attempts in all (5: 3.75 to 7.5 s of back-off before giving up). The jitter comes
from the system's random source, so workers and ranks seeded alike do not retry in step.

Transient (retried): a connection refused, reset or dropped (a server restarting; refused is
retried too, since a worker process that never reached the server yet cannot tell a restart
from a wrong port), a timeout, HTTP 408, 429 and 5xx, S3's SlowDown, InternalError,
ServiceUnavailable and RequestTimeout. Not transient (raised at once): a missing object
(``FileNotFoundError``: 404, NoSuchKey), access denied (``PermissionError``: 401, 403,
AccessDenied), any other answer. After the last attempt: ``TimeoutError``, ``ConnectionError``
or ``OSError``. Every error names the URL and the cause.

s3fs and botocore retry on their own, uncounted and with back-offs of their own: for ``s3://``
both make one attempt per call (``config_kwargs={"retries": {"total_max_attempts": 1}}`` unless
``storage_options`` sets retries), so that the attempts are this module's, bounded and counted.

``counters`` (a ``Counters``) adds up what the calls did: requests (every attempt), bytes
received, retries, and the seconds spent waiting in them (back-offs included). A ``ShardWorker``
keeps one, and its ``pop_counts()`` hands the counts to the worker loop, which sends them to the
consumer with each batch: ``seq.stats.remote_requests``, ``remote_bytes``, ``remote_retries``,
``remote_wait_s``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import itertools
import numbers
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from .checks import check_int, check_timeout

if TYPE_CHECKING:
    from aiohttp import ClientResponseError

FETCH_CHUNK_BYTES = 32 << 20  # one request of a whole-object fetch: memory held, and a retry's loss
STOP_POLL_S = 0.05  # how often a request that can be stopped looks at its stop event
RETRIED_STATUS = frozenset({408, 429})  # and every 5xx
RETRIED_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                           "Throttling", "ThrottlingException"})
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                          "ExpiredToken", "AllAccessDisabled", "403"})
TRANSIENT = ("busy", "timeout", "connection")
_S3 = ("s3", "s3a")
_jitter = random.SystemRandom()
T = TypeVar("T")


@dataclass(frozen=True)
class RemotePolicy:
    """How remote requests are made (see the module's docstring): ``attempts`` in all, each
    within ``timeout`` seconds (None: as long as it takes), a retry after a back-off doubling
    from ``backoff`` seconds up to ``max_backoff``."""
    attempts: int = 5
    timeout: float | None = 30.0
    backoff: float = 0.5
    max_backoff: float = 10.0

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, 1)
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        for name in ("backoff", "max_backoff"):
            value: float = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number of seconds >= 0, got {value!r} "
                                f"({type(value).__name__})")
            if not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        ceiling = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        return _jitter.uniform(ceiling / 2, ceiling)


DEFAULT_POLICY = RemotePolicy()


class FetchStopped(Exception):
    """A fetch ended early because its ``stop`` event was set: not a failure of the server."""


class Counters:
    """What remote calls did, added up (thread-safe): ``requests`` (attempts), ``bytes``
    received, ``retries``, ``wait_s`` (seconds spent in the calls). A copy sent to another
    process starts at zero: each process counts its own."""

    FIELDS: tuple[str, ...] = ("requests", "bytes", "retries", "wait_s")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def __reduce__(self) -> tuple:
        return Counters, ()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def take(self) -> dict:
        """The counts so far, and start again from zero."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self.FIELDS, 0)
        return counts

    def __repr__(self) -> str:
        return f"Counters({', '.join(f'{k}={v}' for k, v in self.snapshot().items())})"


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
    fs, path = _filesystem(url, storage_options)
    counters, policy = counters or Counters(), policy or DEFAULT_POLICY

    def request() -> bytes:
        try:
            data = _call(fs, "cat_file", path, policy, stop, start=start, end=end)
        except Exception as exc:  # noqa: BLE001 - judged, and raised again unless past the end
            if _judge(exc)[0] != "range":
                raise
            data = b""
        if len(data) > end - start:
            raise OSError(f"{url}: asked for bytes {start}-{end}, the server sent {len(data)} "
                          "bytes: it ignores Range requests; serve the shards from one that "
                          "honours them (any object store or web server does)")
        counters.add(bytes=len(data))
        return data

    return _with_retries(url, request, policy, counters, stop)


def fetch(url: str, path: str | os.PathLike, *, storage_options: dict | None = None,
          counters: Counters | None = None, policy: RemotePolicy | None = None,
          stop: threading.Event | None = None) -> int:
    """The whole object into the local file ``path`` (atomically: renamed into place); its size."""
    folder, name = os.path.split(os.path.abspath(path))
    part = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", suffix=".part", delete=False)
    try:
        with part:
            if is_remote(url):
                size = _fetch_ranges(url, part, storage_options, counters, policy, stop)
            else:
                with open(_local_path(url), "rb") as source:
                    shutil.copyfileobj(source, part)
                size = part.tell()
        os.replace(part.name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part.name)
        raise
    return size


def _fetch_ranges(url: str, out: IO[bytes], storage_options: dict | None, counters: Counters | None,
                  policy: RemotePolicy | None, stop: threading.Event | None) -> int:
    """Chunk after chunk until one comes short: no request for the size first."""
    start = 0
    while True:
        data = read_range(url, start, start + FETCH_CHUNK_BYTES, storage_options=storage_options,
                          counters=counters, policy=policy, stop=stop)
        out.write(data)
        start += len(data)
        if len(data) < FETCH_CHUNK_BYTES:
            return start


def size(url: str, *, storage_options: dict | None = None, counters: Counters | None = None,
         policy: RemotePolicy | None = None) -> int:
    """The object's size in bytes, retried."""
    if not is_remote(url):
        return os.path.getsize(_local_path(url))
    fs, path = _filesystem(url, storage_options)
    policy = policy or DEFAULT_POLICY
    found = _with_retries(url, lambda: _call(fs, "info", path, policy).get("size"), policy,
                          counters or Counters())
    if found is None:
        raise OSError(f"{url}: the server does not say the object's size (no Content-Length)")
    return int(found)


def open_file(url: str, storage_options: dict | None = None, *,
              policy: RemotePolicy | None = None) -> IO[bytes]:
    """A binary file object for a local path or any fsspec URL (its opening retried)."""
    if not is_remote(url):
        return open(_local_path(url), "rb")
    fs, path = _filesystem(url, storage_options)
    return _with_retries(url, lambda: fs.open(path, "rb"), policy or DEFAULT_POLICY, Counters())


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


def _call(fs: Any, method: str, path: str, policy: RemotePolicy,
          stop: threading.Event | None = None, **kwargs: object) -> Any:
    """One request: on an asynchronous file system, run on fsspec's event loop and cancelled
    after ``policy.timeout`` or once ``stop`` is set."""
    if not getattr(fs, "async_impl", False):
        return getattr(fs, method)(path, **kwargs)
    request = asyncio.wait_for(getattr(fs, f"_{method}")(path, **kwargs), policy.timeout)
    future = asyncio.run_coroutine_threadsafe(request, fs.loop)
    while not concurrent.futures.wait([future], STOP_POLL_S if stop else 1.0).done:
        if stop is not None and stop.is_set():  # a short wait also lets Ctrl-C in
            future.cancel()
            raise FetchStopped(f"{path}: stopped")
    return future.result()


def _with_retries(url: str, request: Callable[[], T], policy: RemotePolicy,
                  counters: Counters, stop: threading.Event | None = None) -> T:
    began = time.perf_counter()
    try:
        for attempt in itertools.count(1):
            if stop is not None and stop.is_set():
                raise FetchStopped(f"{url}: stopped")
            counters.add(requests=1)
            try:
                return request()
            except FetchStopped:
                raise
            except Exception as exc:  # noqa: BLE001 - judged: retried, or raised with the URL
                kind, cause = _judge(exc)
                if kind not in TRANSIENT or attempt == policy.attempts:
                    raise _failure(url, kind, cause, attempt, policy) from exc
            counters.add(retries=1)
            if stop is None:
                time.sleep(policy.delay(attempt))
            else:
                stop.wait(policy.delay(attempt))  # cut short by a stop, raised at the loop's top
        raise AssertionError("unreachable: the attempts are counted without end")
    finally:
        counters.add(wait_s=time.perf_counter() - began)


def _failure(url: str, kind: str, cause: str, attempts: int, policy: RemotePolicy) -> OSError:
    """The error to raise: it names the URL, the cause and what to do."""
    tries = f" ({attempts} attempts)" if attempts > 1 else ""
    if kind == "missing":
        return FileNotFoundError(errno.ENOENT, cause, url)
    if kind == "denied":
        return PermissionError(errno.EACCES, f"access denied ({cause}): check the credentials "
                               "given in storage_options", url)
    if kind == "timeout":
        return TimeoutError(f"{url}: no answer within {policy.timeout} s{tries}: check the "
                            "server, or give a longer RemotePolicy(timeout=...)")
    if kind == "connection":
        return ConnectionError(f"the server of {url} could not be reached ({cause}){tries}: check "
                               "that it is up and that the URL is right")
    if kind == "busy":
        return OSError(f"{url}: the server is overloaded or failing ({cause}){tries}: try again "
                       "later, or allow more RemotePolicy(attempts=...)")
    return OSError(f"{url}: {cause}")


def _judge(exc: BaseException) -> tuple[str, str]:
    """(kind, cause) of a failed request: ``missing``, ``denied``, ``range`` (nothing there),
    ``busy``, ``timeout``, ``connection`` (the last three transient) or ``failed``. An answer
    from the server anywhere in the exception's chain decides; otherwise its types do (fsspec's
    HTTP file system raises ``FileNotFoundError`` from any failure, a refused connection too)."""
    chain = list(_chain(exc))
    for link in chain:
        answer = _answer(link)
        if answer is not None:
            return answer
    root = chain[-1]
    cause = f"{type(root).__name__}: {root}" if str(root) else type(root).__name__
    if any(_is_timeout(link) for link in chain):
        return "timeout", cause
    if any(isinstance(link, _connection_errors()) for link in chain):
        return "connection", cause
    if isinstance(exc, FileNotFoundError):
        return "missing", "not found"
    if isinstance(exc, PermissionError):
        return "denied", cause
    return "failed", cause


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _answer(exc: BaseException) -> tuple[str, str] | None:
    """(kind, cause) of an HTTP status (aiohttp's ``ClientResponseError``) or an S3 error code
    (botocore's ``ClientError``) that ``exc`` carries; None for any other exception."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        code = str(response["Error"].get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        cause = f"{code} ({status}): {response['Error'].get('Message', '')}".rstrip(": ")
        if code in MISSING_CODES:
            return "missing", cause
        if code in DENIED_CODES:
            return "denied", cause
        if code in RETRIED_CODES:
            return "busy", cause
        return _by_status(status, cause)
    if isinstance(exc, _http_errors()):
        return _by_status(exc.status, f"HTTP {exc.status} {exc.message}".rstrip())
    return None


def _by_status(status: int, cause: str) -> tuple[str, str]:
    if status in (404, 410):
        return "missing", cause
    if status in (401, 403):
        return "denied", cause
    if status == 416:
        return "range", cause
    if status >= 500 or status in RETRIED_STATUS:
        return "busy", cause
    return "failed", cause


def _is_timeout(exc: BaseException) -> bool:
    """Python's, asyncio's, fsspec's, aiohttp's and botocore's timeouts."""
    return isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(exc).__name__


@functools.cache
def _http_errors() -> tuple[type[ClientResponseError], ...]:
    """An HTTP answer that is an error, as aiohttp raises it (fsspec's HTTP file system)."""
    try:
        from aiohttp import ClientResponseError
    except ImportError:
        return ()
    return (ClientResponseError,)


@functools.cache
def _connection_errors() -> tuple[type, ...]:
    """A connection refused, reset or dropped, in Python's, aiohttp's and botocore's types."""
    found: list[type] = [ConnectionError]
    with contextlib.suppress(ImportError):
        import aiohttp
        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    with contextlib.suppress(ImportError):
        from botocore import exceptions
        found += [exceptions.ConnectionError, exceptions.HTTPClientError]
    return tuple(found)
