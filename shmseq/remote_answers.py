"""What a remote request's answer is (``shmseq.remote`` makes the requests): the bytes asked
for, or a failure judged transient or not and worded for the user.

An HTTP range is asked on fsspec's session and its answer checked against its status and
Content-Range (``_http_range``, ``_ranged``): fsspec's ``cat_file`` hands back whatever body
came. A fetch's range (``shmseq.remote_stream``, checked by ``_ranged`` too) takes a 200 with
the whole object as well, whatever its size: a server that ignores Range (``python -m
http.server``, some CDNs and proxies) serves a node cache's fetches, though not a read of part
of an object (``RangeIgnored``). A failure is sorted by ``_judge`` and raised by ``_failure``,
naming the URL once.

Transient (retried): a connection refused, reset or dropped (a server restarting; refused is
retried too, since a worker process that never reached the server yet cannot tell a restart
from a wrong port), a body cut short (the connection closed before Content-Length bytes came),
a timeout, HTTP 408, 429 and 5xx, S3's SlowDown, InternalError, ServiceUnavailable and
RequestTimeout. Not transient (raised at once): a missing object (``FileNotFoundError``: 404,
NoSuchKey), access denied (``PermissionError``: 401, 403, AccessDenied), an answer that is not
the bytes asked for (HTTP checks the status and Content-Range: a range answered short, more
bytes than asked or than announced; a Range ignored, ``RangeIgnored``), any other answer. After
the last attempt: ``TimeoutError``, ``ConnectionError`` or ``OSError``. Every error names the
URL once, what happened (counts of bytes, never the bytes), the attempts and the time they took.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import http.client
import re
from email.message import Message
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from .remote_policy import RemotePolicy

if TYPE_CHECKING:
    from aiohttp import ClientResponse, ClientResponseError

RETRIED_STATUS = frozenset({408, 429})  # and every 5xx
RETRIED_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                           "Throttling", "ThrottlingException"})
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                          "ExpiredToken", "AllAccessDisabled", "403"})
TRANSIENT = ("busy", "timeout", "connection", "cut")
MESSAGE_CHARS = 200  # of a library's error text quoted in a message: its first line, at most this


class _BadAnswer(Exception):
    """An answer that is not what was asked for, as ``_judge`` sorts it (``kind``). Its message
    says what came, in counts (never the bytes), and not the URL, which ``_failure`` adds."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RangeIgnored(OSError):
    """A server answered a range of an object with the whole object: it ignores Range requests,
    which reading part of an object needs (a fetch of the whole object does not). ``answer``
    says what came, without the URL or what to do, for a caller that says what to do in its
    own terms (the shard reader: its node cache)."""

    def __init__(self, url: str, answer: str) -> None:
        super().__init__(f"{url}: {answer}: reading part of an object needs a server that "
                         "honours Range requests")
        self.url, self.answer = url, answer

    def __reduce__(self) -> tuple:
        return RangeIgnored, (self.url, self.answer)


class StatusAnswer(Exception):
    """An HTTP answer with an error status (``shmseq.remote_stream``'s requests): ``code`` and
    ``message`` are an S3 error's, read from its body, else None."""

    def __init__(self, status: int, reason: str, code: str | None = None,
                 message: str | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}".rstrip())
        self.status, self.reason, self.code, self.message = status, reason, code, message


@contextlib.asynccontextmanager
async def _http_get(fs: Any, path: str, start: int,
                    end: int) -> AsyncIterator[ClientResponse]:
    """The answer to ``Range: bytes=start-(end - 1)`` on fsspec's session with its options, for
    the block to read its body: a 404 raised as
    ``FileNotFoundError``, another error status as aiohttp raises it, and bytes past the end of
    a body (aiohttp's parser finds them) said so, counted and never quoted."""
    from aiohttp import ClientResponseError
    options = dict(fs.kwargs)
    options["headers"] = {**options.get("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    try:
        answer = await session.get(getattr(fs, "encode_url", str)(path), **options)
        async with answer:
            if answer.status == 404:
                raise FileNotFoundError(errno.ENOENT, "not found", path)
            answer.raise_for_status()
            yield answer
    except ClientResponseError as exc:
        parsed = [link for link in _chain(exc) if isinstance(link, _parser_errors())]
        if not parsed:
            raise
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({end - start:,} bytes), the "
                                   "server sent more than its answer announced: bytes past the "
                                   "end of its body, which is not HTTP "
                                   f"({_first_line(_parser_message(parsed[0]))}); check the "
                                   "server, or a proxy before it") from exc


async def _http_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``start`` to ``end`` over HTTP, checked against the answer's status and
    Content-Range: fsspec's ``cat_file`` hands back whatever body came, so that a server that
    ignores Range, or answers a range short, would pass for an object that ends early (and a
    shard reader then contradict itself). Bounded by the caller's timeout."""
    async with _http_get(fs, path, start, end) as answer:
        return await _range_body(answer, start, end)


async def _range_body(answer: ClientResponse, start: int, end: int) -> bytes:
    """The bytes asked for from an answer to a range (``_ranged`` checks them); a 200 that is
    not the whole object from its start within the bytes asked for is refused before its body
    is read: a server that ignores Range would send a whole shard for each sample."""
    size = answer.content_length
    if answer.status == 200 and (start > 0 or (size is not None and size > end - start)):
        raise _ignored(start, end, size)
    parts: list[bytes] = []
    await _body(answer, parts.append)
    body = b"".join(parts)
    _ranged(start, end, answer.status, answer.headers.get("Content-Range"), len(body))
    return body


async def _body(answer: ClientResponse, write: Callable[[bytes], object]) -> int:
    """The answer's body to ``write`` as it comes; its size. One cut short (the connection
    closed before Content-Length bytes came) is said so, with the counts."""
    from aiohttp import ClientPayloadError
    came = 0
    try:
        while piece := await answer.content.readany():
            write(piece)
            came += len(piece)
    except ClientPayloadError as exc:
        raise _cut(came, answer.content_length) from exc
    return came


def _cut(came: int, told: int | None) -> _BadAnswer:
    """A body that ended after ``came`` of the ``told`` bytes its answer announced."""
    of = "" if told is None else f" of the {told:,}"
    return _BadAnswer("cut", f"the connection closed after {came:,}{of} bytes of its answer's body")


def _ignored(start: int, end: int, size: int | None) -> _BadAnswer:
    """A range answered with the whole object (of ``size`` bytes, if the answer said)."""
    whole = "the whole object" if size is None else f"the whole object, {size:,} bytes"
    return _BadAnswer("ignored", f"the server ignored the Range request for bytes {start}-{end} "
                                 f"(it answered 200 with {whole})")


def _ranged(start: int, end: int, status: int, content_range: str | None,
            size: int | None) -> int:
    """Whether an answer to ``Range: bytes=start-(end - 1)`` holds the bytes asked for, from
    its status, Content-Range and ``size`` (its body's, or what it announced; None: not said),
    raised unless it does; the size its body must have. A 206 whose Content-Range says it holds
    them, or as many as the object has; a 200 from the object's start (a server that ignores
    Range) only where it holds the whole object, fewer bytes than asked."""
    asked = end - start
    if status == 200:
        if start == 0 and size is not None and size <= asked:
            return size  # the whole object, which ends before ``end``
        raise _ignored(start, end, size)
    span = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range or "")
    if status != 206 or span is None or int(span[1]) != start or (
            size is not None and int(span[2]) + 1 - start != size):
        sent = "a body of unsaid size" if size is None else f"{size:,} bytes"
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes), the "
                                   f"server answered {status} with {sent} and "
                                   f"Content-Range {content_range or 'none'}: not the bytes "
                                   "asked for; check the server, or a proxy before it")
    total = None if span[3] == "*" else int(span[3])
    size = int(span[2]) + 1 - start
    if size > asked:
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes), the "
                                   f"server sent {size:,}: more than asked")
    if size < asked and (total is None or start + size < total):
        of = "" if total is None else f" of an object of {total:,} bytes"
        raise _BadAnswer("failed", f"asked for bytes {start}-{end} ({asked:,} bytes){of}, the "
                                   f"server sent only {size:,}: it answers ranges short; "
                                   "serve the shards from one that answers them whole")
    return size


def _whole_size(asked: int, status: int, head: Message) -> int:
    """An object's size from the answer (``status``, ``head``) to a GET of its first byte,
    asked where the server answered HEAD with ``asked`` and no size: the total of its
    Content-Range (206; 416 for an empty object), or the Content-Length of a 200 (a server
    that ignores Range; its body is not read). Raised where it says neither."""
    span = re.fullmatch(r"bytes (?:\d+-\d+|\*)/(\d+)", head.get("Content-Range") or "")
    if status in (206, 416) and span is not None:
        return int(span[1])
    if status == 200 and head.get("Content-Length") is not None:
        return int(head["Content-Length"])
    said = f"refused HEAD ({asked})" if asked >= 300 else "answered HEAD without Content-Length"
    raise _BadAnswer("failed", f"the server does not say the object's size: it {said}, and "
                               f"answered a GET of its first byte with {status} and no "
                               "Content-Range with the size (nor a Content-Length); serve the "
                               "shards from a server that says either")


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
    if kind == "ignored":
        return RangeIgnored(url, cause)
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
    ``ignored`` (a range answered with the whole object), ``busy``, ``timeout``, ``connection``,
    ``cut`` (the last four transient) or ``failed``.
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
        if isinstance(link, _parser_errors()) and not isinstance(link, ConnectionError):
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
    """(kind, cause) of an HTTP status (``StatusAnswer``, aiohttp's ``ClientResponseError``) or
    an S3 error code (botocore's ``ClientError``, ``StatusAnswer``) that ``exc`` carries; None
    for any other exception."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return _by_code(str(response["Error"].get("Code", "")), status,
                        response["Error"].get("Message", ""))
    if isinstance(exc, StatusAnswer):
        if exc.code:
            return _by_code(exc.code, exc.status, exc.message or "")
        return _by_status(exc.status, str(exc))
    if isinstance(exc, _http_errors()):
        return _by_status(exc.status, f"HTTP {exc.status} {exc.message}".rstrip())
    return None


def _by_code(code: str, status: int, message: str) -> tuple[str, str]:
    """(kind, cause) of an S3 error answer."""
    cause = f"{code} ({status}): {message}".rstrip(": ")
    if code in MISSING_CODES:
        return "missing", cause
    if code in DENIED_CODES:
        return "denied", cause
    if code in RETRIED_CODES:
        return "busy", cause
    return _by_status(status, cause)


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
    """An answer that is not HTTP, as aiohttp's parser finds it (bytes after a body, say), or
    http.client's (a connection closed before any answer is one too, judged as such)."""
    try:
        from aiohttp.http_exceptions import HttpProcessingError
    except ImportError:
        return (http.client.HTTPException,)
    return (HttpProcessingError, http.client.HTTPException)


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
