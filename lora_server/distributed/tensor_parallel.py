"""Rank 0's side of tensor parallelism: what the model runner holds when --tensor-parallel-size is above 1 (at 1
it holds nothing and nothing here runs). It refuses what this build would serve wrongly, shards the checkpoint,
starts the workers, swaps the parallel modules into rank 0's model, and sends each step's inputs."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch

from lora_server.config import EngineConfig
from lora_server.distributed.group import Comm, destroy_group, free_port, init_group, refuse_second_group
from lora_server.distributed.layers import parallelize
from lora_server.distributed.shard import Shard, check_tensor_parallel, shard_checkpoint
from lora_server.distributed.step_message import SWAP_IN, SWAP_OUT, StepChannel, message_capacity
from lora_server.distributed.workers import WorkerRanks, WorkerSetup
from lora_server.errors import ConfigError, TensorParallelError
from lora_server.kv_pool.tree import CopyOp, OpKind
from lora_server.model.checkpoint import Checkpoint
from lora_server.model.llama import LlamaModel
from lora_server.model.sampler import scoring_rows
from lora_server.model.step_inputs import HostArrays

_SWAPS = {OpKind.KV_SWAP_OUT: SWAP_OUT, OpKind.KV_SWAP_IN: SWAP_IN}


class TensorParallel:
    """Rank 0 of ``config.tensor_parallel_size``. ``checkpoint``: rank 0's shard of the checkpoint given, what the
    runner builds its model from. Start-up: construct (workers spawn and load), ``parallelize`` rank 0's model,
    ``start`` once the arena is sized. ``close`` stops the workers."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.config = config
        n = config.tensor_parallel_size
        if config.torch_device.type != "cpu":
            raise ConfigError(
                f"--tensor-parallel-size {n} runs on the CPU (gloo) only so far: on {config.torch_device.type} the "
                "warm-up, the decode graphs and NCCL are not built for it yet; pass --device cpu"
            )
        check_tensor_parallel(checkpoint.arch, config, checkpoint)
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
        self._kv_copies: list[int] = []  # the KV swaps made since the last step, for the workers (step_message)

    @property
    def adapter_refusal(self) -> str:
        return f"LoRA adapters are not served with --tensor-parallel-size {self.shard.world} yet (the base model only)"

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
        init_group(0, self.shard.world, self.port)
        self.channel = StepChannel(self.comm, setup.message_capacity)

    def send_step(self, arrays: HostArrays, max_query_len: int, num_padding: int, table_width: int) -> None:
        """Broadcast one step's inputs (before rank 0's forward pass: the workers run theirs alongside)."""
        self.check_alive()
        assert self.channel is not None, "start() first"
        copies, self._kv_copies = self._kv_copies, []
        arrays = {**arrays, "kv_copies": (copies, torch.int64)}
        scoring_slice = scoring_rows(self.shard.arch.vocab_size)
        self.channel.send(arrays, max_query_len, num_padding, table_width, scoring_slice)

    def mirror_kv_copies(self, ops: Sequence[CopyOp]) -> None:
        """Queue the KV swaps among ``ops`` (rank 0 makes them now) for the workers, who make them before the next
        step, as rank 0 made them before it (adapter ops: none while adapters are refused)."""
        for op in ops:
            direction = _SWAPS.get(op.kind)
            if direction is not None:
                for src, dst in zip(op.src, op.dst, strict=True):
                    self._kv_copies += (direction, src, dst)

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Rank 0's part of a step after its inputs went out: any error stops the engine (TensorParallelError), since
        the workers wait in a collective that rank 0 will not reach."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:
            raise TensorParallelError(f"rank 0's forward pass raised {exc!r}: the ranks are out of step") from exc

    def check_alive(self) -> None:
        """TensorParallelError naming the rank, once the watchdog has seen a worker die."""
        if self.workers.failure is not None:
            raise TensorParallelError(self.workers.failure)

    def close(self) -> None:
        """Stop the workers (a STOP message where they are still in step) and leave the group."""
        self.workers.expect_exit()
        if self.channel is not None and self.workers.failure is None:
            with contextlib.suppress(TensorParallelError):  # a worker died meanwhile: workers.close kills the rest
                self.channel.send_stop()
        self.channel = None
        self.workers.close()
        self._stop_workers.detach()
        destroy_group()
        torch.set_num_threads(self._threads_before)
