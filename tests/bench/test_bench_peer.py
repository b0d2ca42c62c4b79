"""``lora-server bench-engine --peer``: the engine against HF transformers + PEFT in one run. With --quantization
none both run the same float32 computation, so the engine's greedy tokens must equal HF + PEFT's for a batch of
mixed-rank adapters (the independent reference); the figures land in the JSON."""

from __future__ import annotations

import json

import pytest

from lora_server.cli import main


@pytest.mark.slow
def test_peer_bench_fp32_tokens_equal_hf_peft(tmp_path):
    out = tmp_path / "peer.json"
    assert main(["bench-engine", "--peer", "--quick", "--quantization", "none", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["quantization"] == "none" and result["ranks"] == [4, 8, 16]
    points = {(p["batch"], p["adapters"]): p for p in result["points"]}
    assert set(points) == {(1, 1), (4, 2)}
    for p in points.values():
        assert p["agreement"] == 1.0, p
        assert p["engine_tok_per_s"] > 0 and p["peer_tok_per_s"] > 0
        assert p["ratio"] == pytest.approx(p["engine_tok_per_s"] / p["peer_tok_per_s"], rel=0.05)
