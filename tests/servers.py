"""Fixtures of servers on 127.0.0.1 (``shmseq.bench.servers``): ``server`` serves ``tmp_path``
over HTTP, ``web`` is its URL, ``s3`` is moto's S3. A test module imports the ones it uses.

Each stops its server after the test, then fsspec's event loop thread if the test started it
(fsspec never stops it; its HTTP sessions and S3 clients are closed first), and fails the test
if a thread is left."""
from __future__ import annotations

import contextlib
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
