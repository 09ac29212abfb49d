"""Servers on 127.0.0.1 for the remote tests and the bench's remote mode: a folder's files over
HTTP with Range requests (``FileServer``) and an S3 endpoint (``S3Server``, moto's S3), each with
a delay added to every request, an optional bandwidth cap, counts of the requests and bytes it
served, and faults on demand (the next requests answer 503, 500 or 403, or reset their
connection)::

    with FileServer("shards", delay=0.03, bandwidth=100e6) as server:
        seq = ShardSequence(f"{server.url}/shards.json", decode, ...)
        ...
        print(server.requests, server.bytes_sent)  # or server.log: one Request each

    with S3Server(delay=0.03) as s3:
        root = s3.upload("shards", "bucket")       # "s3://bucket"
        seq = ShardSequence(f"{root}/shards.json", decode, storage_options=s3.storage_options)

``ServerProcess("http", folder)`` or ``ServerProcess("s3")`` runs either in a process of its own,
as the bench's remote mode does: the server's CPU, memory and interpreter lock are then not the
trainer's, whose CPU and memory the bench measures.

Both are werkzeug's threaded server, one connection per request (werkzeug closes each), with a
request handler that adds the delay, paces what it writes to the cap (shared by all connections)
and counts it. S3 is moto's application on that server rather than moto's own
``ThreadedMotoServer`` (the same werkzeug server), so that S3 gets the delay, cap, counts and
faults too, answered as S3 answers them (a 503 is ``SlowDown``). Needs ``moto[server]`` (werkzeug comes with it).
"""
from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from io import BufferedIOBase
from multiprocessing.connection import Connection
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable

from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.security import safe_join
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler
from werkzeug.utils import send_file
from werkzeug.wsgi import FileWrapper

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from typing_extensions import Self

# a fault: an HTTP status, with the code and message S3 answers it with; or "reset"
FAULTS = {"500": ("InternalError", "We encountered an internal error. Please try again."),
          "503": ("SlowDown", "Please reduce your request rate."),
          "403": ("AccessDenied", "Access Denied"), "reset": None}
PACE_BYTES = 64 << 10  # the bandwidth cap is kept write by write, at most this much at a time
FILE_BLOCK_BYTES = 1 << 20  # a file's body is read in blocks of this (werkzeug's own: 8 KiB,
# which cost the server, on the loader's cores, 1.5-1.9 ms of CPU a MB)


@dataclass
class Request:
    """One request as the server saw it: ``sent`` counts the bytes of its answer's body;
    ``began`` and ``ended`` (once answered) are ``time.monotonic()``'s."""
    method: str
    path: str
    range: str | None
    fault: str | None = None
    sent: int = 0
    began: float = field(default_factory=time.monotonic)
    ended: float | None = None


class ShapedServer:
    """A WSGI ``app`` served on 127.0.0.1 (``url``) from threads of its own until ``stop()``:
    ``delay`` seconds before each answer, at most ``bandwidth`` bytes/s over all answers (None:
    no cap), each request logged in ``log``."""

    def __init__(self, app: WSGIApplication, *, delay: float = 0.0,
                 bandwidth: float | None = None) -> None:
        if delay < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError(f"delay must be >= 0 and bandwidth > 0 bytes/s or None, got "
                             f"delay={delay!r}, bandwidth={bandwidth!r}")
        self.delay, self.bandwidth = delay, bandwidth
        self.log: list[Request] = []
        self._faults: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the capped link is free for the next write
        self.stopping = threading.Event()
        self._server = _Server(app, self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="test-server", daemon=True)
        self._thread.start()

    @property
    def requests(self) -> int:
        return len(self.log)

    @property
    def bytes_sent(self) -> int:
        """Bytes of the answers' bodies (headers left out)."""
        return sum(request.sent for request in self.log)

    def clear_log(self) -> None:
        """Count from zero (after uploads, say)."""
        self.log.clear()

    def fail_next(self, count: int, fault: str = "503") -> None:
        """The next ``count`` requests fail: ``'503'``, ``'500'`` or ``'403'`` answer with that
        status (on ``S3Server``, as S3 does: SlowDown, InternalError, AccessDenied), ``'reset'``
        resets the connection without an answer."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(map(repr, FAULTS))}, got {fault!r}")
        with self._lock:
            self._faults.extend([fault] * count)

    def begin(self, method: str, path: str, asked: str | None) -> Request:
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        request = Request(method, path, asked, fault)
        self.log.append(request)
        return request

    def pace(self, size: int) -> None:
        """Wait until ``size`` more bytes fit under the bandwidth cap."""
        if self.bandwidth is None:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + size / self.bandwidth
            until = self._free_at
        if self.stopping.wait(until - now):
            raise ConnectionAbortedError("the server is stopping")

    def fault_body(self, status: str) -> tuple[str, bytes]:
        """(content type, body) of a fault's answer."""
        return "text/plain", f"{HTTPStatus(int(status)).phrase}\n".encode()

    def stop(self) -> None:
        """Stop serving; requests in flight are cut short, their threads joined."""
        self.stopping.set()
        self._server.shutdown()
        self._thread.join(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FileServer(ShapedServer):
    """The files under ``directory`` over HTTP, ``Range: bytes=a-b`` answered with 206 (416 past
    the end), HEAD with the size."""

    def __init__(self, directory: str | os.PathLike, **shaping: Any) -> None:
        self.directory = os.fspath(directory)
        super().__init__(self._app, **shaping)

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = safe_join(self.directory, environ["PATH_INFO"].lstrip("/"))
        environ["wsgi.file_wrapper"] = _in_large_blocks
        response: WSGIApplication
        try:
            if path is None or not os.path.isfile(path):
                raise NotFound()
            response = send_file(path, environ, mimetype="application/octet-stream",
                                 conditional=True, etag=False, max_age=None)
        except HTTPException as answer:  # 404, and 416 for a range past the end
            response = answer
        return response(environ, start_response)


def _in_large_blocks(file: IO[bytes], buffer_size: int = 8192) -> FileWrapper:
    """A file's body as the server's writes take it: ``FILE_BLOCK_BYTES`` at a time."""
    return FileWrapper(file, FILE_BLOCK_BYTES)


class S3Server(ShapedServer):
    """moto's S3 on 127.0.0.1; ``storage_options`` point s3fs at it. Its state (buckets and
    objects, kept in this process by moto) is cleared by ``stop()``."""

    REGION = "us-east-1"

    def __init__(self, **shaping: Any) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        super().__init__(DomainDispatcherApplication(create_backend_app), **shaping)

    @property
    def storage_options(self) -> dict:
        """For s3fs (``storage_options=``): this endpoint, moto's test credentials."""
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.url, "region_name": self.REGION}}

    def fault_body(self, status: str) -> tuple[str, bytes]:
        fault = FAULTS[status]
        assert fault is not None  # a status's, not a reset's
        code, message = fault
        return "application/xml", (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}'
                                   f"</Code><Message>{message}</Message></Error>").encode()

    def upload(self, folder: str | os.PathLike[str], bucket: str) -> str:
        """Every file under ``folder`` into a new ``bucket``, at its path relative to the folder;
        the bucket's URL (``s3://bucket``). The uploads are not left in the log."""
        import boto3
        client = boto3.client("s3", endpoint_url=self.url, region_name=self.REGION,
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        try:
            client.create_bucket(Bucket=bucket)
            for root, _, files in os.walk(folder):
                for name in files:
                    path = os.path.join(root, name)
                    key = os.path.relpath(path, folder).replace(os.sep, "/")
                    client.upload_file(path, bucket, key)
        finally:
            client.close()
        self.clear_log()
        return f"s3://{bucket}"

    def stop(self) -> None:
        from moto.core.base_backend import BackendDict
        from moto.core.model_instances import reset_model_data
        super().stop()
        BackendDict.reset()
        reset_model_data()


class ServerProcess:
    """A ``FileServer`` of ``directory`` (``kind`` "http") or an ``S3Server`` ("s3") in a forked
    process of its own, with ``shaping`` (``delay``, ``bandwidth``), until ``stop()``: ``url``,
    ``storage_options`` (S3's; None for HTTP), ``upload``, ``clear_log`` and ``counts`` as the
    server's, each a message to that process."""

    KINDS = ("http", "s3")

    def __init__(self, kind: str, directory: str | os.PathLike | None = None,
                 **shaping: Any) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, self.KINDS))}, got {kind!r}")
        context = multiprocessing.get_context("fork")
        self._pipe, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, kind, directory, shaping),
                                       name=f"shmseq-bench-{kind}-server", daemon=True)
        self.process.start()
        theirs.close()
        try:
            self.url, self.storage_options = self._answer()
        except BaseException:
            self.process.join()
            raise

    def _answer(self) -> Any:
        ok, value = self._pipe.recv()
        if not ok:
            raise value
        return value

    def _call(self, name: str, *args: object) -> Any:
        self._pipe.send((name, args))
        return self._answer()

    def upload(self, folder: str | os.PathLike, bucket: str) -> str:
        """``S3Server.upload``: the bucket's URL."""
        return self._call("upload", os.fspath(folder), bucket)

    def clear_log(self) -> None:
        self._call("clear_log")

    def counts(self) -> tuple[int, int]:
        """(requests, bytes sent) since the log was cleared."""
        return self._call("counts")

    def stop(self) -> None:
        """Stop the server, and its process."""
        if self.process.is_alive():
            self._call("stop")
        self.process.join()
        self._pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_COMMANDS: dict[str, Callable[..., object]] = {
    "upload": lambda server, folder, bucket: server.upload(folder, bucket),
    "clear_log": lambda server: server.clear_log(),
    "counts": lambda server: (server.requests, server.bytes_sent)}


def _serve(pipe: Connection, kind: str, directory: str | os.PathLike | None,
           shaping: dict) -> None:
    """A ``ServerProcess``'s process: starts the server, answers each message until "stop"."""
    try:
        server: ShapedServer
        if kind == "http":
            assert directory is not None, "an HTTP server serves a folder"
            server = FileServer(directory, **shaping)
        else:
            server = S3Server(**shaping)
    except Exception as exc:  # noqa: BLE001 - raised again in the parent
        pipe.send((False, exc))
        return
    try:
        pipe.send((True, (server.url, getattr(server, "storage_options", None))))
        while (message := pipe.recv())[0] != "stop":
            name, args = message
            try:
                pipe.send((True, _COMMANDS[name](server, *args)))
            except Exception as exc:  # noqa: BLE001 - raised again in the parent
                pipe.send((False, exc))
    finally:
        server.stop()
    pipe.send((True, None))


def stop_fsspec_io(asyn: ModuleType) -> None:
    """Stop fsspec's event loop thread (``fsspecIO``, a daemon thread it starts for its HTTP and
    S3 clients and never stops; it has no public call for this): close the clients on it, forget
    the file systems made with it, stop it and its executor's threads, and let fsspec start a
    fresh one when asked. ``asyn``: ``fsspec.asyn``."""
    from fsspec.implementations.http import HTTPFileSystem
    loop, thread = asyn.loop[0], asyn.iothread[0]
    for fs in list(HTTPFileSystem._cache.values()):
        if fs._session is not None:
            asyn.sync(loop, fs._session.close)
    HTTPFileSystem.clear_instance_cache()
    with contextlib.suppress(ImportError):
        from s3fs import S3FileSystem
        for fs in list(S3FileSystem._cache.values()):
            if fs._s3creator is not None:
                asyn.sync(loop, fs._s3creator.__aexit__, None, None, None)
        S3FileSystem.clear_instance_cache()
    asyn.sync(loop, loop.shutdown_default_executor)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    if thread.is_alive():
        raise RuntimeError("fsspec's IO thread did not stop within 10 s of its loop's stop")
    loop.close()
    asyn.reset_lock()


class _Server(ThreadedWSGIServer):
    """werkzeug's threaded server, its request threads joined when it closes; it logs errors
    only."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, app: WSGIApplication, shaped: ShapedServer) -> None:
        self.shaped = shaped
        super().__init__("127.0.0.1", 0, app, handler=_Handler)

    def log(self, type: str, message: str, *args: object) -> None:
        if type == "error":
            super().log(type, message, *args)


class _Handler(WSGIRequestHandler):
    """The delay, the faults, the cap and the counts around werkzeug's handling of a request."""

    server: _Server

    def setup(self) -> None:
        super().setup()
        # the type ignored: werkzeug only writes to it, flushes and closes it
        self.wfile = self.paced = _Paced(self.wfile, self.server.shaped)  # type: ignore[assignment]

    def run_wsgi(self) -> None:
        shaped = self.server.shaped
        self.paced.request = request = shaped.begin(self.command, self.path,
                                                    self.headers.get("Range"))
        try:
            if shaped.stopping.wait(shaped.delay):
                self.close_connection = True
            elif request.fault == "reset":
                self._reset()
            elif request.fault is not None:
                self._fail(request.fault)
            else:
                super().run_wsgi()
        finally:
            request.ended = time.monotonic()

    def _reset(self) -> None:
        """Close the connection with a TCP reset (linger 0), leaving the request unanswered."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.connection.close()
        self.close_connection = True

    def _fail(self, status: str) -> None:
        content_type, body = self.server.shaped.fault_body(status)
        self.send_response(int(status))
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    def end_headers(self) -> None:
        self.paced.counting = False
        super().end_headers()
        self.paced.counting = True

    def log_request(self, *args: object) -> None:
        pass


class _Paced:
    """A request handler's socket writer: writes paced to the server's cap, the body counted."""

    def __init__(self, raw: BufferedIOBase, shaped: ShapedServer) -> None:
        self.raw, self.shaped = raw, shaped
        self.request: Request | None = None
        self.counting = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        for begin in range(0, len(view), PACE_BYTES):
            piece = view[begin:begin + PACE_BYTES]
            self.shaped.pace(len(piece))
            if self.counting and self.request is not None:
                self.request.sent += len(piece)  # before the client can have it
            self.raw.write(piece)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed
