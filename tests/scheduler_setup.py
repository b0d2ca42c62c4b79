"""SchedulerConfig for tests that drive the scheduler without an engine: every field given (the engine derives
them from EngineConfig), by default the plain scheduler: no speculation, no limit on adapters per batch, no
long-prefill cap or partial-prefill limits."""

from __future__ import annotations

from typing import Any

from lora_server.engine.scheduler import SchedulerConfig

PLAIN: dict[str, Any] = {
    "enable_chunked_prefill": True,
    "max_waiting_requests": 1024,
    "fair_sharing": True,
    "speculative_ngram": 0,
    "ngram_min": 2,
    "ngram_max": 4,
    "speculative_max_batch": 8,
    "max_loras": 1 << 30,
    "long_prefill_token_threshold": 0,
    "max_num_partial_prefills": 0,
    "max_long_partial_prefills": 0,
}


def scheduler_config(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, **fields: Any
) -> SchedulerConfig:
    """PLAIN with ``fields`` over it."""
    return SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, **{**PLAIN, **fields})
