"""Eviction and swap policies of the unified pool, in a registry keyed by name.

A policy orders and decides; the pool and the tree do the moves. Its class flags say which mechanisms the pool
uses for it; `score` is a keep-value: the pool evicts in ascending score and swaps in (tree-cost) in descending
score. Policies own only their observation windows, never blocks or nodes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass
from typing import ClassVar

from lora_server.kv_pool.tree import BASE_ADAPTER_ID, AdapterKey, AdapterNode, KVNode, Node


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """The cost model's inputs. The engine measures the copy costs on its device at start (ModelRunner.
    measure_copy_costs) and follows the recompute cost as prefill steps run; the defaults are a PCIe 4 GPU's."""

    h2d_bytes_per_s: float = 25e9  # host-to-device copy bandwidth (pinned memory)
    d2h_bytes_per_s: float = 25e9  # device-to-host copy bandwidth
    copy_latency_s: float = 0.0  # the fixed cost of one block's (or one adapter's) copy, beside its bytes
    # whether a copy takes its time from the forward passes (the CPU: the same cores copy and compute) rather than
    # overlapping them (CUDA: side streams)
    copies_stall_compute: bool = False
    recompute_s_per_token: float = 1e-4  # prefill time per token: the cost of recomputing dropped KV
    window_s: float = 60.0  # the recent window of reuse probabilities and adapter shares; the recency decay's scale
    batch_size: float = 16.0  # BS of the expected-adapter count until step batch sizes are observed

    def __post_init__(self) -> None:
        rates = (self.h2d_bytes_per_s, self.d2h_bytes_per_s, self.recompute_s_per_token, self.window_s)
        if min(*rates, self.batch_size) <= 0 or self.copy_latency_s < 0:
            raise ValueError("policy parameters must be positive (the copy latency >= 0)")


class Policy(ABC):
    name: ClassVar[str]
    reuses_history_kv: ClassVar[bool] = True  # ended requests' full blocks stay in the tree and are matched
    kv_needs_adapter: ClassVar[bool] = True  # KV stays on the GPU only while its adapter does
    swaps_to_host: ClassVar[bool] = False  # evicted KV goes to the host tier (otherwise it is dropped)
    adapter_slots: ClassVar[bool] = False  # adapters sit in fixed reserved slots, evicted LRU among themselves
    proactive: ClassVar[bool] = False  # tick() swaps out below and swaps in above the free-block watermark

    def __init__(self, params: PolicyParams, block_bytes: int) -> None:
        self.params, self.block_bytes = params, block_bytes

    def observe(self, adapter: AdapterKey, now: float) -> None:
        """A request for `adapter` was admitted at `now`. The LRU policies keep no window."""
        return None

    def observe_step(self, now: float, batch_size: int) -> None:
        """An engine step ran `batch_size` requests at `now`."""
        return None

    @abstractmethod
    def score(self, node: Node, now: float, resident_adapters: int) -> float:
        """Keep-value of a node (adapter or KV) at `now`; pure."""

    def should_swap_in(self, node: KVNode) -> bool:
        """Restore a matched host node by swapping it in (True) rather than recomputing it."""
        return False

    def keep_on_host(self, node: KVNode, now: float) -> bool:
        """Whether an evicted GPU node is worth its copy to the host tier (policies that swap to the host)."""
        return True

    def proactive_swap_in(self, running: int, waiting: int) -> bool:
        """Whether tick() may bring host nodes and adapters back while ``running`` requests run and ``waiting``
        wait (proactive policies)."""
        return True


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, params: PolicyParams, block_bytes: int) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown pool policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](params, block_bytes)


@register
class TreeCost(Policy):
    """FastLibra's cost model: Eval = LoRA_Eval x Retain_Eval.

    Retain_Eval = restore cost x reuse probability x recency decay, where the restore cost of KV is the cheaper of
    swapping it in (bytes / H2D bandwidth) and recomputing its tokens (its ancestors stay cached: only leaves
    leave), and of an adapter the time to load its weights; the reuse probability is the node's hits (an adapter's
    requests) over the requests in the window; the decay is exp(-age / window). LoRA_Eval is 1 for KV and, for
    adapters, expected / resident, where expected = sum_i [1 - (1 - p_i)^BS] is the number of distinct adapters a
    batch is expected to need (p_i: adapter i's share of the window's requests, base model excluded; BS: the mean
    batch size, a moving average of observed steps): with
    fewer adapters resident than expected, adapters outrank KV; with more, KV outranks them.

    Copies are priced as measured on the engine's device: a block's swap costs copy_latency_s plus its bytes over
    the direction's bandwidth. Evicted KV goes to the host only when its expected saving, reuse probability x decay
    x (recomputing it - swapping it back), exceeds what the copy out costs now: nothing on CUDA, where copies
    overlap the forward pass, its copy time on the CPU, where they stall it. Host nodes and adapters come back
    ahead of need (tick) only while nothing waits for compute, and where copies stall compute only while the
    engine is idle: there a restore at admission costs the same copy, and only when it is needed."""

    name = "tree-cost"
    swaps_to_host = True
    proactive = True

    def __init__(self, params: PolicyParams, block_bytes: int) -> None:
        super().__init__(params, block_bytes)
        self._arrivals: deque[tuple[float, AdapterKey]] = deque()
        self._per_adapter: Counter[AdapterKey] = Counter()
        self.batch_size = params.batch_size

    def observe(self, adapter: AdapterKey, now: float) -> None:
        self._arrivals.append((now, adapter))
        self._per_adapter[adapter] += 1
        self._expire(now)

    def observe_step(self, now: float, batch_size: int) -> None:
        if batch_size > 0:
            self.batch_size += 0.1 * (batch_size - self.batch_size)
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now - self.params.window_s:
            _, adapter = self._arrivals.popleft()
            self._per_adapter[adapter] -= 1
            if not self._per_adapter[adapter]:
                del self._per_adapter[adapter]

    def adapter_share(self, adapter: AdapterKey) -> float:
        return self._per_adapter[adapter] / max(1, len(self._arrivals))

    def expected_adapters(self) -> float:
        n = max(1, len(self._arrivals))
        return sum(
            1 - (1 - c / n) ** self.batch_size for a, c in self._per_adapter.items() if a.adapter_id != BASE_ADAPTER_ID
        )  # the base model holds no slot

    def reuse_probability(self, node: KVNode, now: float) -> float:
        hits = sum(1 for t in node.hit_times if t >= now - self.params.window_s)
        return min(1.0, hits / max(1, len(self._arrivals)))

    def swap_in_s(self, node: KVNode) -> float:
        p = self.params
        return len(node.blocks) * (p.copy_latency_s + self.block_bytes / p.h2d_bytes_per_s)

    def swap_out_s(self, node: KVNode) -> float:
        p = self.params
        return len(node.blocks) * (p.copy_latency_s + self.block_bytes / p.d2h_bytes_per_s)

    def recompute_s(self, node: KVNode) -> float:
        return node.num_tokens * self.params.recompute_s_per_token

    def decay(self, node: Node, now: float) -> float:
        return math.exp(-max(0.0, now - node.last_access) / self.params.window_s)

    def score(self, node: Node, now: float, resident_adapters: int) -> float:
        decay = self.decay(node, now)
        if isinstance(node, AdapterNode):
            lora_eval = self.expected_adapters() / max(1, resident_adapters)
            restore = self.params.copy_latency_s + node.num_bytes / self.params.h2d_bytes_per_s
            return lora_eval * restore * self.adapter_share(node.key) * decay
        restore = min(self.swap_in_s(node), self.recompute_s(node))
        return restore * self.reuse_probability(node, now) * decay

    def should_swap_in(self, node: KVNode) -> bool:
        return self.swap_in_s(node) < self.recompute_s(node)

    def keep_on_host(self, node: KVNode, now: float) -> bool:
        if not self.params.copies_stall_compute:
            return True
        saving = (
            self.reuse_probability(node, now) * self.decay(node, now) * (self.recompute_s(node) - self.swap_in_s(node))
        )
        return saving > self.swap_out_s(node)

    def proactive_swap_in(self, running: int, waiting: int) -> bool:
        return waiting == 0 and not (self.params.copies_stall_compute and running > 0)


class _Lru(Policy):
    def score(self, node: Node, now: float, resident_adapters: int) -> float:
        return node.last_access


@register
class LruSeparate(_Lru):
    """vLLM-like: adapters in fixed slots reserved up front, LRU among themselves; an LRU prefix cache that
    ignores adapters, so KV of an evicted adapter may stay on the GPU (invalid KV). No host tier for KV."""

    name = "lru-separate"
    kv_needs_adapter = False
    adapter_slots = True


@register
class LruUnified(_Lru):
    """S-LoRA-like: adapters and KV in one pool, LRU adapters; KV lives only as long as its request (no reuse)."""

    name = "lru-unified"
    reuses_history_kv = False
