"""What a step hands back of a request: its output (new text, tokens, logprobs, and at its end its timings), the
prompt tokens' logprobs it scored, and whether it ended on an end-of-sequence token."""

from __future__ import annotations

from lora_server.engine.outputs import RequestOutput, RequestTimings, TokenLogprob
from lora_server.engine.request import FinishReason, Request
from lora_server.model.sampler import SampleResult, TokenScores


def request_output(
    request: Request, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        text=text,
        token_ids=token_ids,
        logprobs=logprobs,
        finished=request.finished,
        finish_reason=None if request.finish_reason is None else request.finish_reason.value,
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        queue_time_s=None if request.scheduled_time is None else request.scheduled_time - request.arrival_time,
        timings=request_timings(request) if request.finished else None,
    )


def request_timings(request: Request) -> RequestTimings:
    return RequestTimings(
        arrival=request.arrival_time,
        first_admission=request.scheduled_time,
        first_token=request.first_token_time,
        adapter_load_s=request.adapter_load_s,
        adapter_loaded=request.adapter_loaded,
        adapter_wait_s=request.adapter_wait_s + request.copy_wait_s,
    )


def store_prompt_logprobs(requests: list[Request], scores: dict[str, tuple[int, TokenScores]]) -> None:
    """Append the prompt tokens a step scored to their requests' prompt_logprobs (the runner scores each token once,
    from the first one a request lacks)."""
    for request in requests:
        scored = scores.get(request.request_id)
        if scored is None:
            continue
        first, rows = scored
        assert first == request.num_prompt_logprobs + 1, "prompt tokens are scored in order, each once"
        prompt = request.prompt_token_ids
        request.prompt_logprobs.extend(
            TokenLogprob(prompt[first + j], lp, top, rank)
            for j, (lp, rank, top) in enumerate(zip(rows.logprobs, rows.ranks, rows.top_logprobs, strict=True))
        )


def ended_by_eos(request: Request, token: int) -> bool:
    return (
        request.finish_reason is FinishReason.STOP
        and request.stop_reason is None
        and token in request.eos_token_ids
        and not request.params.include_stop_str_in_output
    )


def logprobs_by_request(sampling: list[Request], result: SampleResult | None) -> dict[str, list[TokenLogprob]]:
    """Each request's logprobs entries, one per row of the result that is its (1 + its drafts' rows)."""
    if result is None or result.logprobs is None or result.top_logprobs is None:
        return {}
    entries = [
        TokenLogprob(tok, lp, top)
        for tok, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True)
    ]
    by_request, row = {}, 0
    for r in sampling:
        rows = len(r.draft_token_ids) + 1
        if r.params.logprobs is not None:
            by_request[r.request_id] = entries[row : row + rows]
        row += rows
    return by_request
