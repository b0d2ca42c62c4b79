"""The engine's tally of each request's time to first token, split into queueing, adapter loading and prefill."""

from __future__ import annotations

from dataclasses import dataclass

from lora_server.engine.reports import TtftFigures
from lora_server.engine.request import Request


@dataclass(slots=True)
class TtftSplit:
    """Time to first token split into queueing, adapter loading and prefill, summed over requests that got a
    first token: adapter loading is every wait for its adapter (registered on first use before the engine saw the
    request, read and staged on the host before its first admission, copied into the arena after it: the copy
    operations of its steps, or on CUDA the steps it waited for the copy); queueing the rest of arrival to first
    admission, prefill the rest of first admission to first token. The three add up to its TTFT."""

    count: int = 0
    queueing_s: float = 0.0
    adapter_s: float = 0.0
    prefill_s: float = 0.0

    def add(self, request: Request) -> None:
        assert request.first_token_time is not None and request.scheduled_time is not None
        after_admission = request.copy_wait_s + request.adapter_load_s
        self.count += 1
        self.queueing_s += request.scheduled_time - request.arrival_time - request.adapter_wait_s
        self.adapter_s += request.adapter_wait_s + after_admission
        self.prefill_s += request.first_token_time - request.scheduled_time - after_admission

    def figures(self) -> TtftFigures:
        n = max(1, self.count)
        return TtftFigures(
            requests=self.count,
            mean_s=(self.queueing_s + self.adapter_s + self.prefill_s) / n,
            queueing_mean_s=self.queueing_s / n,
            adapter_loading_mean_s=self.adapter_s / n,
            prefill_mean_s=self.prefill_s / n,
        )
