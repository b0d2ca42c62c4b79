"""Iteration-level scheduling by token budget: the policy of who runs each step.

Every request has two counters, tokens in total and tokens computed; a step schedules for each chosen request up to
(total - computed) tokens. A decode is the case of one token, a prefill (or a chunk of one) the case of many: there
is one code path. Decodes go first, then running prefills, then waiting requests in the order of the waiting line
(engine.fair_queue: weighted fair sharing across tenants, each tenant's cap of running requests, then priority and
arrival; or arrival order alone with fair sharing off). While a prefill shares the engine with other requests,
running or waiting, it computes at most long_prefill_token_threshold tokens a step, so a long prompt leaves room in
each step for the others' decodes and short prompts (alone, it takes the whole budget); and at most
max_long_partial_prefills prompts with more than that threshold left prefill at once (max_num_partial_prefills
prompts in all), so several long prompts cannot fill the budget between them: a long prompt beyond the limit waits
and the shorter ones behind it are admitted (vLLM's partial-prefill limits). When KV blocks run out the
most recently admitted running request is preempted: its blocks are freed, it goes back to the front of its tenant's
line and is recomputed from its tokens later.

Blocks come from the unified pool (kv_pool.UnifiedPool): admission matches the longest cached prefix of the
request's tokens under its cache salt and adapter weights and makes the adapter resident; the request then starts
with those tokens computed. Where an adapter stands is asked of engine.residency: a waiting request whose adapter is
not staged on the host yet (the loader reads it in the background) is passed over, as is one whose adapter would
make the batch's distinct adapters more than max_loras; the requests behind it are admitted meanwhile. Where adapter
loads are asynchronous (CUDA), a request of an adapter whose copy into the arena has not run yet computes nothing
until it has. Ending or preempting a request releases it to the pool, which keeps its full blocks as cached KV where
the policy reuses KV (a preempted request usually finds its own KV again).

Speculative decoding (speculative_ngram > 0, while at most speculative_max_batch requests run): a decode also
computes the draft tokens proposed from its own context (engine.ngram), 1 + d tokens in all; update keeps the
verified ones, rolls num_computed_tokens back to them and gives back the blocks taken only for rejected drafts."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_server.config import EngineConfig
from lora_server.engine.fair_queue import FairQueue
from lora_server.engine.ngram import propose_ngram
from lora_server.engine.request import FinishReason, Request, RequestStatus, server_salt
from lora_server.engine.residency import Residency
from lora_server.errors import QueueFullError
from lora_server.kv_pool import OutOfBlocksError
from lora_server.kv_pool.tree import BASE_ADAPTER_ID, PrefixKey
from lora_server.kv_pool.unified_pool import UnifiedPool


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler reads of the engine's config, derived by from_engine: the defaults live in EngineConfig
    alone."""

    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget (without chunked prefill, at least a whole prompt)
    max_model_len: int
    enable_chunked_prefill: bool
    max_waiting_requests: int
    fair_sharing: bool  # admission by weighted fair sharing across tenants (False: arrival order)
    speculative_ngram: int  # draft tokens per decode at most; 0: no speculation
    ngram_min: int
    ngram_max: int
    speculative_max_batch: int  # no drafts while more requests than this run
    max_loras: int  # the most distinct adapters among the running requests (one batch)
    # the most tokens of one prefill in a step while other requests run or wait (0: no cap), so that a long prompt
    # leaves room in every step for the others' decodes and short prompts (vLLM's long_prefill_token_threshold)
    long_prefill_token_threshold: int
    # with chunked prefill, the most prompts that prefill at once (0: no limit), and of them the most with more than
    # long_prefill_token_threshold tokens left to compute (0: no limit; needs the threshold)
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    pool_tick_s: float = 0.1  # the pool's policy runs at least this often (and on every allocation failure)

    @classmethod
    def from_engine(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The scheduler's view of ``config`` for requests of at most ``max_model_len`` tokens (the engine's,
        after the model and the pool have bounded it)."""
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, max_model_len)  # a whole prompt must fit one step
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_waiting_requests=config.max_waiting_requests,
            fair_sharing=config.fair_sharing,
            speculative_ngram=config.speculative_ngram,
            ngram_min=config.speculative_ngram_min,
            ngram_max=config.speculative_ngram_max,
            speculative_max_batch=config.speculative_max_batch,
            max_loras=config.max_loras,
            long_prefill_token_threshold=config.long_prefill_threshold(budget),
            max_num_partial_prefills=config.max_num_partial_prefills,
            max_long_partial_prefills=config.long_partial_prefills(),
        )


@dataclass(slots=True)
class PrefillSlots:
    """The prompts that may still start prefilling this step: at most ``free`` more, of them at most ``free_long``
    with more than ``threshold`` tokens left to compute (a cached prefix is not known before admission and counts
    as left). None: no limit."""

    free: int | None
    free_long: int | None
    threshold: int

    def allows(self, request: Request) -> bool:
        long = request.num_uncomputed_tokens > self.threshold
        return self.free != 0 and not (long and self.free_long == 0)

    def take(self, request: Request) -> bool:
        """Take a slot for the request if it may start; returns whether it may."""
        if not self.allows(request):
            return False
        if self.free is not None:
            self.free -= 1
        if self.free_long is not None and request.num_uncomputed_tokens > self.threshold:
            self.free_long -= 1
        return True


@dataclass(slots=True)
class ScheduledWork:
    """This step's work: (request, number of its tokens to compute) in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # ended before running: their adapter cannot be staged (why, naming no path)
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: UnifiedPool,
        residency: Residency | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``residency`` answers where requests' adapters stand (None: a scheduler of the base model alone)."""
        self.config = config
        self.pool = pool
        self.residency = residency
        self.clock = clock
        self._last_tick = float("-inf")
        self.waiting = FairQueue(config.fair_sharing)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts verified since start
        self.num_accepted_drafts = 0  # of them, those kept

    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFullError when the waiting queue is at its bound."""
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"the queue holds {len(self.waiting)} waiting requests; retry later")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.adapter is not None and self.residency is None:
            raise ValueError("this scheduler serves no adapters")
        self.requests[request.request_id] = request
        self.waiting.push(request)
        if request.adapter is not None and not self._adapter_ready(request):  # its staging starts now
            request.wait_for_adapter(self.clock())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def tick(self) -> float:
        """Adapter changes into the pool, and the pool's policy at most every pool_tick_s (also while idle: pinned
        adapters load, host KV comes back). Returns the clock's time."""
        now = self.clock()
        if self.residency is not None:
            self.residency.sync(now)
        if now - self._last_tick >= self.config.pool_tick_s:
            self.pool.tick(now, len(self.running), len(self.waiting))
            self._last_tick = now
        return now

    def schedule(self) -> ScheduledWork:
        now = self.tick()
        work = ScheduledWork()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        speculate = self.config.speculative_ngram > 0 and len(self.running) <= self.config.speculative_max_batch
        slots = self._prefill_slots(prefills)
        chunk_cap = self._prefill_cap(slots)
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            copying = self._copying(request)
            request.copy_wait(now, copying)
            if copying:
                continue
            n = min(request.num_uncomputed_tokens, budget, chunk_cap, request.chunk_limit())
            if not self._reserve_or_preempt(request, n, work, now):
                continue
            work.items.append((request, n))
            self.waiting.charge(request, n)
            budget -= n
        if work.preempted:
            return work  # blocks are short: admit nobody new this step, and no drafts
        if speculate:
            budget = self._add_drafts(work, budget, now)
        failed = self.residency.take_failures() if self.residency is not None else {}
        if failed:
            self._fail_waiting(work, failed)
        running_by_tenant = Counter(r.tenant.name for r in self.running)
        in_batch = {r.adapter.adapter_id for r in self.running if r.adapter is not None}
        passed: set[Request] = set()  # waiting for their adapter to be staged, or for room among max_loras
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self.waiting.next(running_by_tenant, passed)
            if head is None:
                break
            if head.adapter is not None:
                new_adapter = head.adapter.adapter_id not in in_batch
                full = new_adapter and len(in_batch) >= self.config.max_loras
                if full:
                    passed.add(head)
                    continue
                if not self._adapter_ready(head):
                    head.wait_for_adapter(now)
                    passed.add(head)
                    continue
                assert self.residency is not None  # add() refuses adapters without it
                head.adapter_ready(self.residency.ready_since(head.adapter.adapter_id, now))
            if not slots.take(head):  # a prompt over the partial-prefill limits: shorter ones go ahead of it
                passed.add(head)
                continue
            chunk = self._admit(head, min(budget, chunk_cap), now)
            if chunk is None:
                break
            self.waiting.admit(head)
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            running_by_tenant[head.tenant.name] += 1
            if head.adapter is not None:
                in_batch.add(head.adapter.adapter_id)
            if self._copying(head):  # admitted, its blocks taken; it computes once its adapter's copy has run
                head.copy_wait(now, True)
                continue
            work.items.append((head, chunk))
            self.waiting.charge(head, chunk)
            budget -= chunk
        return work

    def _prefill_slots(self, prefills: list[Request]) -> PrefillSlots:
        """What the partial-prefill limits leave for waiting prompts, the running prefills ``prefills`` counted
        (they keep their slots until their prompts are computed). No limits without chunked prefill."""
        config, threshold = self.config, self.config.long_prefill_token_threshold
        if not config.enable_chunked_prefill:
            return PrefillSlots(None, None, threshold)
        free = max(0, config.max_num_partial_prefills - len(prefills)) if config.max_num_partial_prefills else None
        free_long = None
        if config.max_long_partial_prefills and threshold > 0:
            running_long = sum(r.num_uncomputed_tokens > threshold for r in prefills)
            free_long = max(0, config.max_long_partial_prefills - running_long)
        return PrefillSlots(free, free_long, threshold)

    def _prefill_cap(self, slots: PrefillSlots) -> int:
        """The most tokens one prefill computes this step: long_prefill_token_threshold while it shares the engine
        with other requests (running, or waiting and allowed to start by ``slots``), else the whole budget. A
        decode's one token is never capped."""
        threshold = self.config.long_prefill_token_threshold
        if threshold <= 0 or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        others = len(self.running)
        if others <= 1:  # with two running it is capped whatever waits: the queue is not walked
            for request in self.waiting:
                others += slots.allows(request)
                if others > 1:
                    break
        return threshold if others > 1 else self.config.max_num_batched_tokens

    def _fail_waiting(self, work: ScheduledWork, failed: dict[int, str]) -> None:
        """End the waiting requests of adapters the loader could not stage (``failed``: content id -> why; their
        files changed or went); a later request of the same adapter tries again."""
        for request in list(self.waiting):
            if request.adapter is not None and request.adapter.adapter_id in failed:
                self.finish(request, FinishReason.ERROR)
                work.failed.append((request, failed[request.adapter.adapter_id]))

    def _adapter_ready(self, request: Request) -> bool:
        assert self.residency is not None and request.adapter is not None  # add() refuses adapters without it
        return self.residency.ready(request.adapter.adapter_id, request.arrival_time)

    def _copying(self, request: Request) -> bool:
        return self.residency is not None and self.residency.copying(request.lora_page)

    def prefix_key(self, request: Request) -> PrefixKey:
        """KV is shared under the same tenant salt and adapter weights (not name or version)."""
        adapter_id = BASE_ADAPTER_ID if request.adapter is None else request.adapter.adapter_id
        return PrefixKey(request.cache_salt, adapter_id)

    def _admit(self, request: Request, budget: int, now: float) -> int | None:
        """Take the request into the pool: its cached prefix counts as computed, and the blocks of its first
        chunk (at most `budget` tokens; the whole rest without chunked prefill) are allocated. Returns the chunk's
        size, or None when the pool cannot take it now (it stays first in line)."""
        admission = self.pool.admit(
            self.prefix_key(request),
            request.token_ids,
            now,
            token_budget=budget,
            partial=self.config.enable_chunked_prefill,
            reuse_prefix=not request.needs_prompt_logprobs,  # prompt logprobs need every prompt position computed
            base_tokens=request.adapter_from if request.adapter is not None else 0,
            account=server_salt(request.cache_salt),
        )
        if admission is None:
            return None
        request.admission = admission
        request.block_table = [*admission.blocks, *admission.new_blocks]
        request.num_computed_tokens = admission.num_cached_tokens
        if request.scheduled_time is None:
            request.scheduled_time = now
            request.num_cached_tokens = admission.num_cached_tokens
        request.adapter_loaded = request.adapter_loaded or admission.adapter_loaded
        return min(admission.num_new_tokens, request.chunk_limit())  # its blocks may cover more: the next chunk's

    def _add_drafts(self, work: ScheduledWork, budget: int, now: float) -> int:
        """Drafts for this step's decodes, from the budget the running requests left (speculation is optional
        work: it never takes budget or blocks from their decodes and prefill chunks). Returns the budget left."""
        for i, (request, n) in enumerate(work.items):
            if budget == 0:
                break
            if n == request.num_uncomputed_tokens == 1:
                d = self._draft(request, budget, now)
                work.items[i] = (request, 1 + d)
                self.waiting.charge(request, d)  # drafts are computed tokens of its tenant
                budget -= d
        return budget

    def _draft(self, request: Request, room: int, now: float) -> int:
        """Propose draft tokens for a decode whose one token has its blocks: at most speculative_ngram, ``room``
        (the step's token budget left), and what max_tokens and max_model_len leave after the token it samples
        anyway. Their blocks are taken only if free or freed by evicting cached KV (no preemption for a guess).
        Sets request.draft_token_ids; returns how many. A request whose tokens are constrained beyond its
        sampling parameters (structured output) gets none."""
        if request.grammar is not None:
            return 0
        c = self.config
        cap = min(
            c.speculative_ngram,
            room,
            request.params.max_tokens - request.num_output_tokens - 1,
            c.max_model_len - request.num_tokens - 1,
        )
        if cap < 1:
            return 0
        drafts = propose_ngram(request.token_ids, cap, c.ngram_min, c.ngram_max)
        if not drafts or not self._reserve(request, 1 + len(drafts), now):
            return 0
        request.draft_token_ids = drafts
        return len(drafts)

    def _release(self, request: Request, cache: bool = True) -> None:
        """Give the request's blocks back to the pool, offering its computed full blocks as cached KV (unless
        ``cache`` is False: a failed request's KV is not trusted)."""
        if request.admission is not None:
            tokens = request.token_ids[: request.num_computed_tokens] if cache else []
            self.pool.release(request.admission, tokens, request.block_table, self.clock())
            request.admission = None
        request.block_table = []

    def _reserve(self, request: Request, num_new_tokens: int, now: float) -> bool:
        """Give the request the blocks for num_new_tokens more tokens, if the pool has them (or can evict
        cached KV for them)."""
        need = self.pool.gpu.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if need <= 0:
            return True
        try:
            request.block_table.extend(self.pool.allocate(need, now))
        except OutOfBlocksError:
            return False
        return True

    def _reserve_or_preempt(self, request: Request, num_new_tokens: int, work: ScheduledWork, now: float) -> bool:
        while not self._reserve(request, num_new_tokens, now):
            victim = self.running[-1]
            self._preempt(victim, work)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, work: ScheduledWork) -> None:
        self.running.remove(request)
        for n in [n for r, n in work.items if r is request]:
            self.waiting.charge(request, -n)  # its tokens of this step are not computed
        work.items = [(r, n) for r, n in work.items if r is not request]
        request.draft_token_ids = []
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        work.preempted.append(request)

    def update(self, work: ScheduledWork, sampled: dict[str, list[int]]) -> list[Request]:
        """After the forward pass: advance counters, append the new tokens (``sampled`` maps the ids of the
        requests that reached their last token to one token, or to the 1 + accepted drafts verify_drafts kept),
        checking the stop conditions after each (tokens after a stop are dropped), and finish requests whose stop
        conditions hold; a request that only scores its prompt (max_tokens 0) finishes, "length", once its prompt
        is computed. A request that computed drafts keeps the KV of the accepted ones only: its computed
        tokens roll back to all but its new last token and the blocks beyond those it needs are given back.
        Returns the requests that got new tokens, or finished scoring their prompt."""
        advanced = []
        now = self.clock()
        for request, n in work.items:
            request.num_computed_tokens += n
            drafts, request.draft_token_ids = request.draft_token_ids, []
            tokens = sampled.get(request.request_id)
            if tokens is None:
                if request.params.scores_prompt and request.num_uncomputed_tokens == 0:
                    request.first_token_time = now  # scored: it generates nothing
                    advanced.append(request)
                    self.finish(request, FinishReason.LENGTH)
                continue
            reason = None
            for token in tokens:
                request.token_ids.append(token)
                reason = self._stop_by_token(request, token)
                if reason is not None:
                    break
            if drafts:
                self.num_draft_tokens += len(drafts)
                self.num_accepted_drafts += len(tokens) - 1
                self._drop_rejected(request)
            if request.first_token_time is None:
                request.first_token_time = now
            advanced.append(request)
            if reason is not None:
                self.finish(request, *reason)
        return advanced

    def _drop_rejected(self, request: Request) -> None:
        """After a speculative step: only the KV before the new last token is valid (rejected drafts wrote the
        rest); blocks past those the next token needs were taken for rejected drafts and go back to the pool."""
        request.num_computed_tokens = request.num_tokens - 1
        keep = self.pool.gpu.blocks_for_tokens(request.num_tokens)
        if len(request.block_table) > keep:
            self.pool.free(request.block_table[keep:])
            del request.block_table[keep:]

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
        """End a request (stop, length, abort, error) and free its blocks; a no-op if it already ended. The adapter
        version the request held (taken when it was made, see AdapterRegistry.acquire) is let go here."""
        if request.finished:
            return
        request.draft_token_ids = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, cache=reason is not FinishReason.ERROR)
        if request.adapter is not None and self.residency is not None:
            self.residency.release(request.adapter)
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
        """The pool's own invariants, and the requests' block tables are exactly the pool's request references."""
        self.pool.check_integrity()
        assert all(not r.block_table and r.admission is None for r in self.waiting), "a waiting request holds blocks"
        assert all(r.admission is not None for r in self.running), "a running request is not admitted"
        held = Counter(b for r in self.running for b in r.block_table)
        assert held == self.pool.held_blocks(), "block tables differ from the pool's request references"
