"""The worker ranks 1..N-1: their processes (torch.multiprocessing, spawn), started and watched by rank 0
(``WorkerRanks``), and their loop (``run_worker``).

Start-up, in order: rank 0 spawns the workers; each reads its shard of the checkpoint (in parallel with rank 0's)
and reports on the ``loaded`` queue (its error's text if loading failed); rank 0, once its own arena is sized,
hands each a WorkerSetup on the ``setup`` queue (the arena's layout and the message's size: rank 0 decides, the
workers follow); then every rank joins the process group. No collective runs before every rank has loaded, so a
worker that fails to load is an error naming it, never a hang.

Faults: rank 0's watchdog thread polls the workers' exit codes and their heartbeats. Each worker has a thread of its
own that counts, every POLL_S, in memory shared with rank 0 (``beats``): the count moves while the worker computes
or waits in a collective (both let go of the GIL), and stops when the process is stopped (SIGSTOP, a debugger),
holds the GIL (a hang in Python, a long GC pause) or is not scheduled. The first worker that exits unasked, or whose
count has not moved for ``answer_timeout_s`` since it loaded its shard, is recorded as the failure, naming it; all
the workers are then killed (a stopped one too: a SIGCONT later finds it gone), so that rank 0's pending or next
collective fails at once (their sockets close) and the engine stops with that error. A worker exits when rank 0's
process goes (its collective fails, or its heartbeat thread sees the parent gone)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lora_server.adapters.page_layout import PageLayout
from lora_server.config import EngineConfig
from lora_server.distributed.group import Comm, destroy_group, init_group
from lora_server.distributed.layers import parallelize
from lora_server.distributed.shard import Shard, shard_checkpoint
from lora_server.distributed.step_message import (
    CHECK,
    LOAD,
    STOP,
    SWAP_IN,
    SWAP_OUT,
    StepChannel,
    StepMessage,
    decode_copy_ops,
)
from lora_server.errors import TensorParallelError
from lora_server.kernels.reference import FP8_KV_DTYPE
from lora_server.model.arena import Arena, ResidentAdapters, attach_arena, page_geometry
from lora_server.model.batch import ForwardBatch
from lora_server.model.llama import LayerKV, LlamaModel, build_llama
from lora_server.model.loader import open_checkpoint
from lora_server.model.lora import LoraBatch

POLL_S = 0.1  # how often the watchdogs look and the workers' heartbeats count
# how long a loaded worker may go without a heartbeat before the engine stops: far beyond a scheduling delay or a GC
# pause, far below the step's collective timeout (group.STEP_TIMEOUT); a step's compute never counts against it
ANSWER_TIMEOUT_S = 10.0
log = logging.getLogger("lora_server")


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What rank 0 decides and every worker follows: its arena's pages and its host tier's blocks (each rank's page
    holds its share of the KV heads, so the page ids the pool hands out mean the same tokens on every rank), its
    block tables' shape and the step message's capacity."""

    num_blocks: int
    num_host_blocks: int
    max_seqs: int
    table_width: int
    message_capacity: int


class WorkerRanks:
    """Rank 0's handle on ranks 1..N-1 (spawned here, loading their shards at once)."""

    def __init__(self, config: EngineConfig, port: int, max_model_len: int, threads: int) -> None:
        """``threads``: each worker's torch threads (its share of the CPU's cores)."""
        ctx = mp.get_context("spawn")
        world = config.tensor_parallel_size
        self._loaded, self._setup = ctx.Queue(), ctx.Queue()
        self._beats = ctx.Array("q", world, lock=False)  # rank r's heartbeat count at r (rank 0's unused)
        self.answer_timeout_s = ANSWER_TIMEOUT_S
        self.processes = [
            ctx.Process(
                target=run_worker,
                args=(config, rank, port, max_model_len, threads, self._loaded, self._setup, self._beats),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for p in self.processes:
            p.start()
        log.info("tensor-parallel ranks started: %s", ", ".join(f"rank {r} pid {pid}" for r, pid in self.ranks()))
        self.failure: str | None = None  # the first unasked exit or silence, as the error to report
        self._closing = threading.Event()
        self._judged_since: float | None = None  # heartbeats count once every worker has loaded (wait_loaded)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids, rank 1 first."""
        return [p.pid for p in self.processes]

    def ranks(self) -> list[tuple[int, int | None]]:
        """(rank, process id) of each worker."""
        return list(enumerate(self.pids, start=1))

    def wait_loaded(self) -> None:
        """Block until every worker has loaded its shard; a worker's load error or death is a TensorParallelError
        naming it."""
        pending = set(range(1, len(self.processes) + 1))
        while pending:
            if self.failure is not None:
                raise TensorParallelError(self.failure)
            try:
                rank, error = self._loaded.get(timeout=POLL_S)
            except queue.Empty:  # look at the processes again
                continue
            if error is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load its shard:\n{error}")
            pending.discard(rank)
        self._judged_since = time.monotonic()  # loading holds the GIL for as long as it takes: from here, no more

    def hand_setup(self, setup: WorkerSetup) -> None:
        for _ in self.processes:
            self._setup.put(setup)

    def diagnose(self, wait_s: float = 2.0) -> str | None:
        """The failure the watchdog found, waiting up to ``wait_s`` for it (a collective can fail on a dead peer's
        socket a moment before the watchdog's next look)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        return self.failure

    def expect_exit(self) -> None:
        """From now on a worker's exit is no failure (rank 0 is stopping them)."""
        self._closing.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to exit (after a STOP) and kill any that does not."""
        self.expect_exit()
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()

    def _watch(self) -> None:
        """Until closing: the first worker that exits, or whose heartbeat count stands still for answer_timeout_s
        (judged from rank 0's own clock, so a watchdog that itself ran late blames no one), is the failure."""
        counts = [-1] * len(self.processes)
        heard = [0.0] * len(self.processes)  # when this thread last saw each count move
        while not self._closing.is_set():
            now = time.monotonic()
            for i, p in enumerate(self.processes):
                code, count = p.exitcode, self._beats[i + 1]
                if self._closing.is_set():
                    return
                if code is not None:
                    self._fail(i, f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
                    return
                if count != counts[i]:
                    counts[i], heard[i] = count, now
                    continue
                silent_s = now - max(heard[i], self._judged_since or now)
                if silent_s > self.answer_timeout_s:
                    self._fail(i, f"has not answered for {silent_s:.1f} s ({_process_state(p.pid)})")
                    return
            time.sleep(POLL_S)

    def _fail(self, index: int, how: str) -> None:
        """Record the failure of worker ``index`` (rank index + 1) and kill every worker."""
        p = self.processes[index]
        self.failure = f"tensor-parallel rank {index + 1} (pid {p.pid}) {how}: the engine cannot go on"
        log.error("%s", self.failure)
        for other in self.processes:
            if other.is_alive():
                other.kill()


class WorkerBlockTables:
    """A worker's copy of rank 0's block tables (model.step_inputs.BlockTables' store), kept equal by applying the
    same updates each step."""

    def __init__(self, max_seqs: int, width: int, device: torch.device) -> None:
        self.store = torch.zeros(max_seqs + 1, width, dtype=torch.int32, device=device)  # [rows + padding row, W]

    def apply(self, step: StepMessage) -> torch.Tensor:  # -> [B, step.shape.table_width] int32
        a = step.arrays
        if a["table_update_index"].numel():
            self.store.view(-1).index_copy_(0, a["table_update_index"], a["table_update_value"])
        return self.store[:, : step.shape.table_width].index_select(0, a["table_rows"])


def run_worker(
    config: EngineConfig,
    rank: int,
    port: int,
    max_model_len: int,
    threads: int,
    loaded: mp.Queue,
    setup_queue: mp.Queue,
    beats: ctypes.Array[ctypes.c_int64],
) -> None:
    """A worker rank's life: load its shard, report, take rank 0's setup, join the group, then run every step rank
    0 broadcasts until it says stop; its heartbeat counts at ``beats[rank]`` meanwhile."""
    _beat_while_parent_lives(beats, rank)
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    world = config.tensor_parallel_size
    try:
        checkpoint = open_checkpoint(config)
        shard = Shard(checkpoint.arch, rank, world)
        model = build_llama(
            shard_checkpoint(checkpoint, shard),
            config.quantization,
            config.torch_dtype,
            config.torch_device,
            max_model_len,
            show_progress=False,
            cpu_head_copy=config.cpu_head_copy,
            exact_kv=config.torch_kv_cache_dtype != FP8_KV_DTYPE,
        )
        del checkpoint
    except Exception:  # noqa: BLE001 (reported to rank 0, which raises it)
        loaded.put((rank, traceback.format_exc()))
        return
    comm = Comm(rank, world)
    parallelize(model, shard, comm)
    loaded.put((rank, None))
    setup: WorkerSetup = setup_queue.get()
    local, device = shard.local_arch, config.torch_device
    arena = Arena(setup.num_blocks, local, config.block_size, config.torch_kv_cache_dtype, config.torch_dtype, device)
    geometry = page_geometry(
        local, config.block_size, config.torch_kv_cache_dtype, config.torch_dtype, config.max_lora_rank
    )
    adapters = attach_arena(model, arena, geometry, None)
    host_kv = torch.zeros(setup.num_host_blocks, arena.page_bytes, dtype=torch.uint8)  # [host blocks, page bytes]
    kv_caches = [LayerKV(*arena.layer_kv(i)) for i in range(local.num_layers)]
    tables = WorkerBlockTables(setup.max_seqs, setup.table_width, arena.pages.device)
    comm.messages = init_group(rank, world, port)
    channel = StepChannel(comm, setup.message_capacity)
    with torch.inference_mode():
        while (step := channel.receive()).kind != STOP:
            _copy(step, adapters, host_kv)
            if step.kind == CHECK:
                comm.gather_to_first(fingerprint(adapters, tables.store))
            else:
                _run_step(model, step, tables.apply(step), kv_caches)
    destroy_group()


def fingerprint(adapters: ResidentAdapters, block_tables: torch.Tensor) -> torch.Tensor:
    """[3] int64: how many adapters an arena holds, a hash of their table pages and pages, a hash of the block
    tables' store: equal on every rank whose arena and tables follow rank 0's (TensorParallel.check_integrity)."""

    def digest(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)

    held = sorted((page, *adapters.pages_of(page)) for page in adapters.table_pages())
    values = [len(held), digest(repr(held).encode()), digest(block_tables.cpu().numpy().tobytes())]
    return torch.tensor(values, dtype=torch.int64)


def _run_step(model: LlamaModel, step: StepMessage, block_tables: torch.Tensor, kv_caches: list[LayerKV]) -> None:
    """Rank 0's forward pass and head on this rank's shard (runner.execute: the forward pass, the prompt rows
    scored, the logits): the same collectives in the same order."""
    arrays = step.step_arrays()
    segments = [tuple(s) for s in step.arrays["lora_segments"].view(-1, 3).tolist()]
    lora = LoraBatch(segments, None, 0) if segments else None  # the CPU's path reads the host runs alone
    shape = step.shape
    batch = ForwardBatch.of_arrays(
        arrays, block_tables, lora=lora, max_query_len=shape.max_query_len, num_padding=shape.num_padding
    )
    hidden = model(batch, kv_caches)
    scored = hidden[arrays.scored_rows]  # prompt logprobs: rank 0's head over these rows, a slice at a time
    for start in range(0, scored.shape[0], shape.scoring_slice):
        model.compute_logits(scored[start : start + shape.scoring_slice])
    if batch.logits_indices.numel():  # rank 0 samples: its head gathers every rank's logits
        model.compute_logits(hidden[batch.logits_indices])


def _copy(step: StepMessage, adapters: ResidentAdapters, host: torch.Tensor) -> None:
    """Rank 0's copy operations since its last step, in its order: KV swaps, adapter loads (their layout rebuilt
    from its ranks, vocabulary pieces and experts' LoRA, their pages from the step's scatter) and unloads."""
    pages, geometry, image_at = adapters.arena.pages, adapters.geometry, 0
    for op in decode_copy_ops(step.arrays["copy_ops"].tolist()):
        if op.kind == SWAP_OUT:
            host[op.dst].copy_(pages[op.src])
        elif op.kind == SWAP_IN:
            pages[op.dst].copy_(host[op.src])
        elif op.kind == LOAD:
            assert step.images is not None and op.adapter is not None, "an adapter load without its pages"
            layout = PageLayout(geometry, dict(op.adapter.ranks), vocab=op.adapter.vocab, experts=op.adapter.experts)
            size = layout.num_pages * geometry.page_bytes
            image = step.images[image_at : image_at + size].view(layout.num_pages, geometry.page_bytes)
            adapters.load(list(op.pages), layout, image, op.adapter.token_ids)
            image_at += size
        else:
            adapters.unload(op.pages[0])


def _beat_while_parent_lives(beats: ctypes.Array[ctypes.c_int64], rank: int) -> None:
    """A thread that counts at ``beats[rank]`` every POLL_S (rank 0's watchdog reads it) and ends this process once
    its parent (rank 0's process) is gone."""
    parent = os.getppid()

    def beat() -> None:
        while os.getppid() == parent:
            beats[rank] += 1  # this thread alone writes it
            time.sleep(POLL_S)
        os._exit(1)

    threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()


STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "waiting on the disk", "R": "running", "S": "sleeping"}


def _process_state(pid: int | None) -> str:
    """A process's state as Linux's /proc tells it ("process state T: stopped"), for the error's reader."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "its process state unknown"
    return f"process state {state}: {STATES.get(state, 'see man 5 proc')}"
