"""Real ``redis-server`` processes for the tests (``bash .ci/setup --tests`` installs the binary; the tests fail
without it), each on a free port of 127.0.0.1 with its files in a directory of the test's."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
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


def refuse_writes(client: redis.Redis, mode: str, snapshots: Path) -> Callable[[], object]:
    """Make a redis-server refuse writes with ``mode``'s error reply (READONLY, OOM, MISCONF, NOREPLICAS); returns
    what makes it take them again. MISCONF removes ``snapshots``, the server's --dir (empty): a snapshot then fails,
    and the server refuses to stop while its save points are set (the undo clears them)."""
    if mode == "READONLY":  # a replica of a master that is not there: it keeps its data and serves reads
        client.replicaof("127.0.0.1", str(free_port()))
        client.config_set("replica-read-only", "yes")
        return lambda: client.replicaof("NO", "ONE")
    if mode == "OOM":
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        return lambda: client.config_set("maxmemory", "0")
    if mode == "MISCONF":  # a snapshot that fails (its directory is gone) stops writes while save points exist
        client.config_set("save", "3600 1")
        client.config_set("stop-writes-on-bgsave-error", "yes")
        snapshots.rmdir()
        client.bgsave()
        deadline = time.monotonic() + 10
        while client.info("persistence")["rdb_last_bgsave_status"] != "err":
            assert time.monotonic() < deadline, "the snapshot did not fail"
            time.sleep(0.05)
        return lambda: client.config_set("save", "")
    assert mode == "NOREPLICAS"
    client.config_set("min-replicas-to-write", "1")
    return lambda: client.config_set("min-replicas-to-write", "0")
