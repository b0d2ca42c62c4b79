"""``lora-server bench-e2e --quick`` end to end, at small counts: the tiny checkpoint, 200 adapters, two real
servers under load. What it wrote is checked against what the servers report of themselves (adapters registered and
staged, the TTFT split's request count, adapters loaded into the arena) and against the trace's own expectation."""

from __future__ import annotations

import json

import pytest

from lora_server.cli import main

ADAPTERS, PROMPTS = 200, 32


@pytest.mark.slow
def test_quick_run_measures_every_point_through_the_server(tmp_path):
    out = tmp_path / "e2e.json"
    flags = ["--adapters", str(ADAPTERS), "--num-prompts", str(PROMPTS), "--workdir", str(tmp_path / "work")]
    assert main(["bench-e2e", "--quick", *flags, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    points = {row["point"]: row for row in report["points"]}
    many = f"{ADAPTERS} uniform"
    assert list(points) == ["16 uniform", many, f"{ADAPTERS} zipf", f"{many}, small arena"]
    # both servers registered every adapter and staged each: identical contents would stage once
    assert [(s["registered"], s["staged_at_start"]) for s in report["servers"]] == [(ADAPTERS, ADAPTERS)] * 2
    assert all(s["registration_s"] is not None for s in report["servers"])
    for row in points.values():
        assert row["requests"] == row["server_ttft"]["requests"] == PROMPTS  # the split counts this point's requests
        for key in ("output_tok_s", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "tok_s_ratio", "split_share"):
            assert row[key] > 0, (row["point"], key)
        assert row["p99_ttft_ms"] >= row["median_ttft_ms"]
        assert 0 < row["split_share"] <= 1.05  # the server's TTFT starts after the client's, and ends before it
    assert points["16 uniform"]["tok_s_ratio"] == 1.0 and points["16 uniform"]["distinct_adapters"] <= 16
    # a uniform pick of 32 among 200: 200 * (1 - (199/200)^32) = 29.6 distinct on average; each one not resident
    # before the point (at most those the reference point left) was loaded into the arena for it
    uniform = points[many]
    assert uniform["distinct_adapters"] >= 24
    resident_before = points["16 uniform"]["server_adapters"]["resident_adapters"]
    assert uniform["server_adapters"]["activations"] >= uniform["distinct_adapters"] - resident_before
    assert points[f"{ADAPTERS} zipf"]["assignment"] == "zipf:1.0"
    assert points[f"{many}, small arena"]["server_adapters"]["activations"] > 0
    # the goals, each with its value: the uniform point's throughput ratio and every point's split
    assert [(g["point"], g["figure"]) for g in report["goals"]] == [(many, "tok_s_ratio")] + [
        (name, "split_share") for name in points
    ]
    assert all(isinstance(g["met"], bool) for g in report["goals"])
    assert (tmp_path / "bench-e2e-serve-0.log").is_file() and (tmp_path / "bench-e2e-serve-1.log").is_file()
