"""One range of a whole-object fetch over HTTP, streamed from the socket into the file with
``http.client`` in the fetching thread (``shmseq.remote.fetch`` for ``http(s)://``, and for
``s3://`` with a request that ``shmseq.remote_sources`` signs); and the head of an object's
answer without its body (``answer_head``: ``shmseq.remote.version`` and ``size``), so that a
process asks its first shard's version without importing fsspec, aiohttp or s3fs.

Why not fsspec: its HTTP and S3 clients run on one event loop thread that receives and copies
every byte, about twice the CPU of a plain GET read with ``readinto`` into a reused buffer (see
docs/streaming.md), taken from the decode workers of a small node.

Kept from the fsspec path: each step of a request (the connection, TLS, the head, each
``window`` bytes of the body) within the attempt's timeout, a ``stop`` event looked at every
``STOP_POLL_S`` while waiting (the connection then closed), redirects followed (as aiohttp: 10
at most, the Authorization header dropped for another origin), https verified with the
system's certificates, an answer checked against the Range asked for before its body is read
(a server that ignores Range answers the first range with the whole object, taken as it
comes), a body cut short or followed by bytes past its end said so with the counts.
"""
from __future__ import annotations

import base64
import dataclasses
import errno
import http.client
import io
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from email.message import Message
from typing import IO, Callable

from .remote_answers import _BadAnswer, _cut, _ranged

STOP_POLL_S = 0.05  # how often a request that can be stopped looks at its stop event
BUFFER_BYTES = 1 << 20  # read from the socket into this much at once, and written from there
MAX_REDIRECTS = 10  # aiohttp's
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_ERROR_BODY_BYTES = 64 << 10  # of an error answer read for its error code (S3's XML)


class FetchStopped(Exception):
    """A fetch ended early because its ``stop`` event was set: not a failure of the server."""


@dataclasses.dataclass(frozen=True)
class Transport:
    """How requests go out: ``headers`` added to each, TLS verified with ``tls`` (None: the
    system's certificates), through the proxy ``proxies`` names for the URL's scheme (None:
    none, or the environment's ``http_proxy``/``https_proxy``/``no_proxy`` where
    ``trust_env``), redirects followed unless ``redirects`` is 0, the URL's path quoted unless
    ``encoded``."""
    headers: tuple[tuple[str, str], ...] = ()
    tls: ssl.SSLContext | None = None
    proxies: tuple[tuple[str, str], ...] | None = None
    trust_env: bool = False
    redirects: int = MAX_REDIRECTS
    encoded: bool = False

    def proxy_for(self, url: str) -> str | None:
        """The proxy a request for ``url`` goes through, if any."""
        parts = urllib.parse.urlsplit(url)
        if self.proxies is not None:
            return dict(self.proxies).get(parts.scheme)
        if not self.trust_env or urllib.request.proxy_bypass(parts.hostname or ""):
            return None
        return urllib.request.getproxies().get(parts.scheme)

    def context(self) -> ssl.SSLContext:
        return self.tls if self.tls is not None else _system_tls()


_system_context: list[ssl.SSLContext] = []


def _system_tls() -> ssl.SSLContext:
    """One context for all requests: loading the system's certificates takes milliseconds."""
    if not _system_context:
        _system_context.append(ssl.create_default_context())
    return _system_context[0]


# what a failed answer is, from its status, head and (a little of) its body: an exception to raise
Refusal = Callable[[int, str, http.client.HTTPMessage, bytes], Exception]


def get_range(url: str, headers: dict[str, str], transport: Transport, refusal: Refusal,
              start: int, chunk: int, out: IO[bytes], timeout: float | None,
              stop: threading.Event | None,
              heads: list[Message] | None = None, whole_object: bool = True) -> tuple[int, bool]:
    """``chunk`` bytes from ``start`` of the object at ``url`` (``headers`` hold its Range,
    and a signature where one is needed) written to ``out``: (bytes written, whether they are
    the whole object); the answer's head added to ``heads``. A 200 to the first range is the
    whole object (a server that ignores Range), taken whatever its size where ``whole_object``
    (a fetch's), else only if it is no more than asked for (a read's); anything else must be
    the bytes asked for."""
    watch = _Watch(timeout, chunk, stop)
    link, answer = _request(url, headers, transport, watch)
    try:
        if answer.status >= 300:
            raise _refused(answer, refusal)
        if heads is not None:
            heads.append(answer.msg)
        whole = whole_object and answer.status == 200 and start == 0
        sized = answer.length if not answer.chunked else None
        expected = sized if whole else _ranged(start, start + chunk, answer.status,
                                               answer.getheader("Content-Range"), sized)
        return _body(answer, expected, sized is not None, out, start, chunk), whole
    finally:
        link.shut()


def answer_head(method: str, url: str, headers: dict[str, str], transport: Transport,
                refusal: Refusal, timeout: float | None, stop: threading.Event | None,
                accepted: frozenset[int] = frozenset()) -> tuple[int, http.client.HTTPMessage]:
    """The status and head of the answer to ``method`` (a HEAD, or a GET whose body is not
    wanted) of ``url``, within ``timeout`` and stopped by ``stop`` as a range is; its body left
    unread, the connection closed. A failed status not in ``accepted`` is raised as
    ``refusal`` makes it."""
    link, answer = _request(url, headers, transport, _Watch(timeout, BUFFER_BYTES, stop), method)
    try:
        if answer.status >= 300 and answer.status not in accepted:
            raise _refused(answer, refusal)
        return answer.status, answer.msg
    finally:
        link.shut()


def _refused(answer: http.client.HTTPResponse, refusal: Refusal) -> Exception:
    """The error of a failed answer, from its head and the start of its body (S3's XML; a
    HEAD's has none)."""
    return refusal(answer.status, answer.reason, answer.msg, answer.read(_ERROR_BODY_BYTES))


def _body(answer: http.client.HTTPResponse, expected: int | None, sized: bool, out: IO[bytes],
          start: int, chunk: int) -> int:
    """The answer's body written to ``out``, ``expected`` bytes (None: until the connection
    ends); its size. A body of a size its head gives (``sized``: no chunked encoding) is read
    from http.client's reader, to find bytes past its end there."""
    buffer = bytearray(BUFFER_BYTES)
    view, came = memoryview(buffer), 0
    reader, limit = (answer.fp, expected) if sized else (answer, None)
    while limit is None or came < limit:
        count = reader.readinto(view if limit is None else view[:min(len(view), limit - came)])
        if not count:
            break
        out.write(view[:count])
        came += count
    if expected is not None and came < expected:
        raise _cut(came, expected)
    if expected is not None and came > expected:
        raise _BadAnswer("failed", f"asked for bytes {start}-{start + chunk} ({chunk:,} bytes), "
                                   f"the server sent {came:,}: more than it announced")
    if sized and (past := _past_the_end(answer.fp)):
        raise _BadAnswer("failed", f"asked for bytes {start}-{start + chunk} ({chunk:,} "
                                   "bytes), the server sent more than its answer announced: "
                                   f"bytes past the end of its body ({past:,} or more); check "
                                   "the server, or a proxy before it")
    return came


def _past_the_end(reader: IO[bytes]) -> int:
    """How many bytes came after the body's end, without waiting for any (one request per
    connection: any are not HTTP)."""
    raw = reader.raw  # type: ignore[attr-defined]
    raw.waits = False
    try:
        return len(reader.peek(1))  # type: ignore[attr-defined]
    finally:
        raw.waits = True


def _request(url: str, headers: dict[str, str], transport: Transport, watch: _Watch,
             method: str = "GET") -> tuple[_Socket, http.client.HTTPResponse]:
    """A ``method`` request of ``url`` and its answer's head, redirects followed; the
    connection's socket (for its caller to shut)."""
    for _ in range(transport.redirects + 1):
        connection, link = _connection(url, transport, watch)
        try:
            parts = urllib.parse.urlsplit(url)
            target = url if connection.host != parts.hostname or (
                transport.proxy_for(url) and parts.scheme == "http") else _target(parts,
                                                                                   transport)
            connection.request(method, target, headers={
                "Host": parts.netloc.rpartition("@")[2], **dict(transport.headers), **headers})
            answer = connection.getresponse()
        except BaseException:
            link.shut()
            raise
        location = answer.getheader("Location")
        if answer.status not in _REDIRECTS or location is None or not transport.redirects:
            return link, answer
        link.shut()
        moved = urllib.parse.urljoin(url, location)
        if _origin(moved) != _origin(url):
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        url = moved
    raise _BadAnswer("failed", f"more than {transport.redirects} redirects (the last to {url})")


def _target(parts: urllib.parse.SplitResult, transport: Transport) -> str:
    """The request's target: the URL's path and query, quoted (as aiohttp's yarl does) unless
    the transport says the URL is already."""
    path, query = parts.path or "/", parts.query
    if not transport.encoded:
        path = urllib.parse.quote(path, safe="/%!$&'()*+,;=:@~")
        query = urllib.parse.quote(query, safe="/%!$&'()*+,;=:@~?")
    return f"{path}?{query}" if query else path


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _connection(url: str, transport: Transport,
                watch: _Watch) -> tuple[http.client.HTTPConnection, _Socket]:
    """A connection for ``url``, made under ``watch``: to its server, or to its proxy (a
    tunnel through it for https), TLS set up for https; and its socket."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _BadAnswer("failed", f"cannot follow {url!r}: not an http(s) URL")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    proxy = transport.proxy_for(url)
    if proxy is None:
        connection = http.client.HTTPConnection(parts.hostname, port)
    else:
        via = urllib.parse.urlsplit(proxy)
        connection = http.client.HTTPConnection(via.hostname or "", via.port or 80)
        auth = _basic(via.username, via.password)
        if https:
            connection.set_tunnel(parts.hostname, port, headers=auth)
        else:
            transport = dataclasses.replace(transport, headers=(*transport.headers,
                                                                *auth.items()))
    # http.client makes its socket with this (a blocking connect could not be stopped)
    connection._create_connection = lambda address, *_: _connect(address, watch)  # type: ignore[attr-defined]
    try:
        connection.connect()  # the tunnel's CONNECT too, within the attempt's timeout
        if https:
            connection.sock = _tls(connection.sock, transport.context(), parts.hostname, watch)
    except BaseException:
        connection.close()
        raise
    connection.sock = link = _Socket(connection.sock, watch)
    return connection, link


def _basic(user: str | None, password: str | None) -> dict[str, str]:
    if user is None:
        return {}
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password or '')}"
    return {"Proxy-Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}


def _connect(address: tuple[str, int], watch: _Watch) -> socket.socket:
    """A TCP connection to ``address``, each of its addresses tried in turn, waited for in
    steps that look at the stop event and the attempt's timeout."""
    failures: list[OSError] = []
    for family, kind, protocol, _, where in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, protocol)
        try:
            sock.setblocking(False)
            code = sock.connect_ex(where)
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            while code in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                wait = watch.wait_s()
                if poller.poll(None if wait is None else wait * 1000):
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, f"{errno.errorcode.get(code, code)} connecting to "
                                    f"{address[0]}:{address[1]}")
            return sock
        except OSError as exc:
            sock.close()
            failures.append(exc)
        except BaseException:
            sock.close()
            raise
    raise failures[0] if failures else OSError(f"no address for {address[0]}")


def _tls(sock: socket.socket, context: ssl.SSLContext, host: str, watch: _Watch) -> ssl.SSLSocket:
    """``sock`` with TLS for ``host``, its handshake waited for in steps as ``_connect``'s."""
    secure = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    while True:
        secure.settimeout(watch.wait_s())
        try:
            secure.do_handshake()
            return secure
        except TimeoutError:
            continue


class _Watch:
    """When the steps of one request must end: ``timeout`` seconds after it began (None: no
    bound), and again after each ``window`` bytes that came in time (so that a whole object
    sent for a range gets, for each range's worth of it, the time a range would); and its
    ``stop`` event, looked at while waiting."""

    def __init__(self, timeout: float | None, window: int, stop: threading.Event | None) -> None:
        self.timeout, self.window, self.stop = timeout, window, stop
        self._came, self._renew_at = 0, window
        self._ends = None if timeout is None else time.monotonic() + timeout

    def wait_s(self) -> float | None:
        """How long the next step may wait (None: as long as it takes); raises once stopped
        (``FetchStopped``) or past the bound (``TimeoutError``)."""
        if self.stop is not None and self.stop.is_set():
            raise FetchStopped("stopped")
        poll = None if self.stop is None else STOP_POLL_S
        if self._ends is None:
            return poll
        left = self._ends - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no bytes within {self.timeout:g} s")
        return left if poll is None else min(left, poll)

    def came(self, count: int) -> None:
        """``count`` bytes more came: a whole window more renews the bound."""
        self._came += count
        if self._came >= self._renew_at and self.timeout is not None:
            self._renew_at = self._came + self.window
            self._ends = time.monotonic() + self.timeout


class _Reader(io.RawIOBase):
    """A socket's bytes for http.client, each read waited for in steps (``_Watch``). Told not
    to wait (``waits`` False), a read takes only what has come (None if nothing has)."""

    def __init__(self, sock: socket.socket, watch: _Watch) -> None:
        super().__init__()
        self.sock, self.watch, self.waits = sock, watch, True

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int | None:  # type: ignore[override]
        if not self.waits:
            return self._ready(buffer)
        while True:
            self.sock.settimeout(self.watch.wait_s())
            try:
                count = self.sock.recv_into(buffer)
            except TimeoutError:
                continue
            self.watch.came(count)
            return count

    def _ready(self, buffer: memoryview) -> int | None:
        self.sock.settimeout(0)
        try:
            return self.sock.recv_into(buffer) or None
        except (BlockingIOError, ssl.SSLWantReadError, OSError):
            return None


class _Socket:
    """A connected socket as http.client uses it, its reads through a ``_Reader``."""

    def __init__(self, sock: socket.socket, watch: _Watch) -> None:
        self._sock, self._watch = sock, watch

    def makefile(self, mode: str, *_: object) -> io.BufferedReader:
        assert mode == "rb", mode
        return io.BufferedReader(_Reader(self._sock, self._watch), 64 << 10)

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._watch.wait_s())
        self._sock.sendall(data)

    def close(self) -> None:
        """Nothing: http.client closes its connection as soon as the head says that the server
        will close it, before the body is read. ``shut`` closes it."""

    def shut(self) -> None:
        self._sock.close()

