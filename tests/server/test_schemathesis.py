"""Schemathesis fuzzes every operation of the app's own OpenAPI schema against a live server: no 5xx."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import ADMIN, Server

CLI = Path(sys.executable).parent / "schemathesis"  # installed beside this interpreter by the test extra


@pytest.mark.slow
def test_no_server_errors(tmp_path):
    assert CLI.exists(), f"{CLI} is missing: install the test extra (pip install -e .[test])"
    # a short context bounds how long any generated request can run on the CPU
    server = Server(tmp_path, [tmp_path], ["--max-model-len", "64"])
    try:
        run = subprocess.run(
            [
                str(CLI),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "15",
                "--header",
                f"Authorization: Bearer {ADMIN}",
                "--phases",
                "examples,fuzzing",
                "--request-timeout",
                "120",
                "--generation-deterministic",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-4000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and int(counts.group(1)) > 50 and counts.group(1) == counts.group(2), run.stdout[-4000:]
