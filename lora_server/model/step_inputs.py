"""The persistent buffers a step's inputs travel through: one staging buffer on the host (pinned on CUDA) and its
twin on the device, filled with one host-to-device copy per step; and the device copy of the running requests'
block tables, updated by the entries that changed.

Owned by the model runner: it names the step's integer arrays (token ids, positions, slot mapping, sequence lengths,
LoRA metadata...) and gets back device tensors that are views into the device twin. On the CPU the host buffer is
the device buffer: nothing is copied."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from lora_server.model.pinned import pinned_empty

_ALIGN = 16  # every array starts at a multiple of 16 bytes: an int64 view is aligned, and Triton, which compiles
# a variant per pointer alignment (16 bytes or not), meets one alignment whatever the step
_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}

# name -> (values, dtype): one array of a step's inputs, in the order they are laid out
HostArrays = Mapping[str, tuple[Sequence[int], torch.dtype]]
A = TypeVar("A")  # a step array: host integers (Sequence[int]) or a 1-D device tensor


@dataclass(frozen=True, slots=True)
class StepArrays(Generic[A]):
    """One step's integer arrays, as the runner builds them on the host (A = Sequence[int]) and as the model reads
    them on the device (A = torch.Tensor, StepInputs.upload_step). The field order is the upload's layout: the arrays
    whose length a decode bucket fixes come first, so that a padded decode step finds every array a CUDA graph reads
    at the offsets it was captured with. The tensor-parallel step message carries the ones the workers need."""

    input_ids: A  # [T] int64
    positions: A  # [T] int64, each token's position in its sequence
    slot_mapping: A  # [T] int64, the KV slot each token writes (-1: none)
    seq_lens: A  # [B] int32, each sequence's KV length after the step
    query_start_loc: A  # [B + 1] int32
    table_rows: A  # [B] int32, each sequence's row of the block tables' store
    lora_tiles: A  # [tiles * 3] int32, the LoRA kernels' tile map (empty where they do not run)
    logits_indices: A  # [S] int64, the rows that become logits
    table_update_index: A  # [U] int64, flat indices into the block tables' store
    table_update_value: A  # [U] int32, their block ids
    scored_rows: A  # [P] int64, prompt rows whose logprobs the step computes
    scored_targets: A  # [P] int64, the token each scores


STEP_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "seq_lens": torch.int32,
    "query_start_loc": torch.int32,
    "table_rows": torch.int32,
    "lora_tiles": torch.int32,
    "logits_indices": torch.int64,
    "table_update_index": torch.int64,
    "table_update_value": torch.int32,
    "scored_rows": torch.int64,
    "scored_targets": torch.int64,
}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StepInputs:
    """A step's integer arrays, packed back to back (in the order given) into one host staging buffer and copied to
    the device in one transfer; the device tensors handed back are views of the device buffer at the same offsets,
    so a step whose arrays have the same sizes as an earlier one's gets tensors at the same addresses (what a CUDA
    graph captured on them reads).

    Contract: the tensors of a step stay valid until the next ``upload``. On CUDA the copy is asynchronous; the next
    upload first waits for it (an event), so the host never rewrites the staging buffer under a copy in flight.
    Both buffers grow (doubling) when a step needs more than they hold; tensors handed out earlier then stay where
    they were, and graphs captured on them are no longer replayed (their addresses differ)."""

    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = self._host
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy (CUDA only)
        self._allocate(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._host.numel()

    def _allocate(self, nbytes: int) -> None:
        on_host = self.device.type == "cpu"
        self._host = pinned_empty((nbytes,), torch.uint8, self.device)  # pinned off the CPU, to its size
        self._host_np = self._host.numpy()
        self._device = self._host if on_host else torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def upload(self, arrays: HostArrays) -> dict[str, torch.Tensor]:
        """Write ``arrays`` into the staging buffer, copy what they fill to the device in one transfer, and return
        each as a 1-D device tensor of its dtype (int32 or int64)."""
        offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for name, (values, dtype) in arrays.items():
            nbytes = len(values) * dtype.itemsize
            offsets[name] = (end, end + nbytes)
            end = _aligned(end + nbytes)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
        if end > self.capacity_bytes:
            self._allocate(max(end, 2 * self.capacity_bytes))
        for name, (values, dtype) in arrays.items():
            start, stop = offsets[name]
            self._host_np[start:stop].view(_NUMPY[dtype])[:] = values
        if self._device is not self._host and end:
            self._device[:end].copy_(self._host[:end], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = self._copied or torch.cuda.Event()
                self._copied.record()
        return {
            name: self._device[start:stop].view(dtype)
            for (name, (start, stop)), (_, dtype) in zip(offsets.items(), arrays.values(), strict=True)
        }

    def upload_step(self, arrays: StepArrays[Sequence[int]]) -> StepArrays[torch.Tensor]:
        """``upload`` of a step's arrays, each in its STEP_DTYPES dtype, in StepArrays' field order."""
        names = [f.name for f in fields(arrays)]
        device = self.upload({name: (getattr(arrays, name), STEP_DTYPES[name]) for name in names})
        return StepArrays(**device)


@dataclass(slots=True)
class TablePlan:
    """What one step does to the device block tables: the store row each sequence reads (in batch order) and the
    entries to write first (flat indices into the store, and their block ids). Applied by BlockTables.apply."""

    rows: list[int]  # [B] store row of each batch row
    update_index: list[int]  # [U] row * width + column
    update_value: list[int]  # [U] block id
    width: int  # columns of the step's gathered table
    assignment: dict[str, int]  # sequence key -> its row, once applied
    held: dict[int, list[int]]  # row -> the block ids it holds once applied (rows that change)


class BlockTables:
    """The running sequences' block tables on the device: one row of ``width`` block ids per sequence, kept as long as
    the sequence is scheduled step after step, so that a row changes only when its sequence's table does (it
    gains a block; or it was rebuilt, after a preemption). Each step the rows of the batch are gathered, in batch
    order, into one [B, W] table. Row ``max_seqs`` is all zeros: padding rows read it.

    A sequence that is not scheduled in a step gives its row back; it is written whole when it comes back."""

    def __init__(self, max_seqs: int, width: int, device: torch.device) -> None:
        self.max_seqs, self.width = max_seqs, width
        self.padding_row = max_seqs
        self.store = torch.zeros(max_seqs + 1, width, dtype=torch.int32, device=device)  # [rows + 1, width]
        self.gathered = torch.zeros(max_seqs * width, dtype=torch.int32, device=device)  # the step's [B, W], flat
        self._rows: dict[str, int] = {}  # sequence key -> row
        self._held: list[list[int]] = [[] for _ in range(max_seqs)]  # the block ids each row holds on the device

    def plan(self, keys: Sequence[str], tables: Sequence[list[int]], padding: int, width: int | None) -> TablePlan:
        """The rows and updates for a step of sequences ``keys`` with block ``tables`` (batch order), followed by
        ``padding`` padding rows; ``width``: the gathered table's columns (None: the longest table's). Changes
        nothing until applied."""
        assert len(keys) + padding <= self.max_seqs, f"{len(keys)} sequences + {padding} padding > {self.max_seqs}"
        longest = max((len(t) for t in tables), default=1)
        if longest > self.width:
            raise ValueError(f"a block table of {longest} blocks is longer than the runner's {self.width}")
        scheduled = set(keys)
        kept = {k: r for k, r in self._rows.items() if k in scheduled}
        taken = set(kept.values())
        free = [r for r in range(self.max_seqs) if r not in taken]
        assignment: dict[str, int] = {}
        rows: list[int] = []
        index: list[int] = []
        value: list[int] = []
        held: dict[int, list[int]] = {}
        for key, table in zip(keys, tables, strict=True):
            row = kept.get(key)
            if row is None:
                row = free.pop()
            assignment[key] = row
            rows.append(row)
            before = self._held[row]  # what the device row holds (a row given back keeps its last owner's blocks)
            if table == before:
                continue
            # an append writes the new entries only; anything else (a table rebuilt or cut) rewrites the row
            first = len(before) if table[: len(before)] == before else 0
            base = row * self.width
            index.extend(range(base + first, base + len(table)))
            value.extend(table[first:])
            held[row] = list(table)
        rows.extend([self.padding_row] * padding)
        return TablePlan(rows, index, value, max(1, longest) if width is None else width, assignment, held)

    def apply(self, plan: TablePlan, rows: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Write the plan's updates into the store and gather its rows (``rows``, ``index``, ``value``: the plan's
        lists as device tensors) into the step's table [B, plan.width] int32; then record what the rows hold."""
        if plan.update_index:
            self.store.view(-1).index_copy_(0, index, value)
        batch = len(plan.rows)
        out = self.gathered[: batch * plan.width].view(batch, plan.width)
        torch.index_select(self.store[:, : plan.width], 0, rows, out=out)
        self._rows = plan.assignment
        for row, table in plan.held.items():
            self._held[row] = table
        return out
