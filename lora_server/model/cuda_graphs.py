"""CUDA graphs of the decode forward pass, one per batch-size bucket.

A decode step (one new token per sequence) is padded to the smallest bucket that holds it: padding rows write no
KV (slot -1), attend to nothing (sequence length 0) and have no adapter (slot -1); the kernels skip them, and
their hidden states are never read. Each bucket's forward pass is captured once, at start, on batch inputs that
live at fixed addresses (the runner's StepInputs and BlockTables: a step of the same bucket gets its tensors at
the same places); a step replays the graph after writing its inputs there. Everything else (prefill and mixed
steps, speculative verification, a batch larger than the largest bucket, ``--enforce-eager``) runs eagerly."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lora_server.model.batch import ForwardBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, then steps of 8 up to 32 and of 16 beyond, capped by
    (and ending at) max_num_seqs."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_num_seqs, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences; None when none does (or there are no buckets)."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def graph_inputs(batch: ForwardBatch) -> tuple[object, ...]:
    """What a captured graph reads of a batch: the address, shape and strides of every tensor the forward pass
    reads (the LoRA tile map among them) and the query length and LoRA tile size. Two batches with equal keys are
    interchangeable for a graph."""
    lora_tiles = None if batch.lora is None else batch.lora.tiles
    tensors = (
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        lora_tiles,
    )
    block_t = None if batch.lora is None else batch.lora.block_t
    return (
        batch.max_query_len,
        block_t,
        *((t.data_ptr(), t.shape, t.stride()) if t is not None else None for t in tensors),
    )


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[object, ...]  # graph_inputs of the batch it was captured on
    hidden: torch.Tensor  # [bucket, hidden] the graph's output, rewritten by each replay


class DecodeGraphs:
    """The captured decode graphs, by bucket (CUDA only). All share one memory pool, captured largest first, so
    that the activations of every bucket fit in the largest one's. A graph also reads the model's weights, the KV
    cache and the adapter slots where they were at capture: they must be written in place, never reallocated."""

    def __init__(self) -> None:
        self._graphs: dict[int, _Captured] = {}
        self._pool: _POOL_HANDLE | None = None

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def capture(self, batch: ForwardBatch, forward: Callable[[ForwardBatch], torch.Tensor]) -> None:
        """Capture ``forward(batch)`` for the bucket of batch.num_tokens rows. It runs once eagerly first, so that
        the Triton kernels are compiled (and their launchers cached) outside the capture."""
        forward(batch)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward(batch)
        self._pool = graph.pool()
        self._graphs[batch.num_tokens] = _Captured(graph, graph_inputs(batch), hidden)
        torch.cuda.synchronize()

    def replay(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The hidden states [bucket, hidden] of ``batch`` by replaying its bucket's graph, whose inputs the
        batch's tensors must be (same addresses and shapes); None when there is no such graph: run it eagerly."""
        captured = self._graphs.get(batch.num_tokens)
        if captured is None or captured.inputs != graph_inputs(batch):
            return None
        captured.graph.replay()
        return captured.hidden
