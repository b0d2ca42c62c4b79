"""lora_server.model.step_inputs and the decode buckets: the staging buffer against the lists it was given (values,
dtypes, one copy from pinned memory on the meta stand-in for CUDA, the same addresses for the same sizes, growth),
the device block tables against tables padded by hand (entries written only where a table changed, rows given
back and reused, padding rows), and the bucket sizes."""

from __future__ import annotations

import pytest
import torch

from lora_server.instrument.host_work import HostWorkCounter, stand_in_cuda
from lora_server.model.cuda_graphs import bucket_for, decode_buckets
from lora_server.model.step_inputs import BlockTables, StepInputs

CPU, META = torch.device("cpu"), torch.device("meta")


def test_arrays_come_back_as_given():
    inputs = StepInputs(CPU, 64)
    arrays = {
        "ids": ([3, -1, 2**40], torch.int64),
        "lens": ([5, 0, 7, 9, 11], torch.int32),
        "empty": ([], torch.int64),
        "slots": (range(4), torch.int32),
    }
    out = inputs.upload(arrays)
    for name, (values, dtype) in arrays.items():
        assert out[name].dtype == dtype and out[name].tolist() == list(values), name
    # the same sizes give the same addresses (what a captured graph reads); the CPU copies nothing
    again = inputs.upload({"ids": ([1, 2, 3], torch.int64), "lens": ([1] * 5, torch.int32)})
    assert again["ids"].data_ptr() == out["ids"].data_ptr() and again["lens"].data_ptr() == out["lens"].data_ptr()
    assert out["ids"].tolist() == [1, 2, 3]  # a step's views are rewritten by the next step


def test_the_buffer_grows_when_a_step_needs_more():
    inputs = StepInputs(CPU, 16)
    out = inputs.upload({"a": (list(range(10)), torch.int64), "b": ([7], torch.int32)})
    assert inputs.capacity_bytes >= 88 and out["a"].tolist() == list(range(10)) and out["b"].tolist() == [7]


def test_one_pinned_copy_per_step_to_the_device():
    with stand_in_cuda():
        inputs = StepInputs(META, 1024)
        counter = HostWorkCounter("meta", emulate=True)
        with counter:
            out = inputs.upload({"ids": ([1, 2, 3], torch.int64), "lens": ([4, 5], torch.int32)})
    work = counter.work
    assert (work.h2d, work.h2d_pageable, work.syncs) == (1, 0, 0)
    assert out["ids"].device == META and out["ids"].shape == (3,) and out["lens"].dtype == torch.int32


def _step(tables: BlockTables, seqs: dict[str, list[int]], padding: int = 0, width: int | None = None):
    """Plan and apply a step on the CPU; returns the gathered table (as lists) and the number of entries written."""
    plan = tables.plan(list(seqs), list(seqs.values()), padding, width)

    def t(values):
        return torch.tensor(values, dtype=torch.int64)

    out = tables.apply(plan, t(plan.rows).int(), t(plan.update_index), t(plan.update_value).int())
    return out.tolist(), len(plan.update_index)


def _padded(seqs: list[list[int]], width: int) -> list[list[int]]:
    return [s + [None] * (width - len(s)) for s in seqs]


def _matches(got: list[list[int]], expected: list[list[int | None]]) -> bool:
    """Equal where expected says a block (None: any entry past the sequence's blocks)."""
    return len(got) == len(expected) and all(
        len(g) == len(e) and all(x is None or x == y for x, y in zip(e, g, strict=True))
        for g, e in zip(got, expected, strict=True)
    )


def test_block_tables_are_updated_incrementally():
    tables = BlockTables(max_seqs=4, width=6, device=CPU)
    got, written = _step(tables, {"a": [5, 6], "b": [9]})
    assert _matches(got, [[5, 6], [9, None]]) and written == 3
    # nothing changed: nothing written; a gains a block: one entry
    got, written = _step(tables, {"a": [5, 6], "b": [9]})
    assert written == 0 and _matches(got, [[5, 6], [9, None]])
    got, written = _step(tables, {"a": [5, 6, 7], "b": [9]})
    assert written == 1 and _matches(got, _padded([[5, 6, 7], [9]], 3))
    # order changes (batch order is the runner's): rows follow their sequences; a table cut (rejected drafts)
    # and one rebuilt (preempted, then admitted again) rewrite their rows whole
    got, written = _step(tables, {"b": [9, 10, 11], "a": [5, 6]})
    assert written == 2 + 2 and _matches(got, [[9, 10, 11], [5, 6, None]])
    got, written = _step(tables, {"a": [8, 6, 4], "b": [9, 10, 11]})
    assert written == 3 and _matches(got, [[8, 6, 4], [9, 10, 11]])


def test_rows_are_given_back_and_padding_reads_zeros():
    tables = BlockTables(max_seqs=3, width=4, device=CPU)
    _step(tables, {"a": [1, 2], "b": [3], "c": [4, 5, 6]})
    # b is not scheduled: its row goes back; d takes it and writes its whole table
    got, written = _step(tables, {"a": [1, 2], "c": [4, 5, 6], "d": [7, 8]})
    assert _matches(got, _padded([[1, 2], [4, 5, 6], [7, 8]], 3)) and written == 2
    # b comes back: written whole again; padding rows gather the zero row, at full width when asked
    got, written = _step(tables, {"b": [3]}, padding=2, width=4)
    assert written == 1 and got[0][0] == 3 and got[1:] == [[0] * 4, [0] * 4]
    with pytest.raises(ValueError, match="longer"):
        _step(tables, {"a": [1, 2, 3, 4, 5]})


def test_decode_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert decode_buckets(1) == [1] and decode_buckets(6) == [1, 2, 4, 6]
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 33, 64, 65)] == [1, 4, 8, 16, 48, 64, None]
    assert bucket_for(3, []) is None
