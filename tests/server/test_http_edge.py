"""Connection floods against a real server process: /health answers within a second while ~1,100 connections that
trickle a request head or send nothing are held (the server started under the common default of 1,024
descriptors, which it raises itself), and the server closes each of them once the request head is late."""

from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.servers import Server

HEAD_TIMEOUT = 4.0
BODY_TIMEOUT = 3.0
FLOOD = 1100


@contextmanager
def _soft_descriptor_limit(limit: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE set to ``limit`` meanwhile (a child started inside inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * FLOOD + 256:
        pytest.skip(f"the hard descriptor limit ({hard}) is too low for {FLOOD} connections")
    root = tmp_path_factory.mktemp("http-edge")
    with _soft_descriptor_limit(1024):  # what the server starts with
        s = Server(
            root,
            [root],
            [
                "--request-head-timeout",
                str(HEAD_TIMEOUT),
                "--request-body-timeout",
                str(BODY_TIMEOUT),
                "--allow-anonymous",
            ],
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * FLOOD + 256), hard))  # the test's own sockets
    yield s
    s.stop()


def _open(server: Server, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def _health_latency(server: Server) -> float:
    start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    return time.monotonic() - start


def _closed_by_server(socks: list[socket.socket], within: float) -> int:
    """How many of ``socks`` the server closes (EOF or reset) within ``within`` seconds."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + within
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.5):
            sock = key.fileobj
            try:
                data = sock.recv(65536)  # type: ignore[union-attr]
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data:
                selector.unregister(sock)
                closed += 1
    selector.close()
    return closed


def test_health_answers_while_silent_and_trickling_connections_are_held(server):
    silent = _open(server, FLOOD // 2)
    trickling = _open(server, FLOOD - FLOOD // 2)
    try:
        worst = 0.0
        for i, part in enumerate((b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n")):
            for sock in trickling:
                sock.send(part)  # a head that never ends
            worst = max(worst, _health_latency(server))
            if i < 2:
                time.sleep(1)
        assert worst < 1.0, f"/health took {worst:.2f} s"  # a liveness bound
        # every flooding connection is closed by the server once its head is late (nothing answered)
        assert _closed_by_server(silent + trickling, within=HEAD_TIMEOUT + 10) == FLOOD
        assert _health_latency(server) < 1.0
    finally:
        for sock in silent + trickling:
            sock.close()


@pytest.mark.slow
def test_an_idle_kept_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.setblocking(False)
        assert _closed_by_server([sock], within=HEAD_TIMEOUT + 10) == 1


def test_a_body_that_stops_arriving_is_cut(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
        sock.setblocking(False)
        assert _closed_by_server([sock], within=BODY_TIMEOUT + 10) == 1
    assert _health_latency(server) < 1.0
