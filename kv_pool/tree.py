"""The tree of the unified pool: a root, one node per adapter, and under each a prefix tree of full KV blocks.

Ownership: the tree owns its structure, every node's tier, lock count, access time and hit times, and exactly one
reference on each block a node lists (on the GPU BlockPool for GPU nodes and resident adapter weights, on the host
BlockPool for host nodes). It never touches tensors: every move is recorded as a CopyOp in `ops`, which the engine
executes in order. Which node goes first is not decided here: `evict` takes a key function from a policy.

Shape of the tree. The root's children are AdapterNodes keyed by adapter id (the registry's content id: equal
weights, equal id; other weights get a new id); the base model is the node BASE ("no adapter", no weights). Below an
adapter, a child is keyed by (tenant salt, its first block's tokens), so KV is only ever shared by requests with the
same salt and adapter weights. A KVNode holds a
run of full blocks, all on one tier. Along any path from an adapter the GPU nodes come first: only GPU leaves are
swapped out and only host roots (host nodes whose parent is on the GPU) are swapped in.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from lora_server.kv_pool.block_pool import BlockPool

BASE_ADAPTER_ID = -1
HIT_HISTORY = 256  # hit times kept per node; enough for any reuse window the policies use


class Tier(Enum):
    GPU = "gpu"
    HOST = "host"  # KV: in host blocks; an adapter: not on the device (its weights staged on the host, or on disk)
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class AdapterKey:
    adapter_id: int  # BASE_ADAPTER_ID (-1) is the base model


BASE = AdapterKey(BASE_ADAPTER_ID)


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """Everything that must be equal for two requests to share KV."""

    salt: str  # the tenant's cache salt, derived by the server, never by the client
    adapter_id: int = BASE_ADAPTER_ID

    @property
    def adapter(self) -> AdapterKey:
        return AdapterKey(self.adapter_id)


class OpKind(Enum):
    KV_SWAP_OUT = "kv_swap_out"  # copy GPU blocks `src` to host blocks `dst`
    KV_SWAP_IN = "kv_swap_in"  # copy host blocks `src` to GPU blocks `dst`
    ADAPTER_LOAD = "adapter_load"  # write `adapter`'s staged pages into GPU blocks `dst` (dst[0]: its table page)
    ADAPTER_UNLOAD = "adapter_unload"  # `adapter` left GPU blocks `src` (src[0] was its table page); nothing to copy


@dataclass(frozen=True, slots=True)
class CopyOp:
    kind: OpKind
    src: tuple[int, ...] = ()  # [n] block ids on the source tier
    dst: tuple[int, ...] = ()  # [n] block ids on the destination tier
    adapter: AdapterKey | None = None


ChildKey = tuple[str, tuple[int, ...]]  # (salt, the tokens of the child's first block)


@dataclass(eq=False, slots=True)
class AdapterNode:
    id: int
    key: AdapterKey
    num_bytes: int
    num_blocks: int  # weight size in GPU blocks
    tier: Tier = Tier.HOST
    blocks: list[int] = field(default_factory=list)  # GPU blocks (arena pages) holding its weights while on the GPU
    pinned: bool = False  # never evicted from the GPU (it may still be dropped: unloaded or replaced)
    staged: bool = False  # its weights are ready on the host to be copied in (the engine's loader says so)
    children: dict[ChildKey, KVNode] = field(default_factory=dict)
    lock: int = 0  # locked handles at or below this node
    last_access: float = 0.0
    dropped: bool = False  # unloaded or replaced: unreachable, freed piece by piece as its locks end

    @property
    def parent(self) -> None:
        return None

    @property
    def table_page(self) -> int:
        """Where the LoRA kernels find it: its first GPU block, which starts with its table; -1 off the GPU (and for
        the base model, which has no weights)."""
        return self.blocks[0] if self.tier is Tier.GPU and self.blocks else -1


@dataclass(eq=False, slots=True)
class KVNode:
    id: int
    adapter: AdapterNode
    parent: AdapterNode | KVNode
    salt: str  # the cache salt of every request that shares it
    keys: list[tuple[int, ...]]  # [num blocks] the tokens of each block
    blocks: list[int]  # [num blocks] block ids on `tier`
    tier: Tier
    prefix_blocks: int  # blocks from the adapter through the end of this node
    children: dict[ChildKey, KVNode] = field(default_factory=dict)
    lock: int = 0
    last_access: float = 0.0
    hit_times: deque[float] = field(default_factory=lambda: deque(maxlen=HIT_HISTORY))

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * len(self.keys[0])


Node = AdapterNode | KVNode


@dataclass(frozen=True, slots=True)
class Handle:
    """A matched path: `node` and its ancestors up to the adapter.

    While locked, every node on the path stays on the GPU with the same block ids (splits may cut a node in two;
    the path's blocks stay the same), so the caller may read and share them. Unlocked, it is a hint only."""

    key: PrefixKey
    node: Node

    @property
    def num_blocks(self) -> int:
        return _prefix_blocks(self.node)


def _prefix_blocks(node: Node) -> int:
    return node.prefix_blocks if isinstance(node, KVNode) else 0


def lru_key(node: Node) -> float:
    return node.last_access


def _common(a: Sequence[tuple[int, ...]], b: Sequence[tuple[int, ...]]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class PrefixTree:
    def __init__(self, block_size: int, gpu: BlockPool, host: BlockPool | None) -> None:
        self.block_size, self.gpu, self.host = block_size, gpu, host
        self._ids = itertools.count()
        self._adapters: dict[AdapterKey, AdapterNode] = {}
        self._dropped: set[AdapterNode] = set()  # dropped but still locked by running requests
        self.ops: list[CopyOp] = []
        self.counters: Counter[str] = Counter()  # blocks evicted by kind, blocks and bytes moved
        self._adapters[BASE] = AdapterNode(next(self._ids), BASE, 0, 0, Tier.GPU)

    def take_ops(self) -> list[CopyOp]:
        ops, self.ops = self.ops, []
        return ops

    # ---- adapters -------------------------------------------------------------------------------------------

    def add_adapter(
        self, key: AdapterKey, num_bytes: int, num_blocks: int, pinned: bool = False, staged: bool = False
    ) -> AdapterNode:
        """Make an adapter known (tier HOST: not on the device; ``staged``: its weights are ready on the
        host)."""
        if key in self._adapters:
            raise ValueError(f"adapter {key} is already in the tree")
        node = AdapterNode(next(self._ids), key, num_bytes, num_blocks, pinned=pinned, staged=staged)
        self._adapters[key] = node
        return node

    def adapter(self, key: AdapterKey) -> AdapterNode | None:
        return self._adapters.get(key)

    def adapters(self) -> list[AdapterNode]:
        """Every adapter node, reachable or dropped-but-locked."""
        return [*self._adapters.values(), *self._dropped]

    def load_adapter(self, node: AdapterNode, num_blocks: int | None = None) -> None:
        """Put the weights on the GPU (num_blocks: pad to a slot size). Raises OutOfBlocksError, changing nothing."""
        assert node.tier is Tier.HOST and not node.dropped, f"cannot load {node.key} from {node.tier}"
        assert node.staged, f"{node.key} is not staged on the host"
        node.blocks = self.gpu.allocate(node.num_blocks if num_blocks is None else num_blocks)
        node.tier = Tier.GPU
        self.ops.append(CopyOp(OpKind.ADAPTER_LOAD, dst=tuple(node.blocks), adapter=node.key))
        self.counters["adapter_bytes_h2d"] += node.num_bytes

    def unload_adapter(self, node: AdapterNode, reason: str = "adapter_unload") -> None:
        """Free the weights' GPU blocks. The tree does not require its KV to leave first; policies that do
        (kv_needs_adapter) only pick adapters without KV on the GPU."""
        assert node.tier is Tier.GPU and node.lock == 0 and node.key != BASE, f"cannot unload {node.key}"
        self.ops.append(CopyOp(OpKind.ADAPTER_UNLOAD, src=tuple(node.blocks), adapter=node.key))
        self.counters[reason] += len(node.blocks)
        self.gpu.free(node.blocks)
        node.blocks, node.tier = [], Tier.HOST

    def drop_adapter(self, adapter_id: int) -> bool:
        """Unload: the adapter becomes unreachable at once and its subtree is freed; locked parts (running
        requests) are freed when their last lock ends. Returns whether the tree knew it."""
        if adapter_id == BASE_ADAPTER_ID:
            raise ValueError("the base model cannot be dropped")
        node = self._adapters.pop(AdapterKey(adapter_id), None)
        if node is None:
            return False
        node.dropped = True
        self._dropped.add(node)
        self._prune(node)
        return True

    def _prune(self, adapter: AdapterNode) -> None:
        stack: list[Node] = [adapter]
        while stack:
            for child in list(stack.pop().children.values()):
                if child.lock == 0:
                    self.drop(child, "adapter_drop")
                else:
                    stack.append(child)
        if adapter.lock == 0:
            if adapter.tier is Tier.GPU:
                self.unload_adapter(adapter, "adapter_drop")
            adapter.tier = Tier.DROPPED
            self._dropped.discard(adapter)

    # ---- prefixes -------------------------------------------------------------------------------------------

    def _block_keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]

    def match_prefix(
        self, key: PrefixKey, tokens: Sequence[int], now: float, touch: bool = True
    ) -> tuple[list[int], int, Handle]:
        """Longest cached prefix of `tokens` under `key`, by full blocks, GPU and host nodes alike.

        Returns (the GPU blocks of the path's leading GPU nodes, the tokens they hold, a handle to the whole path).
        A match that ends inside a node splits it, so the handle ends exactly at the match. With `touch`, records a
        hit and the access time on each node of the path (otherwise the caller calls touch() once the match is
        used). Raises KeyError for an adapter the tree does not know."""
        node: Node = self._adapters[key.adapter]
        keys, salt = self._block_keys(tokens), key.salt
        gpu_blocks: list[int] = []
        on_gpu, i = True, 0
        while i < len(keys) and (child := node.children.get((salt, keys[i]))) is not None:
            n = _common(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            on_gpu = on_gpu and child.tier is Tier.GPU
            if on_gpu:
                gpu_blocks += child.blocks
            node, i = child, i + n
        handle = Handle(key, node)
        if touch:
            self.touch(handle, now)
        return gpu_blocks, len(gpu_blocks) * self.block_size, handle

    def touch(self, handle: Handle, now: float) -> None:
        """Record a use at `now` on the path: access times, and a hit on each KV node."""
        node: Node | None = handle.node
        while node is not None:
            node.last_access = now
            if isinstance(node, KVNode):
                node.hit_times.append(now)
            node = node.parent

    def insert(self, parent: Handle, tokens: Sequence[int], blocks: Sequence[int], now: float) -> Handle:
        """Offer the KV of `tokens` (the tokens that follow parent's path; full blocks only) held in the caller's
        GPU `blocks` ([one per full block]). `parent` must be locked by the caller.

        The tree takes its own reference on each block it adopts; where it already holds GPU KV for the same tokens
        it keeps its own and the caller's block is left alone (the caller frees its references as usual). A host
        node for the same tokens takes the caller's GPU copy instead (a swap-in without the copy). Returns a handle
        (not locked) to the node that ends at the last full block; nothing is inserted under a dropped adapter."""
        node = parent.node
        assert node.lock > 0 and node.tier is Tier.GPU, "insert under an unlocked or non-GPU handle"
        adapter = node if isinstance(node, AdapterNode) else node.adapter
        keys, salt = self._block_keys(tokens), parent.key.salt
        assert len(blocks) >= len(keys), "fewer blocks than full token blocks"
        i = 0
        while i < len(keys) and not adapter.dropped:
            child = node.children.get((salt, keys[i]))
            if child is None:
                new = KVNode(
                    next(self._ids),
                    adapter,
                    node,
                    salt,
                    keys[i:],
                    list(blocks[i : len(keys)]),
                    Tier.GPU,
                    _prefix_blocks(node) + len(keys) - i,
                    last_access=now,
                )
                new.hit_times.append(now)  # the request that computed it counts as its first use
                self.gpu.share(new.blocks)
                node.children[(salt, keys[i])] = new
                return Handle(parent.key, new)
            n = _common(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            if child.tier is Tier.HOST:  # node is on the GPU, so child is a host root
                assert self.host is not None
                self.host.free(child.blocks)
                child.blocks, child.tier = list(blocks[i : i + n]), Tier.GPU
                self.gpu.share(child.blocks)
            child.last_access = now
            node, i = child, i + n
        return Handle(parent.key, node)

    def _split(self, node: KVNode, k: int) -> KVNode:
        """Cut `node` after its first k blocks. A new node takes the head and becomes node's parent; node keeps the
        tail and its children, so handles to node stay valid and lock counts along every path stay right."""
        assert 0 < k < len(node.keys)
        head = KVNode(
            next(self._ids),
            node.adapter,
            node.parent,
            node.salt,
            node.keys[:k],
            node.blocks[:k],
            node.tier,
            node.prefix_blocks - len(node.keys) + k,
            lock=node.lock,
            last_access=node.last_access,
            hit_times=deque(node.hit_times, maxlen=HIT_HISTORY),
        )
        node.parent.children[(node.salt, node.keys[0])] = head
        node.keys, node.blocks, node.parent = node.keys[k:], node.blocks[k:], head
        head.children[(node.salt, node.keys[0])] = node
        return head

    # ---- locks ----------------------------------------------------------------------------------------------

    def lock(self, handle: Handle) -> None:
        """Pin the path (it must be on the GPU): no node of it is evicted or moved until unlock."""
        node: Node | None = handle.node
        while node is not None:
            assert node.tier is Tier.GPU, "only a path on the GPU can be locked"
            node.lock += 1
            node = node.parent

    def unlock(self, handle: Handle) -> None:
        adapter = handle.node if isinstance(handle.node, AdapterNode) else handle.node.adapter
        node: Node | None = handle.node
        while node is not None:
            assert node.lock > 0, "unlock without lock"
            node.lock -= 1
            node = node.parent
        if adapter.dropped:
            self._prune(adapter)

    def path(self, handle: Handle) -> list[KVNode]:
        """The KV nodes of the path, top first."""
        nodes, node = [], handle.node
        while isinstance(node, KVNode):
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def path_blocks(self, handle: Handle) -> list[int]:
        return [b for node in self.path(handle) for b in node.blocks]

    # ---- moves ----------------------------------------------------------------------------------------------

    def swap_out(self, node: KVNode) -> None:
        """Move an unlocked GPU leaf (no child on the GPU) to the host. Raises OutOfBlocksError without host room."""
        assert node.tier is Tier.GPU and node.lock == 0, "only unlocked GPU nodes swap out"
        assert all(c.tier is not Tier.GPU for c in node.children.values()), "only GPU leaves swap out"
        assert self.host is not None, "no host tier"
        dst = self.host.allocate(len(node.blocks))
        self.ops.append(CopyOp(OpKind.KV_SWAP_OUT, tuple(node.blocks), tuple(dst)))
        self.counters["kv_swap_out"] += len(dst)
        self.gpu.free(node.blocks)
        node.blocks, node.tier = dst, Tier.HOST

    def swap_in(self, node: KVNode) -> None:
        """Move a host root (a host node whose parent is on the GPU) to the GPU. Raises OutOfBlocksError without
        GPU room, changing nothing."""
        assert node.tier is Tier.HOST and node.parent.tier is Tier.GPU, "only host roots swap in"
        assert self.host is not None
        dst = self.gpu.allocate(len(node.blocks))
        self.ops.append(CopyOp(OpKind.KV_SWAP_IN, tuple(node.blocks), tuple(dst)))
        self.counters["kv_swap_in"] += len(dst)
        self.host.free(node.blocks)
        node.blocks, node.tier = dst, Tier.GPU

    def drop(self, node: KVNode, reason: str = "kv_drop") -> None:
        """Free an unlocked node and its whole subtree, on whichever tier each part is."""
        assert node.lock == 0, "a locked node cannot be dropped"
        del node.parent.children[(node.salt, node.keys[0])]
        for n in self._subtree(node):
            (self.gpu if n.tier is Tier.GPU else self.host).free(n.blocks)  # type: ignore[union-attr]
            self.counters[reason] += len(n.blocks)
            n.tier = Tier.DROPPED

    def _subtree(self, node: Node) -> Iterator[KVNode]:
        stack = [node] if isinstance(node, KVNode) else list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def _with_subtree(self, adapter: AdapterNode) -> Iterator[Node]:
        yield adapter
        yield from self._subtree(adapter)

    def kv_nodes(self) -> Iterator[KVNode]:
        for adapter in self.adapters():
            yield from self._subtree(adapter)

    def evictable(self, node: Node, adapters: bool) -> bool:
        """An unlocked GPU leaf: nothing below it on the GPU (adapters only when `adapters`, never pinned ones)."""
        if node.tier is not Tier.GPU or node.lock > 0 or any(c.tier is Tier.GPU for c in node.children.values()):
            return False
        return isinstance(node, KVNode) or (adapters and node.num_blocks > 0 and not node.dropped and not node.pinned)

    def swap_in_candidates(self) -> Iterator[Node]:
        """Host roots, and the adapters that are not on the GPU but staged on the host."""
        for adapter in self._adapters.values():
            if adapter.tier is Tier.HOST and adapter.staged:
                yield adapter
            elif adapter.tier is Tier.GPU:
                yield from (n for n in self._subtree(adapter) if n.tier is Tier.HOST and n.parent.tier is Tier.GPU)

    def evict(
        self,
        num_blocks: int,
        key: Callable[[Node], float] = lru_key,
        *,
        adapters: bool = False,
        to_host: bool = False,
        keep: Callable[[KVNode], bool] = lambda node: True,
    ) -> int:
        """Free at least num_blocks GPU blocks, or as many as can be: evictable GPU leaves go in ascending `key`
        (KV nodes, and adapters with no KV on the GPU when `adapters`). A KV victim larger than what is still
        needed is split and only its tail goes. With `to_host` a KV victim that `keep` says is worth its copy is
        swapped out when the host has room or can be given room by dropping colder host leaves; otherwise it is
        dropped with its host descendants. Returns the number of GPU blocks freed."""
        heap = [
            (key(n), n.last_access, n.id, n)
            for a in self.adapters()
            for n in self._with_subtree(a)
            if self.evictable(n, adapters)
        ]
        heapq.heapify(heap)
        host_leaves: list[tuple[float, float, int, KVNode]] | None = None
        freed = 0
        while freed < num_blocks and heap:
            score, _, _, node = heapq.heappop(heap)
            if not self.evictable(node, adapters):
                continue
            if isinstance(node, AdapterNode):
                freed += len(node.blocks)
                self.unload_adapter(node)
                continue
            if len(node.blocks) > num_blocks - freed:
                self._split(node, len(node.blocks) - (num_blocks - freed))
            parent, freed = node.parent, freed + len(node.blocks)
            if to_host and self.host is not None and keep(node):
                if host_leaves is None:
                    host_leaves = [
                        (key(n), n.last_access, n.id, n)
                        for n in self.kv_nodes()
                        if n.tier is Tier.HOST and not n.children
                    ]
                    heapq.heapify(host_leaves)
                if self._make_host_room(len(node.blocks), score, key, host_leaves):
                    self.swap_out(node)
                    if not node.children:
                        heapq.heappush(host_leaves, (key(node), node.last_access, node.id, node))
                else:
                    self.drop(node)
            else:
                self.drop(node)
            if self.evictable(parent, adapters):
                heapq.heappush(heap, (key(parent), parent.last_access, parent.id, parent))
        return freed

    def evict_adapter(self, adapter: AdapterNode, to_host: bool) -> None:
        """Take an unlocked adapter off the GPU together with its GPU KV: each GPU node, deepest first, goes to the
        host when `to_host` and the host has room, otherwise it is dropped with what is below it; then the
        weights are unloaded."""
        assert adapter.tier is Tier.GPU and adapter.lock == 0 and adapter.key != BASE
        order: list[KVNode] = []
        stack = [c for c in adapter.children.values() if c.tier is Tier.GPU]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(c for c in node.children.values() if c.tier is Tier.GPU)
        for node in reversed(order):  # children before their parents
            if to_host and self.host is not None and self.host.num_free >= len(node.blocks):
                self.swap_out(node)
            else:
                self.drop(node)
        self.unload_adapter(adapter)

    def _make_host_room(
        self, need: int, score: float, key: Callable[[Node], float], leaves: list[tuple[float, float, int, KVNode]]
    ) -> bool:
        """Drop host leaves colder than `score`, coldest first, until `need` host blocks are free."""
        assert self.host is not None
        while self.host.num_free < need:
            while leaves and (leaves[0][3].tier is not Tier.HOST or leaves[0][3].children):
                heapq.heappop(leaves)  # stale: moved, dropped, or got a child
            if not leaves or leaves[0][0] >= score:
                return False
            leaf = heapq.heappop(leaves)[3]
            self.drop(leaf, "kv_drop_host")
            parent = leaf.parent
            if isinstance(parent, KVNode) and parent.tier is Tier.HOST and not parent.children:
                heapq.heappush(leaves, (key(parent), parent.last_access, parent.id, parent))
        return True

    # ---- checks ---------------------------------------------------------------------------------------------

    def check_integrity(self, kv_needs_adapter: bool) -> tuple[Counter[int], Counter[int]]:
        """Assert the structure, tiers and lock counts; return the tree's references per GPU and per host block."""
        gpu: Counter[int] = Counter()
        host: Counter[int] = Counter()
        for adapter in self.adapters():
            assert adapter.tier is not Tier.DROPPED
            assert (adapter.tier is Tier.GPU) == bool(adapter.blocks) or adapter.num_blocks == 0
            gpu.update(adapter.blocks)
            for node in self._with_subtree(adapter):
                assert node.lock >= sum(c.lock for c in node.children.values()), "lock counts are inconsistent"
                assert node.lock == 0 or node.tier is Tier.GPU, "a locked node left the GPU"
                for child_key, child in node.children.items():
                    assert child.parent is node and child_key == (child.salt, child.keys[0])
                    assert child.adapter is adapter and child.tier in (Tier.GPU, Tier.HOST)
                    assert len(child.keys) == len(child.blocks) > 0
                    assert all(len(k) == self.block_size for k in child.keys)
                    assert child.prefix_blocks == _prefix_blocks(node) + len(child.keys)
                    if child.tier is Tier.GPU:
                        assert isinstance(node, AdapterNode) or node.tier is Tier.GPU, "a GPU node under a host node"
                        assert not kv_needs_adapter or adapter.tier is Tier.GPU, "KV on the GPU without its adapter"
                        gpu.update(child.blocks)
                    else:
                        host.update(child.blocks)
        return gpu, host
