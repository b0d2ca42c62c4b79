"""The ranks a runner serves with: its hooks into a step, called unconditionally. ``SingleRank`` (one device, no
other ranks) does nothing in them; distributed.tensor_parallel.TensorParallel (rank 0 of several) builds rank 0's
shard, starts the workers and mirrors every step and copy operation to them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from lora_server.model.arena import AdapterForm

if TYPE_CHECKING:
    from lora_server.adapters.lora_types import BaseShapes
    from lora_server.adapters.page_layout import PageGeometry, PageLayout
    from lora_server.adapters.peft_format import VocabLora
    from lora_server.kv_pool.tree import AdapterKey, CopyOp
    from lora_server.model.arch import ModelArch
    from lora_server.model.arena import ResidentAdapters
    from lora_server.model.checkpoint import Checkpoint
    from lora_server.model.llama import LlamaModel
    from lora_server.model.step_inputs import StepArrays


class StagedImage(Protocol):
    """An adapter ready to be copied into the arena (engine.adapter_loader.StagedAdapter)."""

    @property
    def layout(self) -> PageLayout: ...

    @property
    def image(self) -> torch.Tensor: ...  # uint8 [pages, page bytes]

    @property
    def vocab(self) -> VocabLora | None: ...  # what it changes of the embedding and head

    @property
    def worker_images(self) -> tuple[torch.Tensor, ...]: ...  # tensor parallelism: the other ranks' shares


class CollectiveCounts(Protocol):
    """A rank's count of the collectives it took part in since the last ``reset`` (distributed.group.CommCounter):
    calls and bytes by kind."""

    @property
    def calls(self) -> dict[str, int]: ...

    @property
    def bytes(self) -> dict[str, int]: ...

    def reset(self) -> None: ...


class Ranks(Protocol):
    """What ModelRunner asks of its ranks, in the order of an engine's life."""

    @property
    def checkpoint(self) -> Checkpoint: ...  # what this process builds its model from (rank 0's shard, or all)

    @property
    def arch(self) -> ModelArch: ...  # the whole model's shape, which adapters are validated against

    def parallelize(self, model: LlamaModel) -> None: ...  # the model built, before its arena

    def adapter_form(self, shapes: BaseShapes, geometry: PageGeometry) -> AdapterForm: ...

    def start(self, num_blocks: int, num_host_blocks: int, table_width: int, max_step_tokens: int) -> None: ...

    def check_alive(self) -> None: ...  # before each step's copy operations (the idle loop comes here too)

    def mirror_copy_ops(self, ops: Sequence[CopyOp], staged: Mapping[AdapterKey, StagedImage] | None) -> None: ...

    def send_step(
        self,
        arrays: StepArrays[Sequence[int]],
        max_query_len: int,
        num_padding: int,
        table_width: int,
        lora_segments: Sequence[tuple[int, int, int]],
    ) -> None: ...

    def in_step(self) -> contextlib.AbstractContextManager[None]: ...  # around this rank's part of a step

    def check_integrity(self, adapters: ResidentAdapters, block_tables: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...  # the runner failed to start: stop any other ranks at once

    @property
    def collectives(self) -> CollectiveCounts | None: ...  # this rank's collectives since their last reset


class SingleRank:
    """The whole model on this process's device: the checkpoint as given, every hook a no-op."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def arch(self) -> ModelArch:
        return self._checkpoint.arch

    def parallelize(self, model: LlamaModel) -> None:
        pass

    def adapter_form(self, shapes: BaseShapes, geometry: PageGeometry) -> AdapterForm:
        """Every adapter validated against the model and laid out as it is (no shares)."""
        return AdapterForm(shapes, geometry)

    def start(self, num_blocks: int, num_host_blocks: int, table_width: int, max_step_tokens: int) -> None:
        pass

    def check_alive(self) -> None:
        pass

    def mirror_copy_ops(self, ops: Sequence[CopyOp], staged: Mapping[AdapterKey, StagedImage] | None) -> None:
        pass

    def send_step(
        self,
        arrays: StepArrays[Sequence[int]],
        max_query_len: int,
        num_padding: int,
        table_width: int,
        lora_segments: Sequence[tuple[int, int, int]],
    ) -> None:
        pass

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        yield

    def check_integrity(self, adapters: ResidentAdapters, block_tables: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    @property
    def collectives(self) -> CollectiveCounts | None:
        return None  # no other rank: no collective
