"""Iteration-level scheduling by token budget: the policy of who runs each step.

Every request has two counters, tokens in total and tokens computed; a step schedules for each chosen request
up to (total - computed) tokens. A decode is the case of one token, a prefill (or a chunk of one) the case of
many: there is one code path. Decodes go first, then running prefills, then waiting requests in arrival order.
When KV blocks run out the most recently arrived running request is preempted: its blocks are freed and it is
recomputed from its tokens later."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kv_pool import BlockPool
from lora_server.errors import QueueFullError
from lora_server.lora import LoraManager
from lora_server.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024


@dataclass(slots=True)
class ScheduledWork:
    """This step's work: (request, number of its tokens to compute) in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, adapters: LoraManager | None = None) -> None:
        self.config = config
        self.pool = pool
        self.adapters = adapters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFullError when the waiting queue is at its bound."""
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"the queue holds {len(self.waiting)} waiting requests; retry later")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.adapter is not None:
            if self.adapters is None:
                raise ValueError("this scheduler serves no adapters")
            self.adapters.hold(request.adapter)  # an unloaded adapter's version lives until its requests end
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledWork:
        work = ScheduledWork()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_uncomputed_tokens, budget)
            if not self._reserve_or_preempt(request, n, work):
                continue
            work.items.append((request, n))
            budget -= n
        if work.preempted:
            return work  # blocks are short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = request.num_uncomputed_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if request.adapter is not None and not self._place_adapter(request):
                break
            if not self._reserve(request, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            work.items.append((request, n))
            budget -= n
        return work

    def _place_adapter(self, request: Request) -> bool:
        """Make the request's adapter resident in a device slot (False: every slot is busy with running work)."""
        assert self.adapters is not None and request.adapter is not None
        in_use = {r.lora_slot for r in self.running if r.lora_slot >= 0}
        slot = self.adapters.acquire(request.adapter, in_use)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _reserve(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request the blocks for num_new_tokens more tokens, if the pool has them."""
        need = self.pool.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        request.block_table.extend(self.pool.allocate(need))
        return True

    def _reserve_or_preempt(self, request: Request, num_new_tokens: int, work: ScheduledWork) -> bool:
        while not self._reserve(request, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim, work)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, work: ScheduledWork) -> None:
        self.running.remove(request)
        work.items = [(r, n) for r, n in work.items if r is not request]
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.lora_slot = -1
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        work.preempted.append(request)

    def update(self, work: ScheduledWork, sampled: dict[str, int]) -> list[Request]:
        """After the forward pass: advance counters, append each sampled token (``sampled`` maps the ids of the
        requests that reached their last token to the new token) and finish requests whose stop conditions hold.
        Returns the requests that got a new token."""
        advanced = []
        for request, n in work.items:
            request.num_computed_tokens += n
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.token_ids.append(token)
            advanced.append(request)
            reason = self._stop_by_token(request, token)
            if reason is not None:
                self.finish(request, *reason)
        return advanced

    def _stop_by_token(self, request: Request, token: int) -> tuple[FinishReason, int | None] | None:
        p = request.params
        if request.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a request (stop, length, abort) and free its blocks; a no-op if it already ended."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.lora_slot = -1
        if request.adapter is not None and self.adapters is not None:
            self.adapters.drop(request.adapter)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    def check_integrity(self) -> None:
        self.pool.check_integrity([r.block_table for r in self.running])
        assert all(not r.block_table for r in self.waiting), "a waiting request holds blocks"
