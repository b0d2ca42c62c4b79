"""Rank 0's side of tensor parallelism: what the model runner holds when --tensor-parallel-size is above 1 (at 1
it holds nothing and nothing here runs). It refuses what this build would serve wrongly, shards the checkpoint and
each adapter, starts the workers, swaps the parallel modules into rank 0's model, and sends each step's inputs with
the pool's copy operations since the last step (the workers make the same ones: the pool decides for every rank)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

from lora_server.adapters.lora_types import BaseShapes
from lora_server.adapters.page_layout import PageGeometry, PageLayout
from lora_server.adapters.peft_format import LoraAdapter, PeftAdapter, TokenIds, VocabLora
from lora_server.config import EngineConfig
from lora_server.distributed.group import Comm, CommCounter, destroy_group, free_port, init_group, refuse_second_group
from lora_server.distributed.layers import parallelize
from lora_server.distributed.shard import Shard, check_tensor_parallel, shard_checkpoint
from lora_server.distributed.step_message import (
    CHECK,
    STEP,
    LoadedAdapter,
    StepChannel,
    StepShape,
    encode_copy_ops,
    message_arrays,
    message_capacity,
)
from lora_server.distributed.workers import WorkerRanks, WorkerSetup, fingerprint
from lora_server.errors import TensorParallelError
from lora_server.kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.model.arch import ModelArch
from lora_server.model.arena import AdapterForm, ResidentAdapters
from lora_server.model.checkpoint import Checkpoint
from lora_server.model.llama import LlamaModel
from lora_server.model.sampler import scoring_rows
from lora_server.model.step_inputs import StepArrays


class StagedShares(Protocol):
    """An adapter staged for every rank (engine.adapter_loader.StagedAdapter)."""

    @property
    def layout(self) -> PageLayout: ...

    @property
    def vocab(self) -> VocabLora | None: ...  # its embedding and head changes: whole on every rank

    @property
    def worker_images(self) -> tuple[torch.Tensor, ...]: ...  # ranks 1..N-1's uint8 [pages, page bytes]


class TensorParallel:
    """Rank 0 of ``config.tensor_parallel_size``. ``checkpoint``: rank 0's shard of the checkpoint given, what the
    runner builds its model from. Start-up: construct (workers spawn and load), ``parallelize`` rank 0's model,
    ``start`` once the arena is sized. ``close`` stops the workers."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.config = config
        n = config.tensor_parallel_size
        assert config.torch_device.type == "cpu", "refused by EngineConfig"
        check_tensor_parallel(checkpoint.arch, config)
        refuse_second_group()
        self.shard = Shard(checkpoint.arch, 0, n)
        self.checkpoint = shard_checkpoint(checkpoint, self.shard)
        self.port = free_port()
        # the ranks share this machine's cores: each takes 1/N of torch's threads (rank 0 this process's)
        self._threads_before = torch.get_num_threads()  # given back by close
        threads = max(1, self._threads_before // n)
        torch.set_num_threads(threads)
        self.workers = WorkerRanks(config, self.port, max_model_len, threads)
        self._stop_workers = weakref.finalize(self, self.workers.close, 0.0)  # a runner that fails to start
        self.comm = Comm(0, n, self.workers.diagnose)
        self.channel: StepChannel | None = None
        # the pool's copy operations made since the last step, for the workers (step_message), and each worker's
        # pages of the adapters they load, in order
        self._copy_ops: list[int] = []
        self._images: list[tuple[torch.Tensor, ...]] = []
        self._sent = False  # in_step: this step's inputs went out
        self._out_of_step = False  # a step failed on rank 0 after its inputs went out

    @property
    def arch(self) -> ModelArch:
        """The whole model's shape (adapters are validated against it; rank 0's share is self.checkpoint's)."""
        return self.shard.arch

    @property
    def collectives(self) -> CommCounter:
        """Rank 0's collectives since the counter's last reset (calls and bytes by kind)."""
        return self.comm.counter

    def adapter_form(self, shapes: BaseShapes, geometry: PageGeometry) -> AdapterForm:
        """Adapters validated against the whole model, each rank's share laid out in its pages, DoRA refused."""
        return AdapterForm(shapes, geometry, self.adapter_refusal, self.adapter_shards)

    def adapter_refusal(self, adapter: LoraAdapter | PeftAdapter) -> str:
        """Why an adapter is not served under tensor parallelism ("": it is): LoRA on any module, the embedding and
        head included, and trainable tokens are."""
        n = self.shard.world
        if adapter.magnitudes:  # its scale divides by the whole row's norm, after the row-parallel all-reduce
            return f"DoRA adapters are not served with --tensor-parallel-size {n} yet"
        return ""

    def adapter_shards(self, adapter: LoraAdapter) -> list[LoraAdapter]:
        """Each rank's share of a validated adapter (distributed.shard), rank 0's first."""
        return [Shard(self.shard.arch, rank, self.shard.world).adapter(adapter) for rank in range(self.shard.world)]

    def parallelize(self, model: LlamaModel) -> None:
        parallelize(model, self.shard, self.comm)

    def start(self, num_blocks: int, num_host_blocks: int, table_width: int, max_step_tokens: int) -> None:
        """Hand the workers rank 0's decisions (its arena's pages, its host tier's blocks, its block tables' width,
        the most tokens of a step), once they have loaded, and join the group with them."""
        config = self.config
        capacity = message_capacity(max_step_tokens, config.max_num_seqs, config.block_size)
        setup = WorkerSetup(num_blocks, num_host_blocks, config.max_num_seqs, table_width, capacity)
        self.workers.wait_loaded()
        self.workers.hand_setup(setup)
        self.comm.messages = init_group(0, self.shard.world, self.port)
        self.channel = StepChannel(self.comm, setup.message_capacity)

    def send_step(
        self,
        arrays: StepArrays[Sequence[int]],
        max_query_len: int,
        num_padding: int,
        table_width: int,
        lora_segments: Sequence[tuple[int, int, int]],
    ) -> None:
        """Broadcast one step's inputs (before rank 0's forward pass: the workers run theirs alongside), with the
        copy operations made since the last step; ``lora_segments``: the step's runs of tokens that share an adapter
        (start, end, table page)."""
        segments = [value for segment in lora_segments for value in segment]
        shape = StepShape(max_query_len, num_padding, table_width, scoring_rows(self.shard.arch.vocab_size))
        self._send({**message_arrays(arrays), "lora_segments": segments}, shape)
        self._sent = True

    def mirror_copy_ops(self, ops: Sequence[CopyOp], staged: Mapping[AdapterKey, StagedShares] | None) -> None:
        """Queue ``ops`` (rank 0 makes them now) for the workers, who make them before the next step, in the same
        order, on their own arenas and host tiers: KV swaps block by block, adapter loads with their layout's ranks
        and each worker's pages of them (``staged``: each loaded adapter's), unloads."""
        staged = staged or {}
        loads = [op.adapter for op in ops if op.kind is OpKind.ADAPTER_LOAD and op.adapter is not None]
        loaded = {key: _loaded(staged[key]) for key in loads}
        self._copy_ops += encode_copy_ops(ops, loaded)
        self._images += [staged[key].worker_images for key in loads]

    def check_integrity(self, adapters: ResidentAdapters, block_tables: torch.Tensor) -> None:
        """Every worker's arena holds the adapters rank 0's holds, in the same pages, and its block tables are rank
        0's (AssertionError naming the first rank that differs), once the copy operations queued are made."""
        self._send({}, StepShape(), CHECK)
        mine = fingerprint(adapters, block_tables)
        parts = self.comm.gather_to_first(mine)
        assert parts is not None
        for rank, theirs in enumerate(parts[1:], start=1):
            assert torch.equal(theirs, mine), (
                f"tensor-parallel rank {rank}'s arena or block tables differ from rank 0's (fingerprint "
                f"{theirs.tolist()} against {mine.tolist()}: adapters, their pages, block tables)"
            )

    def _send(self, arrays: Mapping[str, Sequence[int]], shape: StepShape, kind: int = STEP) -> None:
        """One message with the copy operations queued, and the scatter of their adapters' pages."""
        self.check_alive()
        assert self.channel is not None, "start() first"
        stream, self._copy_ops = self._copy_ops, []
        images, self._images = self._images, []
        per_worker = None
        if images:  # worker w's pages of every adapter loaded, in load order: one flat uint8 tensor each
            per_worker = [torch.cat([shares[w].view(-1) for shares in images]) for w in range(self.shard.world - 1)]
        arrays = {**arrays, "copy_ops": stream}
        self.channel.send(arrays, shape, per_worker, kind)

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Rank 0's part of a step, up to its last collective (the logits' gather): an error once the step's inputs
        went out stops the engine (TensorParallelError), since the workers wait in a collective that rank 0 will not
        reach; one before (the step never left rank 0) is the step's own."""
        self._sent = False
        try:
            yield
        except Exception as exc:
            if not self._sent:
                raise
            self._out_of_step = True  # close kills the workers: they wait in a collective, not for a message
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(
                f"rank 0 raised {exc!r} after sending the step's inputs: the ranks are out of step"
            ) from exc

    def check_alive(self) -> None:
        """TensorParallelError naming the rank, once the watchdog has seen a worker die."""
        if self.workers.failure is not None:
            raise TensorParallelError(self.workers.failure)

    def abort(self) -> None:
        """Stop the workers at once: rank 0 failed to start (its shard could not be built, or its arena)."""
        self._stop_workers()  # workers.close(0.0), once
        destroy_group()
        torch.set_num_threads(self._threads_before)

    def close(self) -> None:
        """Stop the workers (a STOP message where they are still in step) and leave the group."""
        self._copy_ops, self._images = [], []
        self.workers.expect_exit()
        channel, self.channel = self.channel, None
        in_step = channel is not None and self.workers.failure is None and not self._out_of_step
        if channel is not None and in_step:
            with contextlib.suppress(TensorParallelError):  # a worker died meanwhile: workers.close kills the rest
                channel.send_stop()
        self.workers.close(10.0 if in_step else 0.0)
        self._stop_workers.detach()
        destroy_group()
        torch.set_num_threads(self._threads_before)


def _loaded(shares: StagedShares) -> LoadedAdapter:
    layout, vocab = shares.layout, shares.vocab
    return LoadedAdapter(layout.ranks, layout.vocab, TokenIds() if vocab is None else vocab.token_ids, layout.experts)
