"""The engine's pool: its configuration on the runner's arena (the cost model priced with the copies measured on
the device), and its report (figures, adapters' placement, timings) as engine.reports' value types."""

from __future__ import annotations

import dataclasses

from lora_server.adapters.page_layout import PageLayout
from lora_server.config import EngineConfig
from lora_server.engine.adapter_loader import AdapterLoader
from lora_server.engine.adapter_registry import AdapterRegistry
from lora_server.engine.reports import BASE_NAME, DeviceMemory, Histogram, PoolReport, TtftFigures
from lora_server.kernels.lora_table import MODULES
from lora_server.kv_pool import BASE_ADAPTER_ID, POLICIES, PolicyParams, PoolConfig, UnifiedPool
from lora_server.model.runner import CopyCosts, ModelRunner


def pool_config(config: EngineConfig, runner: ModelRunner, num_layers: int, costs: CopyCosts) -> PoolConfig:
    """The pool of ``config`` on the runner's arena, its cost model priced with ``costs`` (measured on the device).
    A slot policy's slot is the pages of an adapter of the largest rank on every module."""
    slot_bytes = 0
    if POLICIES[config.pool_policy].adapter_slots:
        full = {(i, m): config.max_lora_rank for i in range(num_layers) for m in MODULES}
        slot_bytes = PageLayout(runner.geometry, full).nbytes
    return PoolConfig.for_budget(
        num_gpu_blocks=runner.num_blocks,
        num_host_blocks=runner.num_host_blocks,
        block_size=config.block_size,
        block_bytes=runner.geometry.page_bytes,
        policy=config.pool_policy,
        params=PolicyParams(
            h2d_bytes_per_s=costs.h2d_bytes_per_s,
            d2h_bytes_per_s=costs.d2h_bytes_per_s,
            copy_latency_s=costs.latency_s,
            copies_stall_compute=costs.stalls_compute,
        ),
        max_loras=config.max_loras,
        adapter_slot_bytes=slot_bytes,
    )


def pool_report(
    pool: UnifiedPool,
    adapters: AdapterRegistry,
    loader: AdapterLoader,
    runner: ModelRunner,
    block_size: int,
    ttft: TtftFigures,
    adapter_activate: Histogram,
) -> PoolReport:
    """The pool's figures, its adapters' placement, the TTFT split and the adapters' load and activation times
    (engine thread)."""
    names = adapters.names_by_id()

    def served(adapter_id: int) -> tuple[str, ...]:
        return (BASE_NAME,) if adapter_id == BASE_ADAPTER_ID else tuple(names.get(adapter_id, ()))

    placement = tuple(
        dataclasses.replace(p, names=served(p.adapter_id), rank=_rank(adapters, p.adapter_id))
        for p in pool.adapter_placement()
    )
    config = pool.config
    return PoolReport(
        device_memory=DeviceMemory(
            weights_bytes=runner.weight_bytes,
            arena_bytes=runner.arena.nbytes,
            workspace_bytes=runner.workspace_bytes,
            host_tier_bytes=runner.host_kv.nbytes,
            staged_adapters=len(loader.staged_ids()),
            adapter_stagings=loader.num_staged,
            staged_adapter_bytes=loader.staged_bytes(),
            staged_adapter_budget_bytes=loader.budget_bytes,
        ),
        policy=config.policy,
        block_size=block_size,
        gpu_blocks=config.num_gpu_blocks,
        host_blocks=config.num_host_blocks,
        block_bytes=config.block_bytes,
        request_blocks=len(pool.held_blocks()),
        stats=pool.stats(),
        adapters=placement,
        ttft=ttft,
        adapter_load=loader.load_times(),
        adapter_activate=adapter_activate,
    )


def _rank(adapters: AdapterRegistry, adapter_id: int) -> int | None:
    """An adapter's largest rank over its modules (None: the base model, or weights no longer registered)."""
    content = None if adapter_id == BASE_ADAPTER_ID else adapters.content(adapter_id)
    return None if content is None else content.rank
