"""One step's inputs, from rank 0 to the workers, as one int64 tensor broadcast (a second one only when a step's
arrays exceed the message's capacity: a block-table rewrite of many rows).

Layout of the message [capacity] int64:
  [0] kind (STEP or STOP), [1] max_query_len, [2] num_padding, [3] the gathered block table's width,
  [4] scoring_slice: the prompt rows the head scores at once (rank 0's sampler.scoring_rows),
  [5] spill: values past the capacity, sent in a second broadcast of exactly that many,
  [6 : 6 + len(STEP_ARRAYS)] each array's length, then the arrays back to back in STEP_ARRAYS' order.
The arrays are the runner's host arrays of the same names (model.runner._build): the worker builds its
ForwardBatch from them as rank 0 does, its block tables updated by the same entries; and ``kv_copies``, the KV
swaps rank 0 made since its last step (runner.apply_copy_ops), which the worker makes on its own arena and host
tier before the step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lora_server.distributed.group import Comm
from lora_server.model.step_inputs import HostArrays

STEP, STOP = 1, 2
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
    "kv_copies": torch.int64,  # (SWAP_OUT or SWAP_IN, source block, destination block) triples, in order
}
SWAP_OUT, SWAP_IN = 0, 1  # device page -> host block, host block -> device page
HEADER = 6 + len(STEP_ARRAYS)


def message_capacity(max_tokens: int, max_seqs: int, block_size: int) -> int:
    """int64 values of a message that holds any step of up to ``max_tokens`` tokens and ``max_seqs`` sequences
    whose block tables grow by appends and that scores no prompt (four per-token arrays, three per-sequence, two
    entries per new block);
    larger steps spill."""
    new_blocks = max_tokens // block_size + max_seqs
    return HEADER + 4 * max_tokens + 3 * (max_seqs + 1) + 2 * new_blocks


@dataclass(frozen=True, slots=True)
class StepMessage:
    max_query_len: int
    num_padding: int
    table_width: int
    scoring_slice: int
    arrays: dict[str, torch.Tensor]  # STEP_ARRAYS' names -> 1-D tensors of their dtypes


class StepChannel:
    """Rank 0 sends, each worker receives, in the same order; ``capacity``: the message's int64 values (the same
    on every rank: rank 0 decides it, distributed.workers.WorkerSetup)."""

    def __init__(self, comm: Comm, capacity: int) -> None:
        assert capacity > HEADER
        self.comm = comm
        self.buffer = torch.zeros(capacity, dtype=torch.int64)  # [capacity]

    def send(
        self, arrays: HostArrays, max_query_len: int, num_padding: int, table_width: int, scoring_slice: int
    ) -> None:
        parts = [np.asarray(arrays[name][0], dtype=np.int64) for name in STEP_ARRAYS]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        room = self.buffer.numel() - HEADER
        spill = max(0, flat.size - room)
        header = [STEP, max_query_len, num_padding, table_width, scoring_slice, spill, *(p.size for p in parts)]
        values = self.buffer.numpy()
        values[:HEADER] = header
        values[HEADER : HEADER + flat.size - spill] = flat[: flat.size - spill]
        self.comm.broadcast(self.buffer)
        if spill:
            self.comm.broadcast(torch.from_numpy(np.ascontiguousarray(flat[room:])))

    def send_stop(self) -> None:
        self.buffer[0] = STOP
        self.comm.broadcast(self.buffer)

    def receive(self) -> StepMessage | None:
        """The next step's inputs; None when rank 0 stops the workers."""
        buffer = self.comm.broadcast(self.buffer)
        kind, max_query_len, num_padding, width, scoring_slice, spill = buffer[:6].tolist()
        if kind == STOP:
            return None
        lengths = buffer[6:HEADER].tolist()
        flat = buffer[HEADER : HEADER + sum(lengths) - spill]
        if spill:
            flat = torch.cat([flat, self.comm.broadcast(torch.empty(spill, dtype=torch.int64))])
        arrays, start = {}, 0
        for (name, dtype), n in zip(STEP_ARRAYS.items(), lengths, strict=True):
            arrays[name] = flat[start : start + n].to(dtype)
            start += n
        return StepMessage(max_query_len, num_padding, width, scoring_slice, arrays)
