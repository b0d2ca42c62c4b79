"""The KV pool: physical KV blocks and who holds them. Callers get block ids and a lock/unlock contract; the
pool is the only owner of the free list and the reference counts."""

from kv_pool.block_pool import BlockPool, OutOfBlocksError

__all__ = ["BlockPool", "OutOfBlocksError"]
