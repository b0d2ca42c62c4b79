"""One step's inputs, from rank 0 to the workers, as one int64 tensor broadcast (a second one only when a step's
arrays exceed the message's capacity: a block-table rewrite of many rows), then, in a step that loads adapters,
one scatter of each worker's share of their pages.

Layout of the message [capacity] int64:
  [0] kind (STEP, CHECK or STOP), [1] max_query_len, [2] num_padding, [3] the gathered block table's width,
  [4] scoring_slice: the prompt rows the head scores at once (rank 0's sampler.scoring_rows),
  [5] spill: values past the capacity, sent in a second broadcast of exactly that many,
  [6] image_bytes: the bytes of adapter pages each worker gets in the scatter that follows (0: no scatter),
  [7 : 7 + len(STEP_ARRAYS)] each array's length, then the arrays back to back in STEP_ARRAYS' order.
The arrays are the runner's host arrays of the same names (model.runner._build): the worker builds its
ForwardBatch from them as rank 0 does, its block tables updated by the same entries, its tokens' adapters the same
runs of table pages; and ``copy_ops``, the pool's copy operations rank 0 made since its last step
(runner.apply_copy_ops), which the worker makes on its own arena and host tier before the step, in the same order:

  SWAP_OUT, device page, host block | SWAP_IN, host block, device page   (KV, one block each)
  LOAD, n, n pages (table page first), m, m x (layer, module index, rank), v, v x (piece index, rows, width),
        x, x x (layer, expert module index, expert, rank),
        e, e embedding token ids, h, h head token ids                     (an adapter: its layout's ranks,
                                                                           vocabulary pieces and experts' LoRA, its
                                                                           trainable tokens' ids, e or h -1 for
                                                                           none; its pages' bytes come next in the
                                                                           scatter)
  UNLOAD, table page

A CHECK message carries copy ops only: the workers make them and answer with their fingerprint (the integrity
check on every rank)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from lora_server.adapters.page_layout import VOCAB_PIECES, ExpertRanks
from lora_server.adapters.peft_format import TokenIds
from lora_server.distributed.group import Comm
from lora_server.kernels.lora_table import MODULE_INDEX, MODULES
from lora_server.kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.model.step_inputs import StepArrays

STEP, CHECK, STOP = 1, 2, 3
# name -> dtype on the worker (the ForwardBatch's, and the block-table updates')
STEP_ARRAYS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "seq_lens": torch.int32,
    "query_start_loc": torch.int32,
    "logits_indices": torch.int64,
    "scored_rows": torch.int64,  # prompt logprobs: the hidden rows scored, a slice at a time, before the logits
    "table_rows": torch.int64,
    "table_update_index": torch.int64,
    "table_update_value": torch.int32,
    "lora_segments": torch.int64,  # (start, end, table page) of each run of tokens that share an adapter
    "copy_ops": torch.int64,  # the pool's copy operations since the last step (see the module)
}
SWAP_OUT, SWAP_IN, LOAD, UNLOAD = 0, 1, 2, 3
HEADER = 7 + len(STEP_ARRAYS)
_SWAPS = {OpKind.KV_SWAP_OUT: SWAP_OUT, OpKind.KV_SWAP_IN: SWAP_IN}
EXPERT_MODULES = ("gate", "up", "gate_up", "down", "router")  # LoRA on a mixture of experts (adapters.peft_experts)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """What a worker needs of an adapter rank 0 loads, besides its pages: its layout's ranks and vocabulary pieces
    (adapters.page_layout.PageLayout's), and its trainable tokens' ids."""

    ranks: Mapping[tuple[int, str], int]  # (layer, module) -> rank
    vocab: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # piece name -> (rows, width)
    token_ids: TokenIds = TokenIds()
    experts: ExpertRanks = ()  # its LoRA on a mixture of experts' experts (page_layout.expert_ranks)


@dataclass(frozen=True, slots=True)
class CopyStep:
    """One operation of the stream, decoded: a KV block's swap (``src``, ``dst``), an adapter's load (``pages``,
    table page first, and ``adapter``) or unload (``pages`` [table page])."""

    kind: int  # SWAP_OUT, SWAP_IN, LOAD or UNLOAD
    src: int = -1
    dst: int = -1
    pages: tuple[int, ...] = ()
    adapter: LoadedAdapter | None = None


def encode_copy_ops(ops: Sequence[CopyOp], loaded: Mapping[AdapterKey, LoadedAdapter]) -> list[int]:
    """The pool's copy operations as the stream's values (see the module); ``loaded``: each loaded adapter's."""
    values: list[int] = []
    for op in ops:
        if op.kind in _SWAPS:
            for src, dst in zip(op.src, op.dst, strict=True):
                values += (_SWAPS[op.kind], src, dst)
        elif op.kind is OpKind.ADAPTER_LOAD:
            assert op.adapter is not None
            adapter = loaded[op.adapter]
            ranks = [(layer, MODULE_INDEX[module], r) for (layer, module), r in adapter.ranks.items()]
            pieces = [(VOCAB_PIECES.index(name), rows, width) for name, (rows, width) in adapter.vocab.items()]
            values += (LOAD, len(op.dst), *op.dst, len(ranks), *(v for entry in ranks for v in entry))
            values += (len(pieces), *(v for entry in pieces for v in entry))
            experts = [(layer, EXPERT_MODULES.index(m), e, r) for (layer, m, e), r in adapter.experts]
            values += (len(experts), *(v for entry in experts for v in entry))
            for ids in adapter.token_ids:
                values += (-1,) if ids is None else (ids.numel(), *ids.tolist())
        else:
            values += (UNLOAD, op.src[0])
    return values


def decode_copy_ops(values: list[int]) -> Iterator[CopyStep]:
    """The stream's operations, in order."""
    i = 0

    def take(n: int) -> list[int]:
        nonlocal i
        i += n
        return values[i - n : i]

    while i < len(values):
        (kind,) = take(1)
        if kind in (SWAP_OUT, SWAP_IN):
            src, dst = take(2)
            yield CopyStep(kind, src=src, dst=dst)
        elif kind == LOAD:
            pages = take(take(1)[0])
            entries = take(3 * take(1)[0])
            ranks = {(entries[j], MODULES[entries[j + 1]]): entries[j + 2] for j in range(0, len(entries), 3)}
            pieces = take(3 * take(1)[0])
            vocab = {VOCAB_PIECES[pieces[j]]: (pieces[j + 1], pieces[j + 2]) for j in range(0, len(pieces), 3)}
            entries = take(4 * take(1)[0])
            experts = tuple(
                ((entries[j], EXPERT_MODULES[entries[j + 1]], entries[j + 2]), entries[j + 3])
                for j in range(0, len(entries), 4)
            )
            ids = []
            for _ in TokenIds._fields:
                (n,) = take(1)
                ids.append(None if n < 0 else torch.tensor(take(n), dtype=torch.int64))
            loaded = LoadedAdapter(ranks, vocab, TokenIds(*ids), experts)
            yield CopyStep(kind, pages=tuple(pages), adapter=loaded)
        else:
            yield CopyStep(kind, pages=tuple(take(1)))


def message_capacity(max_tokens: int, max_seqs: int, block_size: int) -> int:
    """int64 values of a message that holds any step of up to ``max_tokens`` tokens and ``max_seqs`` sequences
    whose block tables grow by appends, that scores no prompt and makes no copy (four per-token arrays, three
    per-sequence and one adapter run per sequence, two entries per new block); larger steps spill."""
    new_blocks = max_tokens // block_size + max_seqs
    return HEADER + 4 * max_tokens + 3 * (max_seqs + 1) + 3 * max_seqs + 2 * new_blocks


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step's scalars beside its arrays (a CHECK's and a STOP's are the defaults)."""

    max_query_len: int = 1
    num_padding: int = 0
    table_width: int = 0  # the gathered block table's width
    scoring_slice: int = 0  # the prompt rows the head scores at once


@dataclass(frozen=True, slots=True)
class StepMessage:
    kind: int  # STEP, CHECK or STOP
    shape: StepShape
    arrays: dict[str, torch.Tensor]  # STEP_ARRAYS' names -> 1-D tensors of their dtypes
    images: torch.Tensor | None  # uint8 [image_bytes]: this rank's pages of the adapters the copy ops load

    def step_arrays(self) -> StepArrays[torch.Tensor]:
        """The step's arrays as rank 0 uploaded them, those the message does not carry (the LoRA kernels' tiles,
        the scored rows' targets: rank 0's alone) empty."""
        a = self.arrays
        empty = torch.empty(0, dtype=torch.int64)
        carried = {f.name: a.get(f.name, empty) for f in fields(StepArrays)}
        return StepArrays(**carried)


def message_arrays(arrays: StepArrays[Sequence[int]]) -> dict[str, Sequence[int]]:
    """The step arrays the message carries (STEP_ARRAYS' names), by name."""
    return {name: getattr(arrays, name) for name in STEP_ARRAYS if hasattr(arrays, name)}


class StepChannel:
    """Rank 0 sends, each worker receives, in the same order; ``capacity``: the message's int64 values (the same
    on every rank: rank 0 decides it, distributed.workers.WorkerSetup)."""

    def __init__(self, comm: Comm, capacity: int) -> None:
        assert capacity > HEADER
        self.comm = comm
        self.buffer = torch.zeros(capacity, dtype=torch.int64)  # [capacity]

    def send(
        self,
        arrays: Mapping[str, Sequence[int]],
        shape: StepShape,
        images: list[torch.Tensor] | None = None,
        kind: int = STEP,
    ) -> None:
        """``arrays``: STEP_ARRAYS' names -> their values (a missing one is empty); ``images``: each worker's uint8
        pages of the adapters that the copy ops load, rank 1 first, of equal sizes (None: no load)."""
        parts = [np.asarray(arrays.get(name, ()), dtype=np.int64) for name in STEP_ARRAYS]
        flat = np.concatenate(parts)
        room = self.buffer.numel() - HEADER
        spill = max(0, flat.size - room)
        image_bytes = 0 if not images else images[0].numel()
        header = [
            kind,
            shape.max_query_len,
            shape.num_padding,
            shape.table_width,
            shape.scoring_slice,
            spill,
            image_bytes,
        ]
        values = self.buffer.numpy()
        values[:HEADER] = header + [p.size for p in parts]
        values[HEADER : HEADER + flat.size - spill] = flat[: flat.size - spill]
        self.comm.broadcast(self.buffer)
        if spill:
            self.comm.broadcast(torch.from_numpy(np.ascontiguousarray(flat[room:])))
        if images:
            self.comm.scatter_from_first([images[0], *images], torch.empty_like(images[0]))

    def send_stop(self) -> None:
        self.buffer[0] = STOP
        self.comm.broadcast(self.buffer)

    def receive(self) -> StepMessage:
        """The next message (kind STOP: rank 0 stops the workers)."""
        buffer = self.comm.broadcast(self.buffer)
        kind, max_query_len, num_padding, width, scoring_slice, spill, image_bytes = buffer[:7].tolist()
        if kind == STOP:
            return StepMessage(kind, StepShape(), {}, None)
        lengths = buffer[7:HEADER].tolist()
        flat = buffer[HEADER : HEADER + sum(lengths) - spill]
        if spill:
            flat = torch.cat([flat, self.comm.broadcast(torch.empty(spill, dtype=torch.int64))])
        arrays, start = {}, 0
        for (name, dtype), n in zip(STEP_ARRAYS.items(), lengths, strict=True):
            arrays[name] = flat[start : start + n].to(dtype)
            start += n
        images = None
        if image_bytes:
            images = self.comm.scatter_from_first(None, torch.empty(image_bytes, dtype=torch.uint8))
        return StepMessage(kind, StepShape(max_query_len, num_padding, width, scoring_slice), arrays, images)
