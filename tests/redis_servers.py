"""Real ``redis-server`` processes for the tests (``bash .ci/setup --tests`` installs the binary; the tests fail
without it), each on a free port of 127.0.0.1 with its files in a directory of the test's."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(workdir: Path, port: int, *options: str) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:``port`` with its files in ``workdir`` and ``options``, once it answers PING."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is missing: the test set-up installs it (bash .ci/setup --tests)"
    log_path = workdir / f"redis-{port}.log"
    with log_path.open("a") as log:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), *options],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"redis-server exited with {server.returncode}: {log_path.read_text()}")
            try:
                if client.ping():
                    return server
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    server.kill()
                    raise
                time.sleep(0.02)
    finally:
        client.close()


def stop_redis(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=10)
