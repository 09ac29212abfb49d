"""Fixtures of servers on 127.0.0.1 (``shmseq.bench.servers``): ``server`` serves ``tmp_path``
over HTTP, ``web`` is its URL, ``s3`` is moto's S3. A test module imports the ones it uses.
``RawServer`` (in ``serving(lambda _: RawServer(folder, fault))``) answers as a faulty server
does: it stalls, cuts a body short, ignores Range, answers short, or sends bytes after a body.
``PlainServer`` is Python's own ``http.server`` (``python -m http.server``), which ignores Range
and streams whole files from disk: what a large shard from such a server takes.

Each stops its server after the test, then fsspec's event loop thread if the test started it
(fsspec never stops it; its HTTP sessions and S3 clients are closed first), and fails the test
if a thread is left."""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import socket
import socketserver
import sys
import threading

import pytest


@contextlib.contextmanager
def serving(start):
    """The server that ``start(shmseq.bench.servers)`` makes, stopped after the block with what
    the block started."""
    asyn = pytest.importorskip("fsspec.asyn")
    pytest.importorskip("aiohttp")
    servers = pytest.importorskip("shmseq.bench.servers")  # needs werkzeug
    threads = set(threading.enumerate())
    served = start(servers)
    try:
        yield served
    finally:
        served.stop()
        if asyn.iothread[0] is not None and asyn.iothread[0] not in threads:
            servers.stop_fsspec_io(asyn)
    left = [thread.name for thread in set(threading.enumerate()) - threads]
    assert not left, f"threads left behind: {left}"


@pytest.fixture
def server(tmp_path):
    """A ``FileServer`` of ``tmp_path``."""
    with serving(lambda servers: servers.FileServer(tmp_path)) as served:
        yield served


@pytest.fixture
def web(server):
    """The base URL of an HTTP server of ``tmp_path`` on 127.0.0.1."""
    return server.url


@pytest.fixture
def s3():
    """An ``S3Server`` (moto's S3), with s3fs to read it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.moto_server.werkzeug_app")
    with serving(lambda servers: servers.S3Server()) as served:
        yield served


class RawServer:
    """The files under ``folder`` over HTTP/1.1 on 127.0.0.1 (``url``), written on sockets so
    that a request can be answered as no well-behaved server answers it. ``fault`` applies to
    the requests whose path ends with ``only`` (the shards, say, not their index):

    * ``"stall"``: the connection is accepted and the request read, then nothing is sent;
    * ``"stall-ranges"``: so for a Range request from a byte past 0 (a reader's range of a
      sample; a whole fetch's first range is answered);
    * ``"cut"``: the body stops halfway through what Content-Length announced, and the
      connection closes;
    * ``"whole"``: a Range request is answered 200 with the whole object (Range ignored);
    * ``"short"``: 206 with the first half of the bytes asked for (Content-Range says so);
    * ``"extra"``: 206 as asked, then ``EXTRA`` bytes more after the body;
    * None: every request answered as it should be (HEAD, GET, ``Range: bytes=a-b``).

    ``stop()`` closes every connection, a stalled one too, and joins the threads that served
    them."""

    EXTRA = bytes(range(256)) * 4

    def __init__(self, folder, fault: str | None = None, only: str = "") -> None:
        assert fault in (None, "stall", "stall-ranges", "cut", "whole", "short", "extra"), fault
        self.folder, self.fault, self.only = os.fspath(folder), fault, only
        self.stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server = _RawTCPServer(("127.0.0.1", 0), _RawHandler)
        self._server.raw = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="test-raw-server")
        self._thread.start()

    def answer(self, method: str, path: str, headers: dict[str, str]) -> bytes | None:
        """The bytes to send for one request (None: send nothing, close); waits while stalled."""
        fault = self.fault if path.endswith(self.only) else None
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("range", ""))
        if fault == "stall" or (fault == "stall-ranges" and asked and int(asked[1]) > 0):
            self.stopping.wait()
            return None
        file = os.path.join(self.folder, path.lstrip("/"))
        if not os.path.isfile(file):
            return _head(404, "Not Found", 0)
        with open(file, "rb") as opened:
            data = opened.read()
        if method == "HEAD":
            return _head(200, "OK", len(data))
        if asked is None or fault == "whole":
            return _head(200, "OK", len(data)) + data
        start = int(asked[1])
        end = min(int(asked[2]) + 1 if asked[2] else len(data), len(data))
        if start >= len(data):
            return _head(416, "Range Not Satisfiable", 0, f"bytes */{len(data)}")
        if fault == "short":
            end = start + (end - start) // 2
        body = data[start:end]
        head = _head(206, "Partial Content", len(body), f"bytes {start}-{end - 1}/{len(data)}")
        if fault == "cut":
            return head + body[:len(body) // 2]
        return head + body + (self.EXTRA if fault == "extra" else b"")

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()  # joins the connections' threads
        self._thread.join(10)

    def track(self, connection: socket.socket, live: bool) -> None:
        with self._lock:
            (self._connections.add if live else self._connections.discard)(connection)


class PlainServer:
    """The files under ``folder`` as ``python -m http.server`` serves them, on 127.0.0.1
    (``url``): every GET answered 200 with the whole file, streamed from disk (Range ignored).
    ``pace``: seconds waited after each ``PIECE`` bytes of a body (a slow link, or with a long
    wait a stall, cut short by ``stop()``). ``log`` holds (method, path, Range header) of each
    request."""

    PIECE = 4096

    def __init__(self, folder, pace: float | None = None) -> None:
        self.log: list[tuple[str, str, str | None]] = []
        self.pace = pace
        self.stopping = threading.Event()
        handler = functools.partial(_PlainHandler, self, directory=os.fspath(folder))
        self._server = _PlainHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="test-plain-server")
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()  # joins the connections' threads
        self._thread.join(10)


class _PlainHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = False  # joined by server_close

    def handle_error(self, request, client_address) -> None:
        """A client that closes before the whole file was sent (a stopped fetch) is no error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _PlainHandler(http.server.SimpleHTTPRequestHandler):
    """``http.server``'s handler, each request logged and not printed, its body paced."""

    def __init__(self, plain: PlainServer, *args, **kwargs) -> None:
        self.plain = plain
        super().__init__(*args, **kwargs)

    def send_head(self):
        self.plain.log.append((self.command, self.path, self.headers.get("Range")))
        return super().send_head()

    def copyfile(self, source, outputfile) -> None:
        if self.plain.pace is None:
            return super().copyfile(source, outputfile)
        while (piece := source.read(self.plain.PIECE)) and not self.plain.stopping.is_set():
            outputfile.write(piece)
            outputfile.flush()
            self.plain.stopping.wait(self.plain.pace)

    def log_message(self, format, *args) -> None:
        pass


def _head(status: int, phrase: str, length: int, content_range: str | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} {phrase}", f"Content-Length: {length}",
             "Content-Type: application/octet-stream", "Accept-Ranges: bytes"]
    if content_range is not None:
        lines.append(f"Content-Range: {content_range}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _RawTCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = False
    block_on_close = True
    request_queue_size = 128  # socketserver's 5 drops connections of a burst: a client then
    # waits a second or more to try again, which a test of deadlines reads as a stall
    raw: RawServer


class _RawHandler(socketserver.StreamRequestHandler):
    """One connection: its requests answered in turn until the client or the server closes it
    (after a fault that ends the answer early)."""

    server: _RawTCPServer

    def handle(self) -> None:
        raw = self.server.raw
        raw.track(self.connection, True)
        try:
            while not raw.stopping.is_set():
                request = self._request()
                if request is None:
                    return
                answer = raw.answer(*request)
                if answer is None:
                    return
                self.wfile.write(answer)
                self.wfile.flush()
                if raw.fault == "cut" and request[1].endswith(raw.only):
                    return
        except OSError:
            return  # the client went, or the server is stopping
        finally:
            raw.track(self.connection, False)

    def _request(self) -> tuple[str, str, dict[str, str]] | None:
        line = self.rfile.readline().decode("latin-1")
        if not line.strip():
            return None
        method, path, _ = line.split(" ", 2)
        headers = {}
        while (header := self.rfile.readline().decode("latin-1").strip()):
            name, _, value = header.partition(":")
            headers[name.strip().lower()] = value.strip()
        return method, path, headers
