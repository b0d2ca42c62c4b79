"""kv_pool.BlockPool: the free list and reference counts, against hand-computed states and a simple model."""

from __future__ import annotations

import random

import pytest

from lora_server.kv_pool import BlockPool, OutOfBlocksError


def test_constructor_validates():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    pool = BlockPool(5, 16)
    assert pool.num_blocks == 5 and pool.block_size == 16
    assert pool.num_free == 5 and pool.num_used == 0
    assert all(pool.ref_count(b) == 0 for b in range(5))
    pool.check_integrity([])


@pytest.mark.parametrize(
    "block_size,tokens,blocks",
    [
        (16, 0, 0),
        (16, 1, 1),
        (16, 15, 1),
        (16, 16, 1),
        (16, 17, 2),
        (16, 32, 2),
        (16, 33, 3),
        (1, 7, 7),
        (4, 10, 3),
        (3, 9, 3),
    ],
)
def test_blocks_for_tokens(block_size, tokens, blocks):
    assert BlockPool(4, block_size).blocks_for_tokens(tokens) == blocks


def test_allocate_share_free_ref_counts():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(a) == 2 and len(b) == 3 and len(set(a + b)) == 5
    assert all(0 <= x < 6 for x in a + b)
    assert pool.num_free == 1 and pool.num_used == 5
    assert all(pool.ref_count(x) == 1 for x in a + b)
    pool.check_integrity([a, b])

    pool.share(a)  # a second holder of a's blocks
    assert all(pool.ref_count(x) == 2 for x in a)
    pool.check_integrity([a, b, list(a)])

    pool.free(a)  # the first holder lets go: still held by the second
    assert all(pool.ref_count(x) == 1 for x in a)
    assert pool.num_free == 1
    pool.check_integrity([b, list(a)])

    pool.free(a)  # the last holder: back on the free list
    assert all(pool.ref_count(x) == 0 for x in a)
    assert pool.num_free == 3 and pool.num_used == 3
    pool.check_integrity([b])

    c = pool.allocate(3)
    assert set(c) == set(range(6)) - set(b)
    assert pool.num_free == 0
    pool.free(b)
    pool.free(c)
    assert pool.num_free == 6 and pool.num_used == 0
    pool.check_integrity([])


def test_allocate_zero_and_can_allocate():
    pool = BlockPool(3, 2)
    assert pool.allocate(0) == []
    assert pool.num_free == 3
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    pool.allocate(2)
    assert pool.can_allocate(1) and not pool.can_allocate(2) and pool.can_allocate(0)


def test_out_of_blocks_leaves_state_unchanged():
    pool = BlockPool(4, 8)
    held = pool.allocate(3)
    pool.share(held[:1])
    before = (pool.num_free, [pool.ref_count(b) for b in range(4)], list(pool._free))
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert (pool.num_free, [pool.ref_count(b) for b in range(4)], list(pool._free)) == before
    pool.check_integrity([held, held[:1]])
    assert isinstance(OutOfBlocksError("x"), RuntimeError)
    (last,) = pool.allocate(1)  # the one free block is still there
    assert last not in held


def test_double_free_raises():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.free([2])  # never allocated
    assert pool.num_free == 3
    assert all(pool.ref_count(b) == 0 for b in range(3))
    pool.check_integrity([])


def test_share_of_free_block_raises():
    pool = BlockPool(3, 4)
    with pytest.raises(ValueError):
        pool.share([0])
    assert pool.ref_count(0) == 0 and pool.num_free == 3
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.share(blocks)


def test_check_integrity_catches_duplicate_on_free_list():
    pool = BlockPool(4, 4)
    pool.check_integrity()
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_held_block_on_free_list():
    pool = BlockPool(4, 4)
    held = pool.allocate(2)
    pool._free.append(held[0])
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_lost_block():
    pool = BlockPool(4, 4)
    pool._free.pop()  # neither free nor held: leaked
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_corrupt_ref_count():
    pool = BlockPool(4, 4)
    held = pool.allocate(2)
    pool._ref_counts[held[0]] = 0  # counted free but missing from the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_validates_ref_counts_against_tables():
    pool = BlockPool(5, 4)
    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.share(b)
    pool.check_integrity([a, b, b])
    with pytest.raises(AssertionError):
        pool.check_integrity([a, b])  # b is counted twice but held once
    with pytest.raises(AssertionError):
        pool.check_integrity([a, b, b, a[:1]])  # a[0] is counted once but held twice
    with pytest.raises(AssertionError):
        pool.check_integrity([a])
    free_block = next(x for x in range(5) if x not in a + b)
    with pytest.raises(AssertionError):
        pool.check_integrity([a, b, b, [free_block]])  # a table holds a free block


def test_randomized_against_model():
    rng = random.Random(1234)
    num_blocks = 24
    pool = BlockPool(num_blocks, 4)
    holders: list[list[int]] = []  # each holder's block table
    refs = [0] * num_blocks  # the model: reference counts
    out_of_blocks = shares = double_frees = 0
    for _ in range(4000):
        op = rng.random()
        free_now = {b for b in range(num_blocks) if refs[b] == 0}
        if op < 0.4:
            n = rng.randint(0, 8)
            if n > len(free_now):
                snapshot = list(pool._ref_counts), pool.num_free
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
                assert (list(pool._ref_counts), pool.num_free) == snapshot
                out_of_blocks += 1
            else:
                got = pool.allocate(n)
                assert len(got) == n and len(set(got)) == n
                assert set(got) <= free_now
                for b in got:
                    refs[b] = 1
                holders.append(got)
        elif op < 0.6 and holders:
            table = list(rng.choice(holders))
            pool.share(table)
            for b in table:
                refs[b] += 1
            holders.append(table)
            shares += 1
        elif op < 0.95 and holders:
            table = holders.pop(rng.randrange(len(holders)))
            pool.free(table)
            for b in table:
                refs[b] -= 1
        elif free_now:
            b = rng.choice(sorted(free_now))
            with pytest.raises(ValueError):
                pool.free([b])
            with pytest.raises(ValueError):
                pool.share([b])
            double_frees += 1
        assert [pool.ref_count(b) for b in range(num_blocks)] == refs
        assert pool.num_free == sum(1 for r in refs if r == 0)
        assert pool.num_used == num_blocks - pool.num_free
        assert sorted(pool._free) == [b for b in range(num_blocks) if refs[b] == 0]
        pool.check_integrity(holders)
    assert out_of_blocks > 50 and shares > 50 and double_frees > 20  # every path was exercised
    for table in holders:
        pool.free(table)
    assert pool.num_free == num_blocks
    pool.check_integrity([])
