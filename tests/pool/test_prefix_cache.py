"""Prefix caching through the unified pool, on the real engine: which requests hit (hand-computed token counts), no
hit across adapter weights or cache salts (tenants), a hit across versions of the same weights, and the invalid-KV
ratio of each policy after adapter churn. That the cached KV is exactly right is checked against HF+PEFT in
test_lora_vs_peft.py."""

from __future__ import annotations

import pytest

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.request import with_client_salt
from lora_server.sampling_params import SamplingParams

BLOCK = 16
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _engine(**kw) -> Engine:
    return Engine(
        EngineConfig(
            **{"quantization": "none", "kv_cache_bytes": 96 << 20, "max_lora_rank": 16, "show_progress": False, **kw}
        )
    )


def _hit(prompt: list[int]) -> int:
    """Cached tokens of a request whose identical predecessor (same key) ran to MAX_TOKENS: its full computed
    blocks, capped by the longest prefix that leaves a token of the prompt to compute."""
    inserted = (len(prompt) + MAX_TOKENS - 1) // BLOCK
    usable = (len(prompt) - 1) // BLOCK
    return BLOCK * min(inserted, usable)


def _cached(engine: Engine, prompt: list[int], adapter: str | None = None, salt: str = "") -> int:
    [out] = engine.generate([prompt], PARAMS, adapters=adapter, cache_salt=salt)
    return out.num_cached_tokens


@pytest.mark.slow
def test_hits_only_under_the_same_adapter_weights_and_salt():
    demos = demo_adapters()
    engine = _engine()
    for name in ("upper", "pirate"):
        engine.adapters.add(name, demos[name])
    prompt = engine.chat_prompt([{"role": "user", "content": "Describe the water cycle in a few sentences."}])
    assert len(prompt) > 2 * BLOCK
    assert _cached(engine, prompt) == 0
    assert _cached(engine, prompt) == _hit(prompt) > 0  # base model, salt "": a hit
    assert _cached(engine, prompt, salt="tenant:a") == 0  # another tenant: its own cache
    assert _cached(engine, prompt, salt="tenant:b") == 0
    assert _cached(engine, prompt, salt="tenant:a") == _hit(prompt)
    assert _cached(engine, prompt, "upper") == 0  # an adapter never reuses the base model's KV
    assert _cached(engine, prompt, "pirate") == 0  # nor another adapter's
    assert _cached(engine, prompt, "upper") == _hit(prompt)
    assert _cached(engine, prompt, "upper", salt="tenant:a") == 0
    engine.adapters.add("upper", demos["upper"])  # a new version of the same weights: the cache is the weights'
    assert _cached(engine, prompt, "upper") == _hit(prompt)
    engine.adapters.add("upper", demos["emoji"])  # other weights under the same name never share it
    assert _cached(engine, prompt, "upper") == 0
    assert _cached(engine, prompt, "upper") == _hit(prompt)
    engine.check_integrity()
    figures = engine.pool_report().as_json()
    p = len(prompt)
    assert figures["kv_tokens_by_salt"] == {
        "": {"prompt_tokens": 8 * p, "cached_tokens": 4 * _hit(prompt)},
        "tenant:a": {"prompt_tokens": 3 * p, "cached_tokens": _hit(prompt)},
        "tenant:b": {"prompt_tokens": p, "cached_tokens": 0},
    }
    assert figures["request_blocks"] == 0 and figures["gpu_in_use"] == 0


@pytest.mark.slow
def test_clients_own_salts_count_under_their_tenant_and_add_no_entry():
    """A client's cache_salt isolates its KV within its tenant's (no hit across salts, a hit within one), but its
    figures count under the tenant's salt: 12 salts add no entry to the pool's table (it grew by one per salt,
    without bound, and every snapshot copied it)."""
    engine = _engine()
    prompt = list(range(100, 100 + 2 * BLOCK + 5))  # 37 tokens: two full blocks before the last token
    for i in range(12):
        assert _cached(engine, prompt, salt=with_client_salt("tenant:a", f"client-{i}")) == 0
    assert _cached(engine, prompt, salt=with_client_salt("tenant:a", "client-7")) == _hit(prompt) > 0
    assert _cached(engine, prompt, salt="tenant:a") == 0  # the tenant's own KV is not any client salt's
    figures = engine.pool_report().as_json()["kv_tokens_by_salt"]
    assert figures == {"tenant:a": {"prompt_tokens": 14 * len(prompt), "cached_tokens": _hit(prompt)}}
    engine.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, invalid, resident", [("tree-cost", 0.0, 3), ("lru-unified", 0.0, 3), ("lru-separate", 1 / 3, 2)]
)
def test_invalid_kv_after_adapter_churn(policy, invalid, resident):
    """Three adapters used in turn with prompts of the same length. lru-separate has two slots (--max-loras 2): the
    third evicts the first and keeps the first's KV on the device without it (1 of 3 adapters' equal KV is
    invalid). The unified policies share a 38-page arena: the three adapters' 34 pages (upper 15, pirate 17,
    emoji 2) stay, and tree-cost moves the KV that no longer fits to the host (it comes back as a hit);
    lru-unified keeps no KV."""
    demos = demo_adapters()
    size = {"kv_cache_bytes": 256 << 20} if policy == "lru-separate" else {"num_kv_blocks": 38}
    engine = _engine(max_loras=2, pool_policy=policy, **size)
    for name in ("upper", "pirate", "emoji"):
        engine.adapters.add(name, demos[name])
    prompt = engine.chat_prompt([{"role": "user", "content": "Name three colours of the rainbow."}])
    for name in ("upper", "pirate", "emoji"):
        _cached(engine, prompt, name)
    engine.check_integrity()
    stats = engine.pool_report().stats
    assert stats.invalid_kv_ratio == pytest.approx(invalid)
    assert stats.resident_adapters == resident
    if policy == "tree-cost":  # KV went to the host tier, and comes back as a hit
        assert stats.bytes_to_host > 0
        assert _cached(engine, prompt, "upper") == _hit(prompt)


@pytest.mark.slow
def test_an_adapter_request_too_big_for_the_pool_is_refused():
    from lora_server.errors import ContextLengthExceededError

    engine = _engine(num_kv_blocks=20)
    engine.adapters.add("upper", demo_adapters()["upper"])  # 4.9 MB fp16 -> 14 blocks of 737 kB in fp32
    prompt = engine.chat_prompt([{"role": "user", "content": "Hello there, how are you today?"}])
    with pytest.raises(ContextLengthExceededError, match="adapter"):
        engine.generate([prompt], SamplingParams(max_tokens=8 * BLOCK), adapters="upper")
    assert engine.generate([prompt], SamplingParams(max_tokens=8 * BLOCK, ignore_eos=True))[0].token_ids
    engine.check_integrity()
