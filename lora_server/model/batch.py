"""What the model runner is handed (scheduled sequences) and the per-step batch description it builds for the
model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lora_server.model.lora import LoraBatch
from lora_server.model.step_inputs import StepArrays
from lora_server.sampling_params import SamplingParams


class ScheduledSequence(Protocol):
    """What the runner and the sampler read of a scheduled request (the engine's Request is one); they never
    change it."""

    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_computed_tokens: int  # tokens whose KV is in the cache
    draft_token_ids: list[int]  # proposed tokens computed after token_ids this step, to be verified
    block_table: list[int]  # its KV blocks, in order
    params: SamplingParams
    eos_token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def lora_page(self) -> int: ...  # its adapter's table page in the arena, -1 = no adapter

    @property
    def num_prompt_logprobs(self) -> int: ...  # with params.prompt_logprobs: prompt tokens scored already


@dataclass(slots=True)
class DraftPosition:
    """A sequence as it stands once its first ``accepted`` draft tokens are taken: what the sampler reads for the
    logits row that verifies the next draft (or, after all of them, samples the bonus token). Penalties,
    min_tokens and the per-position seed thus apply to each verified position as if its tokens had been generated
    one by one."""

    request_id: str
    token_ids: list[int]  # prompt + output + the accepted drafts
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    lora_page: int
    draft_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0  # a draft position scores no prompt token

    @classmethod
    def of(cls, seq: ScheduledSequence, accepted: int) -> DraftPosition:
        return cls(
            seq.request_id,
            seq.token_ids + seq.draft_token_ids[:accepted],
            seq.num_tokens - seq.num_output_tokens,
            seq.num_computed_tokens,
            seq.block_table,
            seq.params,
            seq.eos_token_ids,
            seq.lora_page,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class PromptScoring:
    """The prompt tokens a step scores (prompt logprobs): hidden row ``rows[j]`` (at position p of its sequence)
    gives the logprob of ``targets[j]``, the prompt token at p + 1. ``owners`` splits the P rows by request, in row
    order: (request id, its top-k, the index in its prompt of its first scored token, how many rows)."""

    rows: torch.Tensor  # [P] int64
    targets: torch.Tensor  # [P] int64
    owners: list[tuple[str, int, int, int]]
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first, end, table page) of adapters' rows


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over the scheduled tokens of B sequences (T tokens in all, sequence b's tokens contiguous).

    All tensors live on the model's device; the model reads them without copying back to the host. They are views
    of the runner's persistent step buffers (model.step_inputs), valid until the runner's next step. A decode step
    may end with ``num_padding`` padding sequences (one token each: slot -1, length 0, no adapter) that fill it up
    to its CUDA graph bucket; kernels skip them and their hidden states are never read."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot (block_id * block_size + offset) each token writes
    block_tables: torch.Tensor  # [B, max_blocks] int32; entries past a sequence's blocks are any valid block id
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int32, sequence b's tokens are rows [qsl[b], qsl[b+1])
    logits_indices: torch.Tensor  # [S] int64, rows whose hidden state becomes logits (one per sampled sequence)
    max_query_len: int = 1  # the most tokens any one sequence has in this step (bounds the attention grid)
    lora: LoraBatch | None = None  # each token's adapter slot; None when no token has an adapter
    num_padding: int = 0  # the last num_padding of the B sequences are padding (see above)
    prompt_scoring: PromptScoring | None = None  # prompt tokens whose logprobs this step computes, if any
    # (first, end, table page) of the logits rows (of logits_indices) whose request has an adapter, host integers
    logits_segments: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def of_arrays(cls, arrays: StepArrays[torch.Tensor], block_tables: torch.Tensor, **rest: Any) -> ForwardBatch:
        """The batch whose token and sequence tensors are ``arrays``' (a step's arrays as the runner uploads them and
        the tensor-parallel step message carries them), the rest given by name."""
        return cls(
            input_ids=arrays.input_ids,
            positions=arrays.positions,
            slot_mapping=arrays.slot_mapping,
            block_tables=block_tables,
            seq_lens=arrays.seq_lens,
            query_start_loc=arrays.query_start_loc,
            logits_indices=arrays.logits_indices,
            **rest,
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
