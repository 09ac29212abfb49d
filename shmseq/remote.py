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
    version(url, *, storage_options=None, counters=None, policy=None, stop=None) -> str: the object's
        size and ETag (or generation, version id, time of change): a shard cache's way to see
        that an object it copied was rewritten, with one request and no read.
    open_file(url, storage_options=None, *, policy=None) -> a binary file object (its opening
        retried; its reads are fsspec's own): for tar headers (``ShardIndex.scan``), an index.

Local paths (and ``file://``) are read with ``open``, without fsspec.

``policy`` (a ``RemotePolicy``; by default ``RemotePolicy()``): each attempt may take
``timeout`` seconds (30; on fsspec's asynchronous file systems: HTTP, S3, GCS, Azure), and a
transient failure is tried again after a back-off drawn between half and all of
``backoff * 2**(retry - 1)`` seconds, at most ``max_backoff`` (0.5 s doubling to 10 s), up to
``attempts`` attempts in all (5: 3.75 to 7.5 s of back-off before giving up; 157.5 s at worst,
``worst_case()``). The jitter comes from the system's random source, so workers and ranks
seeded alike do not retry in step. ``deadline`` (None by default) bounds one request, its
attempts and back-offs together (a fetch: each of its ranges): the last attempt is cut to what
is left of it, and no back-off runs past it. ``fit_to_timeout`` gives a sequence's policy the
deadline its batch timeout leaves, so that a server that stalls is reported here, naming its
URL, before the sequence gives up on the batch.

Transient (retried): a connection refused, reset or dropped (a server restarting; refused is
retried too, since a worker process that never reached the server yet cannot tell a restart
from a wrong port), a body cut short (the connection closed before Content-Length bytes came),
a timeout, HTTP 408, 429 and 5xx, S3's SlowDown, InternalError, ServiceUnavailable and
RequestTimeout. Not transient (raised at once): a missing object (``FileNotFoundError``: 404,
NoSuchKey), access denied (``PermissionError``: 401, 403, AccessDenied), an answer that is not
the bytes asked for (HTTP checks the status and Content-Range: a Range ignored, a range
answered short, more bytes than asked or than announced), any other answer. After the last
attempt: ``TimeoutError``, ``ConnectionError`` or ``OSError``. Every error names the URL once,
what happened (counts of bytes, never the bytes), the attempts and the time they took.

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
import dataclasses
import errno
import functools
import itertools
import numbers
import os
import random
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Callable, Coroutine, Iterator, TypeVar

from .checks import check_int, check_timeout

if TYPE_CHECKING:
    from aiohttp import ClientResponse, ClientResponseError

FETCH_CHUNK_BYTES = 32 << 20  # one request of a whole-object fetch: memory held, and a retry's loss
STOP_POLL_S = 0.05  # how often a request that can be stopped looks at its stop event
RETRIED_STATUS = frozenset({408, 429})  # and every 5xx
RETRIED_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                           "Throttling", "ThrottlingException"})
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                          "ExpiredToken", "AllAccessDisabled", "403"})
TRANSIENT = ("busy", "timeout", "connection", "cut")
SEQUENCE_SHARE = 3  # a sequence gives one request, its retries included, this part of its timeout
MESSAGE_CHARS = 200  # of a library's error text quoted in a message: its first line, at most this
_S3 = ("s3", "s3a")
_jitter = random.SystemRandom()
T = TypeVar("T")


@dataclass(frozen=True)
class RemotePolicy:
    """How remote requests are made (see the module's docstring): ``attempts`` in all, each
    within ``timeout`` seconds (None: as long as it takes), a retry after a back-off doubling
    from ``backoff`` seconds up to ``max_backoff``, and all of them within ``deadline`` seconds
    of the first attempt (None: no bound but theirs)."""
    attempts: int = 5
    timeout: float | None = 30.0
    backoff: float = 0.5
    max_backoff: float = 10.0
    deadline: float | None = None

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, 1)
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        for name in ("backoff", "max_backoff"):
            _check_seconds(name, getattr(self, name), ">= 0")
        if self.deadline is not None:
            _check_seconds("deadline", self.deadline, "> 0, or None for no deadline")

    def _ceiling(self, retry: int) -> float:
        return min(self.max_backoff, self.backoff * 2 ** (retry - 1))

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        ceiling = self._ceiling(retry)
        return _jitter.uniform(ceiling / 2, ceiling)

    def worst_case(self) -> float | None:
        """The longest one request may take, its attempts and back-offs included (None: no
        bound): what a caller that waits for it must allow."""
        if self.timeout is None:
            return self.deadline
        longest = self.attempts * self.timeout + sum(map(self._ceiling, range(1, self.attempts)))
        return longest if self.deadline is None else min(longest, self.deadline)


def _check_seconds(name: str, value: object, wanted: str) -> None:
    """Raise naming ``name`` unless ``value`` is a number of seconds ``wanted`` says (">= 0",
    "> 0, ...": its first word is the bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds {wanted}, got {value!r} "
                        f"({type(value).__name__})")
    seconds = float(value)
    if not (seconds >= 0 if wanted.startswith(">=") else seconds > 0):  # NaN is neither
        raise ValueError(f"{name} must be a number of seconds {wanted}, got {value!r}")


DEFAULT_POLICY = RemotePolicy()


def fit_to_timeout(policy: RemotePolicy | None, timeout: float | None) -> RemotePolicy:
    """The policy of a sequence that waits ``timeout`` seconds for a batch (None: as long as it
    takes). A request, its retries included, must end within a third of it: a server that
    stalls is then reported here, naming its URL, the attempts and the time, before the
    sequence gives up on the batch with a timeout that cannot name them. A third, because a
    worker may wait for another process's fetch of a shard before it fetches the shard itself
    (two requests in a row), and the rest of the batch needs time too.

    ``policy`` None (the default) gets that ``deadline``. A policy given that may take longer
    is refused, naming what would fit: it was chosen, so it is not cut behind its chooser's
    back, and a sequence that would time out before its own remote errors is a mistake to
    catch before the run rather than at its first stall."""
    if timeout is None:
        return policy or DEFAULT_POLICY
    budget = timeout / SEQUENCE_SHARE
    if policy is None:
        return dataclasses.replace(DEFAULT_POLICY, deadline=budget)
    worst = policy.worst_case()
    if worst is not None and worst <= budget:
        return policy
    takes = "as long as it takes" if worst is None else f"up to {worst:g} s"
    longer = "" if worst is None else f" (at least {worst * SEQUENCE_SHARE:g} s)"
    raise ValueError(
        f"remote={policy!r} may wait {takes} for one request (its attempts, their timeout and "
        f"back-offs), longer than {budget:g} s, a third of the sequence's timeout={timeout:g} "
        "s: a server that stalls would not be reported, naming its URL, before the batch times "
        f"out. Give the policy deadline={budget:g} (its attempts end there), or fewer attempts "
        f"or a shorter timeout, or give the sequence a longer timeout={longer}")


class _BadAnswer(Exception):
    """An answer that is not what was asked for, as ``_judge`` sorts it (``kind``). Its message
    says what came, in counts (never the bytes), and not the URL, which ``_failure`` adds."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


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

    def request(timeout: float | None) -> bytes:
        data = _range(fs, path, start, end, timeout, stop)
        counters.add(bytes=len(data))
        return data

    return _with_retries(url, request, policy, counters, stop)


def _range(fs: Any, path: str, start: int, end: int, timeout: float | None,
           stop: threading.Event | None) -> bytes:
    """One request for bytes ``start`` to ``end``: none past the object's end (HTTP 416),
    never more than asked."""
    if end <= start:
        return b""
    try:
        if _is_http(fs):
            return _await(fs, _http_range(fs, path, start, end), timeout, stop, path)
        data = _call(fs, "cat_file", path, timeout, stop, start=start, end=end)
    except Exception as exc:  # noqa: BLE001 - judged, and raised again unless past the end
        if _judge(exc)[0] != "range":
            raise
        return b""
    if len(data) > end - start:
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({end - start:,} bytes), "
                                   f"the server sent {len(data):,}")
    return data


def _is_http(fs: Any) -> bool:
    """fsspec's HTTP file system, whose range answers ``_http_range`` checks itself."""
    protocol = fs.protocol
    return "http" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


async def _http_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``start`` to ``end`` over HTTP, on fsspec's session with its options, checked
    against the answer's status and Content-Range: fsspec's ``cat_file`` hands back whatever
    body came, so that a server that ignores Range, or answers a range short, would pass for
    an object that ends early (and a shard reader then contradict itself)."""
    from aiohttp import ClientResponseError
    options = dict(fs.kwargs)
    options["headers"] = {**options.get("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    try:
        async with session.get(getattr(fs, "encode_url", str)(path), **options) as answer:
            if answer.status == 404:
                raise FileNotFoundError(errno.ENOENT, "not found", path)
            answer.raise_for_status()
            body = await _body(answer)
    except ClientResponseError as exc:
        parsed = [link for link in _chain(exc) if isinstance(link, _parser_errors())]
        if not parsed:
            raise
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({end - start:,} bytes), the "
                                   "server sent more than its answer announced: bytes past the "
                                   "end of its body, which is not HTTP "
                                   f"({_first_line(_parser_message(parsed[0]))}); check the "
                                   "server, or a proxy before it") from exc
    return _ranged(start, end, answer.status, answer.headers.get("Content-Range"), body)


async def _body(answer: ClientResponse) -> bytes:
    """The answer's body; one cut short (the connection closed before Content-Length bytes
    came) is said so, with the counts."""
    from aiohttp import ClientPayloadError
    parts: list[bytes] = []
    try:
        async for part in answer.content.iter_any():
            parts.append(part)
    except ClientPayloadError as exc:
        came, told = sum(map(len, parts)), answer.content_length
        of = "" if told is None else f" of the {told:,}"
        raise _BadAnswer("cut", f"the connection closed after {came:,}{of} bytes of its "
                                "answer's body") from exc
    return b"".join(parts)


def _ranged(start: int, end: int, status: int, content_range: str | None, body: bytes) -> bytes:
    """The bytes asked for, from an answer to ``Range: bytes=start-(end - 1)``: a 206 whose
    Content-Range says it holds them, or as many as the object has; a 200 from the object's
    start (a server that ignores Range) only where it holds the whole object, fewer bytes
    than asked."""
    asked = end - start
    ignores = ("it ignores Range requests; serve the shards from one that honours them (any "
               "object store or web server does)")
    if status == 200:
        if start == 0 and len(body) <= asked:
            return body  # the whole object, which ends before ``end``
        raise _BadAnswer("failed", f"asked for bytes {start}-{end}, the server answered 200 "
                                   f"with the whole object ({len(body):,} bytes): {ignores}")
    span = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range or "")
    if status != 206 or span is None or int(span[1]) != start or (
            int(span[2]) + 1 - start != len(body)):
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes), the "
                                   f"server answered {status} with {len(body):,} bytes and "
                                   f"Content-Range {content_range or 'none'}: not the bytes "
                                   "asked for; check the server, or a proxy before it")
    total = None if span[3] == "*" else int(span[3])
    if len(body) > asked:
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes), the "
                                   f"server sent {len(body):,}: more than asked")
    if len(body) < asked and (total is None or start + len(body) < total):
        of = "" if total is None else f" of an object of {total:,} bytes"
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes){of}, the "
                                   f"server sent only {len(body):,}: it answers ranges short; "
                                   "serve the shards from one that answers them whole")
    return body


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
    request."""
    if not is_remote(url):
        info = os.stat(_local_path(url))
        return f"size {info.st_size} mtime_ns {info.st_mtime_ns}"
    fs, path = _filesystem(url, storage_options)
    policy = policy or DEFAULT_POLICY
    found = _with_retries(url, lambda timeout: _call(fs, "info", path, timeout, stop), policy,
                          counters or Counters(), stop)
    marks = [f"{key} {found[key]}" for key in VERSION_KEYS if found.get(key) is not None]
    return f"size {found.get('size')} " + " ".join(marks)


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


def _tries(attempts: int, spent: float, deadline: float | None, ended_by_deadline: bool) -> str:
    """The attempts a failure took, for its message: how many and how long, and that the
    deadline ended them; nothing for a single attempt that failed at once."""
    if ended_by_deadline and deadline is not None:
        return (f" ({attempts} attempt{'s' if attempts > 1 else ''} in {spent:.1f} s, ended by "
                f"RemotePolicy(deadline={deadline:g}))")
    return f" ({attempts} attempts in {spent:.1f} s)" if attempts > 1 else ""


def _failure(url: str, kind: str, cause: str, tries: str, policy: RemotePolicy) -> OSError:
    """The error to raise: the URL once, first (``reason`` takes it off for a caller that names
    the object itself), then what happened, the attempts (``tries``) and what to do."""
    if kind == "missing":
        return FileNotFoundError(errno.ENOENT, cause, url)
    if kind == "denied":
        return PermissionError(errno.EACCES, f"access denied ({cause}): check the credentials "
                               "given in storage_options", url)
    if kind == "timeout" and "deadline" in tries:
        return TimeoutError(f"{url}: no answer{tries}: check that the server is up and answering; "
                            "if it is only slow, give it a longer deadline (a ShardSequence "
                            "gives its requests a third of its timeout=)")
    if kind == "timeout":
        within = "" if policy.timeout is None else f" within {policy.timeout:g} s"
        return TimeoutError(f"{url}: no answer{within}{tries}: check the server, or give a "
                            "longer RemotePolicy(timeout=...)")
    if kind == "connection":
        return ConnectionError(f"{url}: the server could not be reached ({cause}){tries}: check "
                               "that it is up and that the URL is right")
    if kind == "cut":
        return ConnectionError(f"{url}: the server cut its answer short: {cause}{tries}: check "
                               "the server, or a proxy before it")
    if kind == "busy":
        return OSError(f"{url}: the server is overloaded or failing ({cause}){tries}: try again "
                       "later, or allow more RemotePolicy(attempts=...)")
    return OSError(f"{url}: {cause}{tries}")


def reason(exc: BaseException, url: str) -> str:
    """What ``exc`` says went wrong with ``url``, without the URL: for a caller whose own
    message names it already ("shard URL: ..."), so that the user reads it once. This module's
    errors lead with the URL, or carry it as their file name."""
    if isinstance(exc, OSError) and exc.filename == url and exc.strerror:
        return exc.strerror
    text = str(exc)
    return text.removeprefix(f"{url}: ")


def _judge(exc: BaseException) -> tuple[str, str]:
    """(kind, cause) of a failed request: ``missing``, ``denied``, ``range`` (nothing there),
    ``busy``, ``timeout``, ``connection``, ``cut`` (the last four transient) or ``failed``.
    This module's own finding (``_BadAnswer``) decides first, then an HTTP answer that is not
    HTTP (aiohttp reports it as a 400 of its own, quoting the bytes), then an answer from the
    server anywhere in the exception's chain; otherwise its types do (fsspec's HTTP file system
    raises ``FileNotFoundError`` from any failure, a refused connection too). A cause quotes
    the first line of a library's message at most, never a payload."""
    chain = list(_chain(exc))
    for link in chain:
        if isinstance(link, _BadAnswer):
            return link.kind, str(link)
    for link in chain:
        if isinstance(link, _parser_errors()):
            return "failed", f"its answer is not HTTP ({_first_line(_parser_message(link))})"
    for link in chain:
        answer = _answer(link)
        if answer is not None:
            return answer
    root = chain[-1]
    cause = f"{type(root).__name__}: {_first_line(str(root))}" if str(root) else type(root).__name__
    if any(_is_timeout(link) for link in chain):
        return "timeout", cause
    if any(isinstance(link, _payload_errors()) for link in chain):
        return "cut", f"its answer's body ended early ({cause})"
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


def _first_line(text: str) -> str:
    """A library's message as a cause quotes it: the first line, at most ``MESSAGE_CHARS``."""
    line = text.strip().split("\n", 1)[0].rstrip(":")
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def _parser_message(exc: BaseException) -> str:
    """What aiohttp's parser says went wrong (its first line names it; the rest quotes bytes)."""
    return str(getattr(exc, "message", "") or type(exc).__name__)


@functools.cache
def _parser_errors() -> tuple[type, ...]:
    """An answer that is not HTTP, as aiohttp's parser finds it (bytes after a body, say)."""
    try:
        from aiohttp.http_exceptions import HttpProcessingError
    except ImportError:
        return ()
    return (HttpProcessingError,)


@functools.cache
def _payload_errors() -> tuple[type, ...]:
    """A body cut short, in aiohttp's and botocore's types."""
    found: list[type] = []
    with contextlib.suppress(ImportError):
        import aiohttp
        found.append(aiohttp.ClientPayloadError)
    with contextlib.suppress(ImportError):
        from botocore import exceptions
        found += [exceptions.IncompleteReadError, exceptions.ResponseStreamingError]
    return tuple(found)


@functools.cache
def _connection_errors() -> tuple[type, ...]:
    """A connection refused, reset or dropped, in Python's, aiohttp's and botocore's types."""
    found: list[type] = [ConnectionError]
    with contextlib.suppress(ImportError):
        import aiohttp
        found.append(aiohttp.ClientConnectionError)
    with contextlib.suppress(ImportError):
        from botocore import exceptions
        found += [exceptions.ConnectionError, exceptions.HTTPClientError]
    return tuple(found)
