"""The unified pool: device KV blocks and resident adapters in one budget, a host tier, the tree of adapters and
their KV prefixes, and the policies that decide what stays on the device. ``UnifiedPool`` is what the engine talks
to; callers hold ``Admission`` handles and block ids under a lock/unlock contract."""

from lora_server.kv_pool.block_pool import BlockPool, OutOfBlocksError
from lora_server.kv_pool.policies import POLICIES, PolicyParams
from lora_server.kv_pool.tree import BASE_ADAPTER_ID, AdapterKey, CopyOp, OpKind, PrefixKey, Tier
from lora_server.kv_pool.unified_pool import AdapterPlacement, Admission, PoolConfig, PoolStats, UnifiedPool

__all__ = [
    "BASE_ADAPTER_ID",
    "POLICIES",
    "AdapterKey",
    "AdapterPlacement",
    "Admission",
    "BlockPool",
    "CopyOp",
    "OpKind",
    "OutOfBlocksError",
    "PolicyParams",
    "PoolConfig",
    "PoolStats",
    "PrefixKey",
    "Tier",
    "UnifiedPool",
]
