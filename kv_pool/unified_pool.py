"""UnifiedPool: one GPU budget of blocks for adapter weights and KV, a host tier, the tree, and a policy.

Ownership: the pool owns both BlockPools, the tree and the policy. Callers (the scheduler) hold Admissions and
block ids, never nodes. Per request:

    admit(key, tokens, now) -> Admission | None   adapter resident, cached prefix matched and locked; the request's
                                                   block table starts with admission.blocks, one reference each
    allocate(n, now) -> list[int]                  n more GPU blocks for it (evicts by the policy first if needed)
    free(blocks)                                   back: allocated blocks it no longer needs (rejected drafts' KV)
    release(admission, tokens, block_table, now)   at its end or preemption: its full computed blocks are offered
                                                   to the tree, then its lock and references are dropped

Per engine step: tick(now, batch_size, waiting) (its work is O(tree): about every 100 ms is enough), then
take_copy_ops(), executed in order before the forward pass (a GPU block freed by a swap-out may be handed out again
in the same step; its copy-out comes first in the list). `now` is the engine's monotonic clock in seconds.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from lora_server.kv_pool.block_pool import BlockPool, OutOfBlocksError
from lora_server.kv_pool.policies import POLICIES, PolicyParams, make_policy
from lora_server.kv_pool.tree import (
    BASE,
    BASE_ADAPTER_ID,
    AdapterKey,
    AdapterNode,
    CopyOp,
    Handle,
    Node,
    OpKind,
    PrefixKey,
    PrefixTree,
    Tier,
)


@dataclass(slots=True)
class PoolConfig:
    num_gpu_blocks: int
    num_host_blocks: int  # 0: no host tier
    block_size: int  # tokens per KV block
    block_bytes: int  # bytes of one block (the KV of block_size tokens, all layers); adapters take ceil(bytes / this)
    policy: str = "tree-cost"
    params: PolicyParams = field(default_factory=PolicyParams)
    adapter_slots: int = 4  # slot policies (lru-separate): adapter slots reserved up front
    adapter_slot_blocks: int = 8  # slot policies: blocks per slot, the largest adapter they accept
    free_watermark_blocks: int = 0  # proactive policies: tick() swaps out below it and swaps in down to it
    max_resident_adapters: int | None = None  # unified policies: an optional cap on adapters on the GPU; None (the
    # engine's): the policy decides within the block budget alone. Slot policies use adapter_slots.
    max_pinned_share: float = 0.5  # pinned adapters may take at most this share of the GPU blocks

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.num_host_blocks < 0 or self.block_size < 1 or self.block_bytes < 1:
            raise ValueError("block counts and sizes must be positive (host blocks may be 0)")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown pool policy {self.policy!r}; known: {sorted(POLICIES)}")
        if POLICIES[self.policy].adapter_slots and self.adapter_slots * self.adapter_slot_blocks >= self.num_gpu_blocks:
            raise ValueError("the adapter slots take the whole GPU budget")
        if not 0 <= self.free_watermark_blocks < self.num_gpu_blocks:
            raise ValueError("free_watermark_blocks must be in [0, num_gpu_blocks)")
        if self.max_resident_adapters is not None and self.max_resident_adapters < 1:
            raise ValueError("max_resident_adapters must be >= 1 or None")
        if not 0 <= self.max_pinned_share < 1:
            raise ValueError("max_pinned_share must be in [0, 1)")

    def adapter_blocks(self, num_bytes: int) -> int:
        return -(-num_bytes // self.block_bytes)

    def pin_blocks(self, num_blocks: int) -> int:
        """What pinning an adapter of num_blocks takes from max_pinned_blocks: its blocks (slot policies: a slot)."""
        return self.adapter_slot_blocks if POLICIES[self.policy].adapter_slots else num_blocks

    def pin_refusal(self, pinned: Iterable[int], num_blocks: int) -> str | None:
        """The pin rule: why an adapter of ``num_blocks`` cannot be pinned beside pinned adapters of ``pinned``
        blocks each (None: it can). Together they may take max_pinned_blocks."""
        taken, needed = sum(self.pin_blocks(n) for n in pinned), self.pin_blocks(num_blocks)
        if taken + needed <= self.max_pinned_blocks:
            return None
        return (
            f"pinned adapters may take {self.max_pinned_blocks} of the {self.num_gpu_blocks} device pages and "
            f"{taken} are taken; this one needs {needed}: unpin one first"
        )

    @property
    def max_pinned_blocks(self) -> int:
        """The most GPU blocks pinned adapters may take together (slot policies: whole slots)."""
        limit = int(self.num_gpu_blocks * self.max_pinned_share)
        if POLICIES[self.policy].adapter_slots:
            return min(limit, (self.adapter_slots - 1) * self.adapter_slot_blocks)
        return limit

    @classmethod
    def for_budget(
        cls,
        *,
        num_gpu_blocks: int,
        num_host_blocks: int,
        block_size: int,
        block_bytes: int,
        policy: str,
        params: PolicyParams,
        max_loras: int,
        adapter_slot_bytes: int,
    ) -> PoolConfig:
        """The pool of an engine: its device budget (the arena) cut into blocks of block_bytes, an adapter taking
        the pages of its own layout while resident, as many adapters as the policy keeps (slot policies reserve
        ``max_loras`` slots up front at ``adapter_slot_bytes`` each, the largest adapter's pages), and a free
        watermark of 1/32 of the budget for the proactive policies. ValueError when the slots would take the whole
        budget."""
        slot_blocks = -(-adapter_slot_bytes // block_bytes)
        if POLICIES[policy].adapter_slots and max_loras * slot_blocks >= num_gpu_blocks:
            raise ValueError(
                f"{policy} reserves {max_loras} adapter slots of {slot_blocks} KV blocks each, more "
                f"than the {num_gpu_blocks} blocks of the KV budget: raise kv_cache_bytes or lower "
                "max_loras / max_lora_rank"
            )
        return cls(
            num_gpu_blocks=num_gpu_blocks,
            num_host_blocks=num_host_blocks,
            block_size=block_size,
            block_bytes=block_bytes,
            policy=policy,
            params=params,
            adapter_slots=max_loras,
            adapter_slot_blocks=slot_blocks,
            free_watermark_blocks=num_gpu_blocks // 32,
        )


@dataclass(frozen=True, slots=True)
class Admission:
    """A request's hold on the pool, from admit() to release()."""

    handle: Handle  # locked: its path stays on the GPU, unmoved
    blocks: tuple[int, ...]  # GPU blocks of the cached prefix; the request holds one reference on each
    num_cached_tokens: int
    new_blocks: tuple[int, ...] = ()  # blocks allocated at admission for its first chunk (admit's token_budget)
    num_new_tokens: int = 0  # the first chunk: tokens after the cached prefix the new blocks are for
    adapter_loaded: bool = False  # its adapter was not on the GPU and admission loaded it
    adapter_page: int = -1  # its adapter's table page, where the LoRA kernels find it (-1: the base model); stable
    # while it is held
    # an activated LoRA's request (admit's base_tokens): its adapter locked on its own, since ``handle`` is a path
    # of the base model's KV; None otherwise
    adapter_lock: Handle | None = None
    base_tokens: int = 0  # its leading tokens computed as the base model's (admit's base_tokens)


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Where one adapter version (or the base model) and its cached KV are: the one report of an adapter's
    placement. The pool fills what it keeps (UnifiedPool.adapter_placement); the engine's report adds the names
    served on it and its rank (engine.pool_report)."""

    adapter_id: int  # BASE_ADAPTER_ID: the base model
    tier: str  # "gpu" or "host" (the base model: always "gpu")
    table_page: int  # its table page while on the GPU, else -1
    staged: bool  # its weights are ready on the host (always False for the base model)
    pinned: bool
    weight_blocks: int  # GPU blocks charged to its weights while resident
    kv_blocks_gpu: int  # KV blocks cached under it on the GPU
    kv_blocks_host: int  # and in the host tier
    names: tuple[str, ...] = ()  # every name served on it (the engine's report; none: no name left)
    rank: int | None = None  # its largest rank over its modules (the engine's report; None: the base model)

    @property
    def name(self) -> str | None:
        """The first name served on it (None: no name left)."""
        return self.names[0] if self.names else None


@dataclass(frozen=True, slots=True)
class PoolStats:
    adapter_hit_rate: float  # admissions whose adapter was already on the GPU
    kv_token_hit_rate: float  # prompt tokens served from cached KV (on the GPU or swapped in) at admission
    invalid_kv_ratio: float  # GPU KV blocks whose adapter is not on the GPU, over all cached GPU KV blocks
    bytes_to_gpu: int  # KV swap-ins and adapter loads
    adapter_bytes_to_gpu: int  # of them, adapter loads
    bytes_to_host: int  # KV swap-outs
    evicted_blocks: dict[str, int]  # kv_swap_out, kv_drop, kv_drop_host, adapter_unload, adapter_drop
    resident_adapters: int  # adapters (not the base model) with weights on the GPU
    # the account a request's figures count under (its tenant's salt) -> (prompt tokens admitted, of them cached)
    kv_tokens_by_salt: dict[str, tuple[int, int]]
    gpu_free: int
    gpu_cached: int  # held by the tree (KV and adapter weights), shared with requests or not
    gpu_in_use: int  # held by requests only
    host_free: int
    host_cached: int


class UnifiedPool:
    """The KV pool of the design: only the engine thread calls it. Adapter ids (one per set of weights) come from
    the registry; the pool keeps no adapter weights, only their GPU blocks and residency."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.params, config.block_bytes)
        self.gpu = BlockPool(config.num_gpu_blocks, config.block_size)
        self.host = BlockPool(config.num_host_blocks, config.block_size) if config.num_host_blocks else None
        self.tree = PrefixTree(config.block_size, self.gpu, self.host)
        self._held: Counter[int] = Counter()  # the requests' references per GPU block
        self._num_admitted = 0
        self._admissions = self._adapter_hits = self._prompt_tokens = self._cached_tokens = 0
        # account (admit's: a tenant's salt, a bounded set) -> [prompt tokens, cached tokens]
        self._by_salt: dict[str, list[int]] = {}

    # ---- what a request may use ------------------------------------------------------------------------------

    @property
    def request_blocks(self) -> int:
        """The most GPU blocks one request can ever hold: the budget, less the slot policies' adapter reserve."""
        c = self.config
        return c.num_gpu_blocks - (c.adapter_slots * c.adapter_slot_blocks if self.policy.adapter_slots else 0)

    def blocks_needed(self, num_tokens: int, adapter_bytes: int = 0) -> int:
        """Blocks a request of num_tokens (prompt + max_tokens) needs at its largest, its adapter's weights included
        where they share the budget with KV (the unified policies); compare with ``request_blocks``."""
        adapter = 0 if self.policy.adapter_slots else self.config.adapter_blocks(adapter_bytes)
        return self.gpu.blocks_for_tokens(num_tokens) + adapter

    def resident_adapters(self) -> dict[AdapterKey, int]:
        """The adapters on the GPU and their table pages."""
        return {a.key: a.table_page for a in self.tree.adapters() if a.tier is Tier.GPU and a.table_page >= 0}

    # ---- adapters -------------------------------------------------------------------------------------------

    def register_adapter(
        self, adapter_id: int, num_bytes: int, pinned: bool = False, staged: bool = False
    ) -> AdapterKey:
        """Make an adapter known, ``num_bytes`` its pages' bytes (it stays off the GPU until a request needs it, or
        for a pinned one until it is staged and the GPU has room: it then stays there). ``staged``: its weights are
        ready on the host already (else set_staged says when). ValueError for an id already known (other weights
        get a new id) or a pin beyond ``max_pinned_blocks``."""
        if adapter_id == BASE_ADAPTER_ID or num_bytes < 1:
            raise ValueError("an adapter needs an id other than the base model's and a positive size")
        num_blocks = self.config.adapter_blocks(num_bytes)
        if self.policy.adapter_slots and num_blocks > self.config.adapter_slot_blocks:
            raise ValueError(f"the adapter takes {num_blocks} blocks; a slot holds {self.config.adapter_slot_blocks}")
        if pinned:
            others = (
                a.num_blocks
                for a in self.tree.adapters()
                if a.pinned and not a.dropped and a.key.adapter_id != adapter_id
            )
            refusal = self.config.pin_refusal(others, num_blocks)
            if refusal is not None:
                raise ValueError(refusal)
        key = AdapterKey(adapter_id)
        if self.tree.adapter(key) is not None:
            raise ValueError(f"adapter {adapter_id} is already registered")
        self.tree.add_adapter(key, num_bytes, num_blocks, pinned, staged)
        return key

    def set_staged(self, adapter: AdapterKey, staged: bool) -> None:
        """The engine's loader has this adapter's weights ready on the host (or no longer): only staged adapters
        are loaded. Unknown adapters are ignored (dropped meanwhile)."""
        node = self.tree.adapter(adapter)
        if node is not None:
            node.staged = staged

    def set_pinned(self, adapter: AdapterKey, pinned: bool) -> None:
        """Pin an adapter (kept on the GPU once loaded) or unpin it. The registry refused a pin beyond
        max_pinned_blocks when it was asked for (PoolConfig.pin_refusal): this only mirrors its decision."""
        node = self.tree.adapter(adapter)
        if node is not None:
            node.pinned = pinned

    def pinned_adapters(self) -> set[int]:
        """The ids of the pinned adapters (not dropped)."""
        return {a.key.adapter_id for a in self.tree.adapters() if a.pinned and not a.dropped}

    def can_make_resident(self, adapter: AdapterKey) -> bool:
        """Whether a request of this adapter could be admitted as far as its weights go: on the GPU, or staged on
        the host (room aside). False for an adapter the pool does not know."""
        node = self.tree.adapter(adapter)
        return node is not None and (node.staged or node.table_page >= 0)

    def pending_adapter_pages(self, unloads: bool = False) -> set[int]:
        """Table pages of the adapter loads (or unloads) decided but not yet taken by take_copy_ops."""
        if unloads:
            return {op.src[0] for op in self.tree.ops if op.kind is OpKind.ADAPTER_UNLOAD}
        return {op.dst[0] for op in self.tree.ops if op.kind is OpKind.ADAPTER_LOAD}

    def knows(self, adapter: AdapterKey) -> bool:
        """Whether this adapter is registered (and not dropped)."""
        return self.tree.adapter(adapter) is not None

    def drop_adapter(self, adapter_id: int) -> bool:
        """Unload an adapter: it and its KV go at once; running requests keep what they locked until they release
        it. Returns whether the pool knew it."""
        return self.tree.drop_adapter(adapter_id)

    def _resident_adapters(self) -> int:
        return sum(1 for a in self.tree.adapters() if a.tier is Tier.GPU and a.num_blocks > 0)

    def _make_resident(self, adapter: AdapterNode, now: float) -> bool:
        if adapter.tier is Tier.GPU:
            return True
        if not adapter.staged:
            return False
        if not self.policy.adapter_slots:
            cap = self.config.max_resident_adapters
            if cap is not None and self._resident_adapters() >= cap and not self._unload_one(now):
                return False
            if not self._room(adapter.num_blocks, now):
                return False
            self.tree.load_adapter(adapter)
            return True
        if self._resident_adapters() >= self.config.adapter_slots:
            victims = [
                a
                for a in self.tree.adapters()
                if a.tier is Tier.GPU and a.lock == 0 and a.num_blocks > 0 and not a.pinned
            ]
            if not victims:
                return False
            self.tree.unload_adapter(min(victims, key=lambda a: (a.last_access, a.id)))
        self.tree.load_adapter(adapter, self.config.adapter_slot_blocks)  # the slot reserve guarantees the room
        return True

    def _unload_one(self, now: float) -> bool:
        """Free an adapter place (the max_resident_adapters cap): the unlocked resident adapter of lowest value
        leaves with its GPU KV (to the host where the policy swaps). False when every resident one is locked."""
        victims = [
            a
            for a in self.tree.adapters()
            if a.tier is Tier.GPU and a.lock == 0 and a.num_blocks > 0 and not a.dropped and not a.pinned
        ]
        if not victims:
            return False
        key = self._key(now)
        self.tree.evict_adapter(min(victims, key=lambda a: (key(a), a.id)), self.policy.swaps_to_host)
        return True

    # ---- requests -------------------------------------------------------------------------------------------

    def admit(
        self,
        key: PrefixKey,
        tokens: Sequence[int],
        now: float,
        token_budget: int | None = None,
        partial: bool = True,
        reuse_prefix: bool = True,
        base_tokens: int = 0,
        account: str | None = None,
    ) -> Admission | None:
        """Make key's adapter resident, match the longest cached prefix of `tokens` (leaving at least one token to
        compute; none when not `reuse_prefix`), swap in the host part the policy restores, lock the path and give
        the caller a reference on each of its GPU blocks.

        With `token_budget`, also allocate the blocks of the first chunk: the uncached tokens, at most
        token_budget of them (all of them or nothing when not `partial`). None: the adapter cannot be made
        resident now (it is not staged on the host, or all candidates are locked) or the chunk does not fit;
        nothing is held or counted then (an adapter loaded or KV swapped in on the way stays, unlocked). Raises
        KeyError for an adapter that is not registered.

        ``base_tokens``: an activated LoRA's request, whose first base_tokens tokens are computed without its
        adapter (they precede its invocation): their full blocks are the base model's KV under the same salt,
        matched there (and offered there by ``release``), so base requests and the activated LoRAs of one
        conversation hold one copy of it; its adapter is made resident and locked beside that path. The blocks
        from its invocation on are its own and are not cached.

        ``account``: whose figures the request's tokens count under (``kv_tokens_by_salt``; default its salt). The
        caller keeps the accounts few (its tenants): a salt a client chose must not make a new one."""
        adapter = self.tree.adapter(key.adapter)
        if adapter is None:
            raise KeyError(f"adapter {key.adapter_id} is not registered")
        was_resident = adapter.tier is Tier.GPU
        if not self._make_resident(adapter, now):
            return None
        bs = self.config.block_size
        adapter_lock = None
        if base_tokens > 0:  # the KV path is the base model's; the adapter stays resident by its own lock
            adapter_lock = Handle(key, adapter)
            self.tree.lock(adapter_lock)
            key = PrefixKey(key.salt, BASE_ADAPTER_ID)
            base = self.tree.adapter(BASE)
            assert base is not None
            handle = Handle(key, base)
        else:
            handle = Handle(key, adapter)
        if self.policy.reuses_history_kv and reuse_prefix:
            usable = max(0, len(tokens) - 1) // bs * bs
            if base_tokens > 0:
                usable = min(usable, base_tokens // bs * bs)
            _, _, handle = self.tree.match_prefix(key, tokens[:usable], now, touch=False)
        handle = self._lock_and_restore(handle, now)
        blocks = self.tree.path_blocks(handle)
        cached = len(blocks) * bs
        new_blocks: list[int] = []
        num_new = len(tokens) - cached
        if token_budget is not None:
            if num_new > token_budget and not partial:
                self.tree.unlock(handle)
                if adapter_lock is not None:
                    self.tree.unlock(adapter_lock)
                return None
            num_new = min(num_new, token_budget)
            need = self.gpu.blocks_for_tokens(cached + num_new) - len(blocks)
            if not self._room(need, now):  # evicts unlocked nodes only: the path just locked stays
                self.tree.unlock(handle)
                if adapter_lock is not None:
                    self.tree.unlock(adapter_lock)
                return None
            new_blocks = self.gpu.allocate(need)
            self._held.update(new_blocks)
        self.tree.touch(handle, now)
        self.policy.observe(adapter.key, now)
        self.gpu.share(blocks)
        self._held.update(blocks)
        self._num_admitted += 1
        self._admissions += 1
        self._adapter_hits += was_resident
        self._prompt_tokens += len(tokens)
        self._cached_tokens += cached
        salt = self._by_salt.setdefault(key.salt if account is None else account, [0, 0])
        salt[0] += len(tokens)
        salt[1] += cached
        return Admission(
            handle,
            tuple(blocks),
            cached,
            tuple(new_blocks),
            num_new,
            not was_resident,
            adapter.table_page,
            adapter_lock,
            base_tokens,
        )

    def _lock_and_restore(self, handle: Handle, now: float) -> Handle:
        """Lock the GPU part of a matched path, then swap in its host part, top first, while the policy prefers
        that to recomputing and the GPU has room. Returns the locked handle."""
        host = [n for n in self.tree.path(handle) if n.tier is Tier.HOST]
        locked = Handle(handle.key, host[0].parent) if host else handle
        self.tree.lock(locked)
        for node in host:
            if node.parent is not locked.node or not self.policy.should_swap_in(node):
                break
            if not self._room(len(node.blocks), now) or node.tier is not Tier.HOST:
                break  # no room, or making room dropped it from the host
            self.tree.swap_in(node)
            deeper = Handle(handle.key, node)
            self.tree.lock(deeper)
            self.tree.unlock(locked)
            locked = deeper
        return locked

    def allocate(self, num_blocks: int, now: float) -> list[int]:
        """num_blocks GPU blocks, one reference each for the caller; evicts by the policy first when short.
        Raises OutOfBlocksError (nothing allocated) when even that does not make room."""
        if not self._room(num_blocks, now):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self._available()} available after eviction")
        blocks = self.gpu.allocate(num_blocks)
        self._held.update(blocks)
        return blocks

    def release(self, admission: Admission, tokens: Sequence[int], block_table: Sequence[int], now: float) -> None:
        """End a request's hold: `tokens` are the tokens whose KV is computed, from the start (prompt and output),
        `block_table` its GPU blocks (starting with admission.blocks). Full blocks go into the tree (policies that
        reuse KV), then the lock and the request's references are dropped; its block ids are invalid afterwards.
        An activated LoRA's request offers only the full blocks of its base tokens (admit's base_tokens)."""
        handle, bs = admission.handle, self.config.block_size
        assert tuple(block_table[: len(admission.blocks)]) == admission.blocks, "the block table lost its prefix"
        if self.policy.reuses_history_kv:
            start, end = handle.num_blocks, min(len(tokens) // bs, len(block_table))
            if admission.adapter_lock is not None:
                end = min(end, admission.base_tokens // bs)
            if end > start:
                self.tree.insert(handle, tokens[start * bs : end * bs], block_table[start:end], now)
        self.tree.unlock(handle)
        if admission.adapter_lock is not None:
            self.tree.unlock(admission.adapter_lock)
        self._num_admitted -= 1
        self.gpu.free(list(block_table))
        self._held.subtract(block_table)
        self._held = +self._held

    def free(self, blocks: Sequence[int]) -> None:
        """Give back blocks a request took with ``allocate`` (or as an admission's new blocks) and no longer
        needs: they hold no KV it keeps (a speculative step's rejected drafts). The rest of its hold stays."""
        self.gpu.free(list(blocks))
        self._held.subtract(blocks)
        self._held = +self._held

    def observe_recompute(self, num_tokens: int, seconds: float) -> None:
        """A forward pass computed num_tokens in `seconds`: the policy's recompute cost per token follows a moving
        average of it."""
        per_token = seconds / num_tokens
        old = self.policy.params.recompute_s_per_token
        self.policy.params = replace(self.policy.params, recompute_s_per_token=old + 0.2 * (per_token - old))

    def held_blocks(self) -> Counter[int]:
        """The requests' references per GPU block (a copy)."""
        return Counter(self._held)

    # ---- eviction and swapping ------------------------------------------------------------------------------

    def _available(self) -> int:
        """Free GPU blocks that KV and unified adapters may take: slot policies keep the empty slots' blocks."""
        if not self.policy.adapter_slots:
            return self.gpu.num_free
        empty_slots = self.config.adapter_slots - self._resident_adapters()
        return self.gpu.num_free - empty_slots * self.config.adapter_slot_blocks

    def _key(self, now: float) -> Callable[[Node], float]:
        resident = self._resident_adapters()
        return lambda node: self.policy.score(node, now, resident)

    def _room(self, num_blocks: int, now: float) -> bool:
        short = num_blocks - self._available()
        if short > 0:
            self.tree.evict(
                short,
                self._key(now),
                adapters=not self.policy.adapter_slots,
                to_host=self.policy.swaps_to_host,
                keep=lambda node: self.policy.keep_on_host(node, now),
            )
        return self._available() >= num_blocks

    def tick(self, now: float, batch_size: int = 0, waiting: int = 0) -> None:
        """Once per engine step (at least every ~100 ms), with the running (``batch_size``) and waiting requests:
        feed the policy its window and, for proactive policies, swap out down to the free watermark when below it,
        otherwise, when the policy allows it now (policy.proactive_swap_in), swap in host roots and adapters in
        descending value while the free blocks stay at or above it. Pinned adapters not yet on the GPU are loaded
        first, whenever there is room for them."""
        self.policy.observe_step(now, batch_size)
        for adapter in self.tree.adapters():
            if adapter.pinned and adapter.tier is Tier.HOST and not adapter.dropped and adapter.staged:
                self._make_resident(adapter, now)
        if not self.policy.proactive:
            return
        target = self.config.free_watermark_blocks
        if self._available() < target:
            self._room(target, now)
            return
        if not self.policy.proactive_swap_in(batch_size, waiting):
            return
        key = self._key(now)
        heap = [(-key(n), n.id, n) for n in self.tree.swap_in_candidates()]
        heapq.heapify(heap)
        while heap:
            neg_value, _, node = heapq.heappop(heap)
            if neg_value >= 0:
                break  # nothing left that the policy expects to be reused
            size = node.num_blocks if isinstance(node, AdapterNode) else len(node.blocks)
            if node.tier is not Tier.HOST or self._available() - size < target:
                continue
            if isinstance(node, AdapterNode):
                cap = self.config.max_resident_adapters
                if cap is not None and self._resident_adapters() >= cap:
                    continue
                self.tree.load_adapter(node)
            else:
                self.tree.swap_in(node)
            for child in node.children.values():
                heapq.heappush(heap, (-key(child), child.id, child))

    def take_copy_ops(self) -> list[CopyOp]:
        """The block moves and adapter loads decided since the last call, to execute in order."""
        return self.tree.take_ops()

    # ---- figures and checks ---------------------------------------------------------------------------------

    def _tree_gpu_blocks(self) -> set[int]:
        kv = {b for n in self.tree.kv_nodes() if n.tier is Tier.GPU for b in n.blocks}
        return kv | {b for a in self.tree.adapters() for b in a.blocks}

    def stats(self) -> PoolStats:
        kv_gpu = invalid = 0
        for node in self.tree.kv_nodes():
            if node.tier is Tier.GPU:
                kv_gpu += len(node.blocks)
                invalid += len(node.blocks) * (node.adapter.tier is not Tier.GPU)
        tree_gpu = self._tree_gpu_blocks()
        c, bb = self.tree.counters, self.config.block_bytes
        return PoolStats(
            adapter_hit_rate=self._adapter_hits / max(1, self._admissions),
            kv_token_hit_rate=self._cached_tokens / max(1, self._prompt_tokens),
            invalid_kv_ratio=invalid / max(1, kv_gpu),
            bytes_to_gpu=c["kv_swap_in"] * bb + c["adapter_bytes_h2d"],
            adapter_bytes_to_gpu=c["adapter_bytes_h2d"],
            bytes_to_host=c["kv_swap_out"] * bb,
            evicted_blocks={
                k: c[k] for k in ("kv_swap_out", "kv_drop", "kv_drop_host", "adapter_unload", "adapter_drop")
            },
            resident_adapters=self._resident_adapters(),
            kv_tokens_by_salt={salt: (p, h) for salt, (p, h) in self._by_salt.items()},
            gpu_free=self.gpu.num_free,
            gpu_cached=len(tree_gpu),
            gpu_in_use=len(set(self._held) - tree_gpu),
            host_free=self.host.num_free if self.host else 0,
            host_cached=self.host.num_used if self.host else 0,
        )

    def adapter_placement(self) -> list[AdapterPlacement]:
        """Each known adapter (the base model included): its tier, table page, whether it is staged, its
        pin, and the KV blocks cached under it on each tier (what a status page draws)."""
        kv: Counter[tuple[int, Tier]] = Counter()  # one pass over the KV: O(nodes), not adapters x nodes
        for n in self.tree.kv_nodes():
            kv[id(n.adapter), n.tier] += len(n.blocks)
        out = []
        for adapter in self.tree.adapters():
            if adapter.dropped:
                continue
            out.append(
                AdapterPlacement(
                    adapter.key.adapter_id,
                    adapter.tier.value,
                    adapter.table_page,
                    adapter.staged,
                    adapter.pinned,
                    len(adapter.blocks),
                    kv[id(adapter), Tier.GPU],
                    kv[id(adapter), Tier.HOST],
                )
            )
        return out

    def check_integrity(self) -> None:
        """Assert, on each tier, free + cached + in use = total and every block's reference count = the tree's
        references + the requests'; each block in at most one node; the tree's structure, tiers and locks (a
        locked node is on the GPU; a GPU KV node's parent is on the GPU, and so is its adapter where the policy
        says so); one adapter lock per admission; the slot reserve; and what each policy must never hold."""
        gpu_refs, host_refs = self.tree.check_integrity(self.policy.kv_needs_adapter)
        assert all(n == 1 for n in gpu_refs.values()) and all(n == 1 for n in host_refs.values()), (
            "a block is in two nodes"
        )
        self.gpu.check_integrity()
        for b in range(self.gpu.num_blocks):
            assert self.gpu.ref_count(b) == gpu_refs[b] + self._held[b], f"GPU block {b}: reference count is off"
        in_use = set(self._held) - set(gpu_refs)
        assert self.gpu.num_free + len(gpu_refs) + len(in_use) == self.gpu.num_blocks, "GPU: free+cached+used"
        if self.host is not None:
            self.host.check_integrity()
            for b in range(self.host.num_blocks):
                assert self.host.ref_count(b) == host_refs[b], f"host block {b}: reference count is off"
            assert self.host.num_free + len(host_refs) == self.host.num_blocks, "host: free + cached != total"
        assert sum(a.lock for a in self.tree.adapters()) == self._num_admitted, "adapter locks != admissions"
        if self.policy.adapter_slots:
            assert self._resident_adapters() <= self.config.adapter_slots and self._available() >= 0
        cap = self.config.max_resident_adapters
        assert cap is None or self.policy.adapter_slots or self._resident_adapters() <= cap, "too many adapters"
        if not self.policy.swaps_to_host:
            assert not host_refs, "a policy without a host tier holds host KV"
        if not self.policy.reuses_history_kv:
            assert next(self.tree.kv_nodes(), None) is None, "a policy without KV reuse holds cached KV"
