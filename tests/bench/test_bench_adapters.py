"""``lora-server bench-engine --registered`` and ``--loads`` on the embedded model: the figures they write are
consistent with the trace they ran (hand-checked bounds: an adapter is read from disk at most once per engine
here, since --max-cpu-loras keeps every one; no more distinct adapters per batch than requests or registered
adapters; every pinned adapter registered while the batch ran is counted at the arena's own adapter size)."""

from __future__ import annotations

import json

import pytest

from lora_server.cli import main


@pytest.mark.slow
def test_registered_bench_rows(tmp_path):
    out = tmp_path / "registered.json"
    argv = ["bench-engine", "--registered", "3,12", "--quick", "--json", str(out), "--rounds", "3"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {row["registered"]: row for row in result["rows"]}
    assert set(rows) == {3, 12}
    for n, row in rows.items():
        assert 1 <= row["distinct_adapters_per_batch"] <= min(4, n)  # --quick: batches of 4
        # each distinct adapter of a batch was read from disk once at most (all stay staged on the host)
        assert 1 <= row["stagings_from_disk"] <= n
        assert row["adapter_loads"] >= row["stagings_from_disk"] >= row["resident_adapters"] >= 1
        assert row["retained_bytes"] == pytest.approx(row["retained_bytes_per_adapter"] * n, abs=n)
        assert row["decode_ms_per_step"] > 0 and row["ttft_mean_s"] > 0


@pytest.mark.slow
def test_loads_bench_counts_the_loaded_adapters(tmp_path):
    out = tmp_path / "loads.json"
    assert main(["bench-engine", "--loads", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (
        result["no_loads"]["steps"] == result["while_loading"]["steps"] == 3
    )  # --quick: 4 tokens, the first from prefill
    assert 0 <= result["adapters_loaded"] <= 2  # --quick: 2 loaded meanwhile
    assert result["bytes_loaded"] % max(1, result["adapters_loaded"]) == 0
    assert result["mean_ratio"] == pytest.approx(
        result["while_loading"]["mean_ms"] / result["no_loads"]["mean_ms"], rel=0.01
    )
