"""lora-server bench-staging at small counts: it registers, resolves and stages what it says, at Llama-3-8B's sizes
(the file sizes by hand), and writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# rank 8 on q (4096 -> 4096) and v (4096 -> 1024) of 32 layers, bf16: 32 x 8 x (4096 + 4096 + 4096 + 1024) x 2
QV_BYTES = 32 * 8 * (4096 + 4096 + 4096 + 1024) * 2


@pytest.mark.slow
def test_bench_staging_runs_at_small_counts(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "lora_server.cli", "bench-staging", "--shapes", "6.6MB", "--registered", "6"]
    cmd += ["--staged", "4", "--resolutions", "3", "--workers", "2", "--tmp", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["registered"], row["staged"], row["register_threads"]) == (6, 4, 2)
    assert QV_BYTES < row["file_bytes"] < QV_BYTES + 64 * 1024  # the tensors and the safetensors header
    assert set(row["staging"]) == {
        f"{files}, {memory}, {n}"
        for files in ("as registered", "re-stamped")
        for memory in ("new memory", "reused buffers")
        for n in ("1 worker", "2 workers")
    }
    assert all(f["gb_per_s"] > 0 and f["adapters_per_s"] > 0 for f in row["staging"].values())
    assert 0 < row["resolve_ms_median"] <= row["resolve_ms_p99"]
    assert "registered in" in done.stdout and "GB/s" in done.stdout
