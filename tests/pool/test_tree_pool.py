"""kv_pool tree, policies and UnifiedPool: hand-computed states, isolation, the invalid-KV ratio of each policy, and a
seeded random run that simulates the engine's copies and checks integrity at every step."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, replace

import pytest

from lora_server.kv_pool.block_pool import BlockPool, OutOfBlocksError
from lora_server.kv_pool.policies import POLICIES, PolicyParams, TreeCost
from lora_server.kv_pool.tree import (
    BASE_ADAPTER_ID,
    AdapterKey,
    CopyOp,
    Handle,
    OpKind,
    PrefixKey,
    PrefixTree,
    Tier,
)
from lora_server.kv_pool.unified_pool import PoolConfig, UnifiedPool

A1 = AdapterKey(1)
K1 = PrefixKey("t1", 1)


def make_tree(gpu_blocks=16, host_blocks=4, adapters=((A1, 2),)) -> PrefixTree:
    tree = PrefixTree(2, BlockPool(gpu_blocks, 2), BlockPool(host_blocks, 2))
    for key, blocks in adapters:
        tree.load_adapter(tree.add_adapter(key, 100 * blocks, blocks, staged=True))
    return tree


def put(tree: PrefixTree, key: PrefixKey, tokens: list[int], now: float) -> Handle:
    """What a request does: lock the adapter, compute into its own blocks, offer them, unlock, free its refs."""
    top = Handle(key, tree.adapter(key.adapter))
    tree.lock(top)
    table = tree.gpu.allocate(tree.gpu.blocks_for_tokens(len(tokens)))
    handle = tree.insert(top, tokens, table, now)
    tree.unlock(top)
    tree.gpu.free(table)
    return handle


def dump(tree: PrefixTree, key: AdapterKey) -> dict[tuple[int, ...], tuple[str, list[int]]]:
    """Each node as {all tokens from the adapter through its end: (tier, block ids)}."""
    out = {}
    for node in tree.kv_nodes():
        if node.adapter.key == key:
            tokens = tuple(t for n in tree.path(Handle(K1, node)) for k in n.keys for t in k)
            out[tokens] = (node.tier.value, node.blocks)
    return out


# ---- the tree ---------------------------------------------------------------------------------------------------


def test_insert_match_and_split():
    tree = make_tree()
    assert tree.take_ops() == [CopyOp(OpKind.ADAPTER_LOAD, dst=(0, 1), adapter=A1)]
    blocks, n, top = tree.match_prefix(K1, [1, 2, 3, 4, 5, 6, 7], now=1.0)
    assert (blocks, n, top.node) == ([], 0, tree.adapter(A1))

    tree.lock(top)
    table = tree.gpu.allocate(4)  # 7 tokens: 3 full blocks and a partial one
    assert table == [2, 3, 4, 5]
    tree.insert(top, [1, 2, 3, 4, 5, 6, 7], table, now=1.0)
    assert [tree.gpu.ref_count(b) for b in table] == [2, 2, 2, 1]  # the partial block is not the tree's
    tree.unlock(top)
    tree.gpu.free(table)
    assert dump(tree, A1) == {(1, 2, 3, 4, 5, 6): ("gpu", [2, 3, 4])}

    blocks, n, h = tree.match_prefix(K1, [1, 2, 3, 4, 5, 6, 7, 8], now=2.0)
    assert (blocks, n, h.num_blocks) == ([2, 3, 4], 6, 3)
    whole = h.node

    blocks, n, h = tree.match_prefix(K1, [1, 2, 3, 4, 9, 9], now=3.0)  # ends inside the node: split
    assert (blocks, n, h.num_blocks) == ([2, 3], 4, 2)
    assert dump(tree, A1) == {(1, 2, 3, 4): ("gpu", [2, 3]), (1, 2, 3, 4, 5, 6): ("gpu", [4])}
    assert whole.parent is h.node and whole.prefix_blocks == 3  # the old node kept the tail
    assert list(h.node.hit_times) == [1.0, 2.0, 3.0] and list(whole.hit_times) == [1.0, 2.0]

    tree.lock(h)  # diverges at a block boundary: a new child, no split
    table = tree.gpu.allocate(2)
    tree.insert(h, [9, 9, 9], table, now=4.0)
    tree.unlock(h)
    tree.gpu.free(table)
    tree.lock(top)  # diverges inside the first node: split; the duplicate first block stays the caller's
    table = tree.gpu.allocate(2)
    tree.insert(top, [1, 2, 7, 7], table, now=5.0)
    tree.unlock(top)
    assert [tree.gpu.ref_count(b) for b in table] == [1, 2]
    assert dump(tree, A1) == {
        (1, 2): ("gpu", [2]),
        (1, 2, 3, 4): ("gpu", [3]),
        (1, 2, 3, 4, 5, 6): ("gpu", [4]),
        (1, 2, 3, 4, 9, 9): ("gpu", [6]),
        (1, 2, 7, 7): ("gpu", [table[1]]),
    }
    assert tree.adapter(A1).lock == 0 and all(n.lock == 0 for n in tree.kv_nodes())
    tree.check_integrity(kv_needs_adapter=True)


def test_evict_swap_out_swap_in_and_locks():
    tree = make_tree(gpu_blocks=12, host_blocks=2)
    tree.take_ops()
    put(tree, K1, [1, 2, 3, 4, 5, 6], now=1.0)  # blocks 2, 3, 4
    put(tree, K1, [1, 2, 7, 8], now=2.0)  # splits; (1, 2) exists, so 5 is the caller's; (7, 8) takes 6
    assert dump(tree, A1) == {(1, 2): ("gpu", [2]), (1, 2, 3, 4, 5, 6): ("gpu", [3, 4]), (1, 2, 7, 8): ("gpu", [6])}

    assert tree.evict(1) == 1  # LRU leaf is (3..6), last used at 1: only its tail goes
    assert dump(tree, A1) == {(1, 2): ("gpu", [2]), (1, 2, 3, 4): ("gpu", [3]), (1, 2, 7, 8): ("gpu", [6])}
    assert tree.gpu.ref_count(4) == 0

    assert tree.evict(1, to_host=True) == 1
    assert tree.take_ops() == [CopyOp(OpKind.KV_SWAP_OUT, (3,), (0,))]
    assert dump(tree, A1)[(1, 2, 3, 4)] == ("host", [0])

    blocks, n, h = tree.match_prefix(K1, [1, 2, 3, 4, 5, 6], now=3.0)
    assert (blocks, n, h.num_blocks, h.node.tier) == ([2], 2, 2, Tier.HOST)
    with pytest.raises(AssertionError):
        tree.lock(h)  # a path reaching the host cannot be locked
    tree.swap_in(h.node)
    assert tree.take_ops() == [CopyOp(OpKind.KV_SWAP_IN, (0,), (7,))]
    assert dump(tree, A1)[(1, 2, 3, 4)] == ("gpu", [7]) and tree.host.num_free == 2

    y = Handle(K1, tree.match_prefix(K1, [1, 2, 7, 8], now=0.5)[2].node)
    tree.lock(y)
    with pytest.raises(AssertionError):
        tree.swap_out(y.node)
    assert tree.evict(10, adapters=True) == 1  # only (3, 4): the locked path and its adapter stay
    assert dump(tree, A1) == {(1, 2): ("gpu", [2]), (1, 2, 7, 8): ("gpu", [6])}
    tree.unlock(y)
    tree.take_ops()
    assert tree.evict(10, adapters=True) == 4  # (7, 8), then (1, 2), then the adapter, now without KV
    assert dump(tree, A1) == {} and tree.adapter(A1).tier is Tier.HOST
    assert tree.take_ops() == [CopyOp(OpKind.ADAPTER_UNLOAD, src=(0, 1), adapter=A1)]
    assert tree.gpu.num_free == 12
    assert tree.counters["kv_drop"] == 4 and tree.counters["kv_swap_out"] == 1 and tree.counters["kv_swap_in"] == 1


def test_only_leaves_swap_out_and_only_host_roots_swap_in():
    tree = make_tree()
    put(tree, K1, [1, 2], now=1.0)
    put(tree, K1, [1, 2, 3, 4], now=1.0)
    top, below = sorted((n for n in tree.kv_nodes()), key=lambda n: n.prefix_blocks)
    with pytest.raises(AssertionError):
        tree.swap_out(top)  # it has a child on the GPU
    tree.swap_out(below)
    tree.swap_out(top)
    with pytest.raises(AssertionError):
        tree.swap_in(below)  # its parent is on the host
    tree.swap_in(top)
    tree.swap_in(below)
    tree.check_integrity(kv_needs_adapter=True)


def test_insert_takes_the_gpu_copy_of_a_host_node():
    tree = make_tree()
    put(tree, K1, [1, 2, 3, 4], now=1.0)  # 2, 3
    put(tree, K1, [1, 2, 3, 4, 5, 6], now=1.0)  # (5, 6) in 6
    tree.evict(1, to_host=True)
    tree.evict(1, to_host=True)  # (3, 4) and (5, 6) on the host, (1, 2) on the GPU
    assert dump(tree, A1) == {(1, 2): ("gpu", [2]), (1, 2, 3, 4): ("host", [1]), (1, 2, 3, 4, 5, 6): ("host", [0])}
    put(tree, K1, [1, 2, 3, 4], now=2.0)  # a request recomputed (3, 4) rather than swap it in, in 7 and 8
    assert dump(tree, A1) == {(1, 2): ("gpu", [2]), (1, 2, 3, 4): ("gpu", [8]), (1, 2, 3, 4, 5, 6): ("host", [0])}
    assert tree.host.num_free == 3 and tree.gpu.ref_count(7) == 0 and tree.take_ops()[-1].kind is OpKind.KV_SWAP_OUT
    tree.check_integrity(kv_needs_adapter=True)


def test_full_host_drops_the_colder_kv():
    tree = make_tree(host_blocks=1)
    put(tree, K1, [1, 2], now=1.0)
    put(tree, K1, [3, 4], now=2.0)
    tree.evict(1, to_host=True)  # (1, 2) to the host
    tree.evict(1, to_host=True)  # (3, 4) is hotter than the host's (1, 2): that one is dropped for it
    assert dump(tree, A1) == {(3, 4): ("host", [0])}
    assert (tree.counters["kv_swap_out"], tree.counters["kv_drop_host"]) == (2, 1)

    put(tree, K1, [5, 6], now=0.5)  # colder than everything on the host: dropped instead of swapped out
    tree.evict(1, to_host=True)
    assert dump(tree, A1) == {(3, 4): ("host", [0])} and tree.counters["kv_drop"] == 1


def test_keys_isolate_adapters_and_tenants():
    a20 = AdapterKey(2)
    tree = make_tree(gpu_blocks=40, adapters=((A1, 1), (a20, 1)))
    keys = [K1, PrefixKey("t1", 2), PrefixKey("t2", 1), PrefixKey("t1", BASE_ADAPTER_ID)]
    tokens = [1, 2, 3, 4, 5, 6]
    put(tree, K1, tokens, now=1.0)
    for key in keys[1:]:
        assert tree.match_prefix(key, tokens, now=2.0)[:2] == ([], 0)
    own = {key: tree.path_blocks(put(tree, key, tokens, now=3.0)) for key in keys[1:]}
    own[K1] = tree.match_prefix(K1, tokens, now=4.0)[0]
    for key in keys:
        assert tree.match_prefix(key, tokens, now=5.0)[:2] == (own[key], 6)
    assert len({b for blocks in own.values() for b in blocks}) == 3 * len(keys)


def test_drop_adapter_drops_exactly_its_subtrees():
    a11, a20 = AdapterKey(3), AdapterKey(2)
    tree = make_tree(gpu_blocks=20, adapters=((A1, 1), (a11, 1), (a20, 1)))  # weights in blocks 0, 1, 2
    k11, k20 = PrefixKey("t1", 3), PrefixKey("t1", 2)
    put(tree, K1, [1, 2, 3, 4], now=1.0)  # 3, 4
    put(tree, K1, [1, 2, 5, 6], now=1.0)  # 5 is a duplicate of (1, 2); (5, 6) in 6
    put(tree, k11, [1, 2, 3, 4], now=1.0)  # 7, 8
    put(tree, k20, [1, 2, 3, 4], now=1.0)  # 9, 10
    before = dump(tree, a20)
    held = tree.match_prefix(K1, [1, 2, 3, 4], now=2.0)[2]
    tree.lock(held)

    assert tree.drop_adapter(1) and tree.drop_adapter(3) and not tree.drop_adapter(3)
    with pytest.raises(KeyError):
        tree.match_prefix(K1, [1, 2], now=3.0)
    assert tree.adapter(a20) is not None and dump(tree, a20) == before
    in_use = {b for b in range(20) if tree.gpu.ref_count(b)}
    assert in_use == {0, 3, 4, 2, 9, 10}  # the locked path and its adapter wait for their request
    tree.check_integrity(kv_needs_adapter=True)

    tree.unlock(held)
    assert {b for b in range(20) if tree.gpu.ref_count(b)} == {2, 9, 10}
    assert [a.key for a in tree.adapters()] == [AdapterKey(BASE_ADAPTER_ID), a20]
    assert tree.counters["adapter_drop"] == 7  # 2 weight blocks and 5 KV blocks
    tree.check_integrity(kv_needs_adapter=True)
    with pytest.raises(ValueError):
        tree.drop_adapter(BASE_ADAPTER_ID)


# ---- policies ---------------------------------------------------------------------------------------------------


def test_tree_cost_eval_by_hand():
    policy = TreeCost(
        PolicyParams(h2d_bytes_per_s=1000.0, recompute_s_per_token=0.01, window_s=10.0, batch_size=2.0), block_bytes=100
    )
    a, b = AdapterKey(1), AdapterKey(2)
    for t, key in [(0.0, a), (0.5, b), (1.0, a), (1.0, b)]:
        policy.observe(key, t)
    assert policy.expected_adapters() == pytest.approx(2 * (1 - 0.5**2))

    tree = make_tree(adapters=((a, 5),))
    node = tree.path(put(tree, PrefixKey("t1", 1), [1, 2, 3, 4], now=0.0))[-1]
    node.hit_times.append(1.0)
    node.last_access = 1.0
    # restore = min(2 blocks * 100 B / 1000 B/s, 4 tokens * 0.01 s) = 0.04; reuse = 2 hits / 4 requests
    assert policy.score(node, 1.0, resident_adapters=3) == pytest.approx(0.04 * 0.5)
    assert policy.score(node, 6.0, resident_adapters=3) == pytest.approx(0.04 * 0.5 * math.exp(-0.5))
    adapter = tree.adapter(a)
    adapter.last_access = 1.0  # LoRA_Eval = 1.5 expected / 3 resident; restore = 500 B / 1000 B/s; share 1/2
    assert policy.score(adapter, 1.0, resident_adapters=3) == pytest.approx(0.5 * 0.5 * 0.5)
    assert policy.should_swap_in(node) is False  # 0.2 s to copy, 0.04 s to recompute


def test_tree_cost_copy_prices_and_the_host_decision_by_hand():
    """Copies priced as measured: latency plus bytes over each direction's bandwidth. Where copies stall compute
    (the CPU), an evicted node goes to the host only when reuse x decay x (recompute - swap in) > its copy out."""
    params = PolicyParams(
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=500.0,
        copy_latency_s=0.01,
        copies_stall_compute=True,
        recompute_s_per_token=0.1,
        window_s=10.0,
    )
    policy = TreeCost(params, block_bytes=100)
    a = AdapterKey(1)
    for t in (0.0, 0.5, 1.0, 1.0):
        policy.observe(a, t)  # 4 requests in the window
    tree = make_tree(adapters=((a, 5),))
    node = tree.path(put(tree, PrefixKey("t1", 1), [1, 2, 3, 4], now=1.0))[-1]  # 2 blocks, 1 hit
    assert policy.swap_in_s(node) == pytest.approx(2 * (0.01 + 100 / 1000))  # 0.22
    assert policy.swap_out_s(node) == pytest.approx(2 * (0.01 + 100 / 500))  # 0.42
    assert policy.recompute_s(node) == pytest.approx(0.4)
    # saving = 1/4 x 1 x (0.4 - 0.22) = 0.045 < 0.42: dropped
    assert policy.keep_on_host(node, 1.0) is False
    policy.params = replace(params, recompute_s_per_token=1.0)  # saving = 1/4 x (4 - 0.22) = 0.945 > 0.42: kept
    assert policy.keep_on_host(node, 1.0) is True
    # 20 s later: decay e^-2, saving = 0.945 x 0.135 = 0.128 < 0.42 (the window also forgot the hit: 0)
    assert policy.keep_on_host(node, 21.0) is False
    assert TreeCost(replace(params, copies_stall_compute=False), 100).keep_on_host(node, 1.0) is True  # overlapped
    # tick's swap-ins: never while requests wait; where copies stall compute, only while nothing runs
    assert (policy.proactive_swap_in(0, 0), policy.proactive_swap_in(3, 0), policy.proactive_swap_in(0, 1)) == (
        True,
        False,
        False,
    )
    gpu = TreeCost(replace(params, copies_stall_compute=False), 100)
    assert (gpu.proactive_swap_in(3, 0), gpu.proactive_swap_in(3, 1)) == (True, False)


def test_a_swap_in_waits_for_the_queue():
    """Adapter 1's KV went to the host to make room for adapter 2's request; once that request ends, the free
    blocks would let tick() bring it back, but not while a request waits, nor (copies stalling compute) while one
    runs; on an idle engine it comes back."""
    params = PolicyParams(h2d_bytes_per_s=1e6, recompute_s_per_token=1e-3, window_s=100.0, copies_stall_compute=True)
    pool = pool_of("tree-cost", params=params)
    pool.register_adapter(1, 200, staged=True)
    pool.register_adapter(2, 200, staged=True)
    serve(pool, K1, list(range(9)), 1.0)  # adapter 1 (2 blocks) and its KV (2 blocks)
    serve(pool, K1, list(range(9)), 1.5)  # a second hit: worth keeping on the host
    adm = pool.admit(PrefixKey("t1", 2), list(range(100, 109)), 2.0)
    table = pool.allocate(3, 2.0)  # 8 blocks: 2 + 2 weights, 1 KV left to adapter 1, 3 for this request
    # the tail block's saving: 2 hits / 3 requests x e^-0.005 x (4 tokens x 1 ms - 0.1 ms) > its 0.1 ms copy out
    assert [op.kind for op in pool.take_copy_ops()] == [OpKind.ADAPTER_LOAD, OpKind.KV_SWAP_OUT]
    pool.release(adm, [], table, 2.0)  # nothing computed: nothing offered to the tree
    pool.check_integrity()
    for running, waiting in ((0, 1), (1, 0)):
        pool.tick(3.0, batch_size=running, waiting=waiting)
        assert pool.take_copy_ops() == []
    pool.tick(3.0)
    assert [op.kind for op in pool.take_copy_ops()] == [OpKind.KV_SWAP_IN]


# ---- the pool ---------------------------------------------------------------------------------------------------


def pool_of(policy: str, **kw) -> UnifiedPool:
    cfg = dict(
        num_gpu_blocks=8,
        num_host_blocks=4,
        block_size=4,
        block_bytes=100,
        policy=policy,
        params=PolicyParams(h2d_bytes_per_s=1e6, recompute_s_per_token=1e-3, window_s=100.0),
        adapter_slots=1,
        adapter_slot_blocks=2,
    )
    cfg.update(kw)
    return UnifiedPool(PoolConfig(**cfg))


def serve(pool: UnifiedPool, key: PrefixKey, tokens: list[int], now: float) -> list[CopyOp]:
    """Admit, allocate the rest, compute, release; returns the copy operations it caused."""
    adm = pool.admit(key, tokens, now)
    assert adm is not None
    table = list(adm.blocks) + pool.allocate(pool.gpu.blocks_for_tokens(len(tokens)) - len(adm.blocks), now)
    pool.release(adm, tokens, table, now)
    pool.check_integrity()
    return pool.take_copy_ops()


def test_tree_cost_pool_by_hand():
    pool = pool_of("tree-cost")
    pool.register_adapter(1, 200, staged=True)
    pool.register_adapter(2, 200, staged=True)
    k2 = PrefixKey("t1", 2)
    p1, p2 = list(range(9)), list(range(100, 109))
    assert serve(pool, K1, p1, 1.0) == [CopyOp(OpKind.ADAPTER_LOAD, dst=(0, 1), adapter=A1)]  # KV: 2, 3
    assert serve(pool, K1, p1, 2.0) == []
    s = pool.stats()
    assert (s.adapter_hit_rate, s.kv_token_hit_rate) == (0.5, 8 / 18)
    assert (s.gpu_free, s.gpu_cached, s.gpu_in_use) == (4, 4, 0)

    adm = pool.admit(k2, p2, 3.0)  # adapter 2 takes 2 of the 4 free blocks
    table = pool.allocate(3, 3.0)  # 2 free: the tail of adapter 1's KV goes to the host
    assert pool.take_copy_ops() == [
        CopyOp(OpKind.ADAPTER_LOAD, dst=(6, 7), adapter=AdapterKey(2)),
        CopyOp(OpKind.KV_SWAP_OUT, (3,), (0,)),
    ]
    assert table == [4, 5, 3]  # the block freed by the swap-out is reused after its copy-out
    pool.release(adm, p2, table, 3.0)
    pool.check_integrity()
    pool.tick(4.0, batch_size=1)  # one free block: the host root comes back
    assert pool.take_copy_ops() == [CopyOp(OpKind.KV_SWAP_IN, (0,), (3,))]
    s = pool.stats()
    assert (s.invalid_kv_ratio, s.bytes_to_host, s.bytes_to_gpu) == (0.0, 100, 100 + 400)
    assert s.evicted_blocks["kv_swap_out"] == 1 and s.gpu_free == 0

    pool.tree.evict(1, to_host=True)  # adapter 1's tail again; the next admission swaps it in itself
    assert pool.take_copy_ops()[0].kind is OpKind.KV_SWAP_OUT
    placement = {
        p.adapter_id: (p.tier, p.weight_blocks, p.kv_blocks_gpu, p.kv_blocks_host) for p in pool.adapter_placement()
    }
    assert placement == {BASE_ADAPTER_ID: ("gpu", 0, 0, 0), 1: ("gpu", 2, 1, 1), 2: ("gpu", 2, 2, 0)}
    adm = pool.admit(K1, p1, 5.0)
    assert adm.num_cached_tokens == 8 and [op.kind for op in pool.take_copy_ops()] == [OpKind.KV_SWAP_IN]
    pool.release(adm, p1[:8], list(adm.blocks), 5.0)
    pool.check_integrity()


@pytest.mark.parametrize("policy,invalid", [("tree-cost", 0.0), ("lru-unified", 0.0), ("lru-separate", 0.5)])
def test_invalid_kv_after_adapter_churn(policy, invalid):
    pool = pool_of(policy)
    pool.register_adapter(1, 200, staged=True)
    pool.register_adapter(2, 200, staged=True)
    serve(pool, K1, list(range(9)), 1.0)
    serve(pool, PrefixKey("t1", 2), list(range(100, 109)), 2.0)
    s = pool.stats()
    assert s.invalid_kv_ratio == invalid
    if policy == "lru-separate":  # the slot went to adapter 2; adapter 1's KV stayed, valid but unusable
        assert pool.tree.adapter(A1).tier is Tier.HOST and s.evicted_blocks["adapter_unload"] == 2
        adm = pool.admit(K1, list(range(9)), 3.0)  # back in its slot, the KV is still a hit
        assert adm.num_cached_tokens == 8
        pool.release(adm, list(range(8)), list(adm.blocks), 3.0)
        pool.check_integrity()


def test_lru_unified_keeps_no_history():
    pool = pool_of("lru-unified")
    pool.register_adapter(1, 200, staged=True)
    serve(pool, K1, list(range(9)), 1.0)
    adm = pool.admit(K1, list(range(9)), 2.0)
    assert adm.num_cached_tokens == 0 and pool.stats().gpu_cached == 2  # the adapter only
    pool.release(adm, [], [], 2.0)


def test_config_and_registration_errors():
    with pytest.raises(ValueError):
        pool_of("fifo")
    with pytest.raises(ValueError):
        pool_of("lru-separate", adapter_slots=4)  # 4 slots x 2 blocks = the whole budget
    pool = pool_of("lru-separate")
    with pytest.raises(ValueError):
        pool.register_adapter(1, 300, staged=True)  # 3 blocks do not fit a 2-block slot
    pool.register_adapter(1, 200, staged=True)
    with pytest.raises(ValueError):
        pool.register_adapter(1, 200, staged=True)
    assert pool.drop_adapter(1)
    with pytest.raises(KeyError):
        pool.admit(K1, [1, 2, 3], 1.0)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(7, 1.0)  # 8 blocks, 2 reserved for the slot


# ---- randomized: integrity at every step ------------------------------------------------------------------------


@dataclass
class Running:
    key: PrefixKey
    admission: object
    tokens: list[int]
    table: list[int]


def content(key: PrefixKey, tokens: list[int], block: int, bs: int) -> tuple:
    return (key, tuple(tokens[: (block + 1) * bs]))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_operations_keep_integrity(policy):
    """A simulated engine: blocks hold (key, tokens) contents, copies move them as the pool asks. Every matched
    block must hold exactly its key's tokens, locked paths never move, and check_integrity() holds throughout."""
    rng = random.Random(20250503)
    pool = UnifiedPool(
        PoolConfig(
            num_gpu_blocks=40,
            num_host_blocks=12,
            block_size=4,
            block_bytes=64,
            policy=policy,
            params=PolicyParams(h2d_bytes_per_s=1e5, recompute_s_per_token=1e-2, window_s=2.0, batch_size=4.0),
            adapter_slots=2,
            adapter_slot_blocks=4,
            free_watermark_blocks=3,
        )
    )
    bs = pool.config.block_size
    new_ids = itertools.count(5)
    current = {i: i for i in (1, 2, 3, 4)}  # a name's adapter id now (other weights under the name: a new id)
    registered = set(current.values())
    for i in registered:
        pool.register_adapter(i, rng.randint(64, 256), staged=True)
    prefixes = [[rng.randrange(40) for _ in range(rng.randint(0, 12))] for _ in range(6)]
    gpu: dict[int, object] = {}
    host: dict[int, object] = {}
    running: list[Running] = []

    def execute_copies():
        for op in pool.take_copy_ops():
            if op.kind is OpKind.KV_SWAP_OUT:
                for s, d in zip(op.src, op.dst, strict=True):
                    host[d] = gpu[s]
            elif op.kind is OpKind.KV_SWAP_IN:
                for s, d in zip(op.src, op.dst, strict=True):
                    gpu[d] = host[s]
            elif op.kind is OpKind.ADAPTER_LOAD:
                for d in op.dst:
                    gpu[d] = op.adapter

    def compute(r: Running):
        for j in range(len(r.admission.blocks), len(r.table)):
            gpu[r.table[j]] = content(r.key, r.tokens, j, bs)

    def end(r: Running, tokens: list[int]):
        running.remove(r)
        pool.release(r.admission, tokens, r.table, now)
        execute_copies()

    now, max_invalid = 0.0, 0.0
    for _ in range(3000):
        now += rng.random() * 0.05
        op = rng.random()
        if op < 0.35 and len(running) < 6:
            adapter_id = current.get(rng.choice([BASE_ADAPTER_ID, 1, 1, 1, 2, 2, 3, 4]), BASE_ADAPTER_ID)
            key = PrefixKey(rng.choice("ab"), adapter_id)
            tokens = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randint(1, 10))]
            if adapter_id != BASE_ADAPTER_ID and adapter_id not in registered:
                with pytest.raises(KeyError):
                    pool.admit(key, tokens, now)
                continue
            adm = pool.admit(key, tokens, now)
            execute_copies()
            if adm is None:
                continue
            assert adm.num_cached_tokens < len(tokens)
            for j, b in enumerate(adm.blocks):  # the cached KV is this key's, for these tokens
                assert gpu[b] == content(key, tokens, j, bs)
            r = Running(key, adm, tokens, list(adm.blocks))
            running.append(r)
            try:
                r.table += pool.allocate(pool.gpu.blocks_for_tokens(len(tokens)) - len(r.table), now)
            except OutOfBlocksError:
                end(r, tokens[: adm.num_cached_tokens])
                continue
            execute_copies()
            compute(r)
        elif op < 0.55 and running:  # a decode step
            r = rng.choice(running)
            r.tokens.append(rng.randrange(40))
            if pool.gpu.blocks_for_tokens(len(r.tokens)) > len(r.table):
                try:
                    r.table += pool.allocate(1, now)
                except OutOfBlocksError:  # preempted: what it computed goes to the cache
                    end(r, r.tokens[:-1])
                    continue
                execute_copies()
            compute(r)
        elif op < 0.75 and running:  # finished, or aborted before anything is kept
            r = rng.choice(running)
            end(r, r.tokens if rng.random() < 0.8 else [])
        elif op < 0.9:
            pool.tick(now, len(running))
            execute_copies()
        elif op < 0.95:
            name = rng.choice([1, 2, 3, 4])
            old = current[name]
            if old in registered:  # unloaded, or about to be replaced: its weights and KV go
                pool.drop_adapter(old)
                registered.discard(old)
            if old not in registered and rng.random() >= 0.3:  # other weights under the name (or registered again)
                current[name] = new = next(new_ids)
                pool.register_adapter(new, rng.randint(64, 256), staged=True)
                registered.add(new)
            execute_copies()
        pool.check_integrity()
        for r in running:  # locked paths never move
            assert pool.tree.path_blocks(r.admission.handle) == list(r.admission.blocks)
        invalid = pool.stats().invalid_kv_ratio
        max_invalid = max(max_invalid, invalid)
        assert policy == "lru-separate" or invalid == 0.0

    for r in list(running):
        end(r, r.tokens)
    pool.check_integrity()
    s = pool.stats()
    assert s.gpu_in_use == 0 and s.evicted_blocks["adapter_unload"] > 0 and s.evicted_blocks["adapter_drop"] > 0
    assert 0 < s.adapter_hit_rate < 1
    if policy == "tree-cost":
        assert min(s.bytes_to_host, s.evicted_blocks["kv_drop_host"], s.kv_token_hit_rate) > 0
    if policy == "lru-separate":
        assert s.kv_token_hit_rate > 0 and s.evicted_blocks["kv_drop"] > 0 and max_invalid > 0
    if policy == "lru-unified":
        assert s.kv_token_hit_rate == 0


# ---- device placement and pins ----------------------------------------------------------------------------------


def test_an_adapter_is_found_at_its_first_page_and_residency_is_the_policys():
    """No slots: an adapter's table page is the first of its blocks (the free list's order here), as many stay
    resident as the blocks hold, and an optional cap (max_resident_adapters) unloads the one of lowest value."""
    pool = pool_of("tree-cost", num_gpu_blocks=16)
    for i in (1, 2, 3):
        pool.register_adapter(i, 200, staged=True)  # 2 blocks each
    adm1 = pool.admit(PrefixKey("", 1), [1, 2, 3], 1.0)
    adm2 = pool.admit(PrefixKey("", 2), [1, 2, 3], 1.0)
    adm3 = pool.admit(PrefixKey("", 3), [1, 2, 3], 1.0)
    assert (adm1.adapter_page, adm2.adapter_page, adm3.adapter_page) == (0, 2, 4)
    assert pool.resident_adapters() == {AdapterKey(1): 0, AdapterKey(2): 2, AdapterKey(3): 4}
    ops = [(op.kind, op.adapter, op.dst) for op in pool.take_copy_ops()]
    assert ops == [(OpKind.ADAPTER_LOAD, AdapterKey(i), (2 * i - 2, 2 * i - 1)) for i in (1, 2, 3)]
    base = pool.admit(PrefixKey("", BASE_ADAPTER_ID), [1, 2, 3], 3.0)
    assert base.adapter_page == -1
    for adm in (adm1, adm2, adm3, base):
        pool.release(adm, [], list(adm.blocks), 4.0)
    pool.check_integrity()

    capped = pool_of("tree-cost", num_gpu_blocks=16, max_resident_adapters=2)
    for i in (1, 2, 3):
        capped.register_adapter(i, 200, staged=True)
    first = capped.admit(PrefixKey("", 1), [1, 2, 3], 1.0)
    second = capped.admit(PrefixKey("", 2), [1, 2, 3], 1.0)
    capped.release(first, [], list(first.blocks), 2.0)
    capped.take_copy_ops()
    third = capped.admit(PrefixKey("", 3), [1, 2, 3], 3.0)  # the cap: adapter 1 leaves
    ops = [(op.kind, op.adapter) for op in capped.take_copy_ops()]
    assert ops == [(OpKind.ADAPTER_UNLOAD, AdapterKey(1)), (OpKind.ADAPTER_LOAD, AdapterKey(3))]
    assert third.adapter_page == 4  # blocks 4, 5: the front of the free list (those freed go to its back)
    for adm in (second, third):
        capped.release(adm, [], list(adm.blocks), 4.0)
    capped.check_integrity()


def test_an_adapter_not_staged_is_not_loaded():
    pool = pool_of("tree-cost", num_gpu_blocks=16)
    pool.register_adapter(1, 200)
    assert pool.admit(PrefixKey("", 1), [1, 2, 3], 1.0) is None and not pool.take_copy_ops()
    pool.set_staged(AdapterKey(1), True)
    adm = pool.admit(PrefixKey("", 1), [1, 2, 3], 2.0)
    assert adm is not None and adm.adapter_loaded
    pool.release(adm, [], list(adm.blocks), 3.0)
    pool.check_integrity()


def test_pins_beyond_the_share_are_refused():
    pool = pool_of("tree-cost", num_gpu_blocks=16)  # max_pinned_share 0.5: 8 blocks
    for i in (1, 2, 3, 4):
        pool.register_adapter(i, 200, pinned=True)
    with pytest.raises(ValueError, match="pinned adapters may take 8 of the 16 device pages and 8 are taken"):
        pool.register_adapter(5, 200, pinned=True)
    pool.drop_adapter(1)
    pool.register_adapter(6, 100, pinned=True)  # other weights replace 1's: 1 block instead of 2
    pool.register_adapter(5, 100, pinned=True)


@pytest.mark.parametrize("policy", ["tree-cost", "lru-unified", "lru-separate"])
def test_pinned_adapter_is_loaded_when_there_is_room_and_never_evicted(policy):
    pool = pool_of(policy, num_gpu_blocks=16, adapter_slots=2, max_resident_adapters=2)
    pool.register_adapter(1, 200, pinned=True, staged=True)
    for i in (2, 3):
        pool.register_adapter(i, 200, staged=True)
    pool.tick(0.0)
    assert pool.resident_adapters() == {AdapterKey(1): 0}  # loaded before any request asked for it
    for t, i in enumerate((2, 3, 2, 3), start=1):  # two unpinned adapters take turns in the one place left
        adm = pool.admit(PrefixKey("", i), [1, 2, 3], float(t))
        assert adm is not None and adm.adapter_page >= 0
        pool.release(adm, [], list(adm.blocks), float(t))
        pool.check_integrity()
        assert AdapterKey(1) in pool.resident_adapters()
    # pressure on KV does not move it either: one request takes every block but the pinned adapter's (2 of 16;
    # the slot policy keeps 2 slots x 2 blocks), and not one more
    adm = pool.admit(PrefixKey("", BASE_ADAPTER_ID), [1], 9.0)
    most = (16 - 4 if pool.policy.adapter_slots else 16 - 2) - len(adm.blocks)
    table = list(adm.blocks) + pool.allocate(most, 9.0)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1, 9.0)
    assert pool.resident_adapters()[AdapterKey(1)] == 0
    pool.release(adm, [], table, 9.0)
    pool.check_integrity()


def test_an_activated_lora_matches_and_offers_the_base_models_kv():
    """An aLoRA request (base_tokens: its tokens before the invocation) matches its prefix among the base model's
    blocks of the same salt, holds the adapter by a lock of its own, and offers back only the full blocks of its
    base tokens: nothing is cached under the adapter. Block size 4; hand-computed block ids."""
    pool = pool_of("tree-cost", num_gpu_blocks=16)
    pool.register_adapter(1, 200, staged=True)  # 2 blocks
    base = PrefixKey("t1", BASE_ADAPTER_ID)
    conversation = list(range(10))
    assert serve(pool, base, conversation, 1.0) == []  # the base's full blocks: tokens 0-7 in blocks 0, 1
    ask = conversation + [50, 51, 52, 53, 54]  # the invocation starts at 10
    adm = pool.admit(K1, ask, 2.0, token_budget=16, base_tokens=10)
    assert adm is not None
    assert (adm.blocks, adm.num_cached_tokens, adm.num_new_tokens) == ((0, 1), 8, 7)
    assert adm.adapter_page == 3 and adm.adapter_loaded  # blocks 3, 4 (block 2, freed, went to the list's back)
    assert adm.new_blocks == (5, 6)
    assert pool.tree.adapter(A1).lock == 1  # resident while the request runs, whatever its KV path
    twin = pool.admit(K1, ask, 2.0, token_budget=16, base_tokens=10)  # a second check of the same conversation
    assert twin is not None and twin.blocks == (0, 1)  # the same blocks: held once
    table = [*adm.blocks, *adm.new_blocks]
    pool.release(adm, ask + [60, 61, 62, 63], table, 3.0)  # 19 tokens computed: full blocks 0-3
    pool.release(twin, [], [*twin.blocks, *twin.new_blocks], 3.0)
    assert pool.tree.adapter(A1).lock == 0 and not pool.tree.adapter(A1).children
    # block 5 (tokens 8-11) holds invocation tokens: only the blocks wholly before the invocation (10 // 4 = 2)
    # are the base's, and those the tree has
    assert dump(pool.tree, AdapterKey(BASE_ADAPTER_ID)) == {tuple(range(8)): ("gpu", [0, 1])}
    later = pool.admit(base, conversation + [10, 11], 4.0)
    assert later is not None and later.num_cached_tokens == 8
    pool.release(later, [], list(later.blocks), 4.0)
    pool.check_integrity()
