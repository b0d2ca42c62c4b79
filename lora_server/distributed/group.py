"""The process group of one tensor-parallel engine and the one wrapper every collective goes through (``Comm``),
which counts calls and bytes per kind and turns a failed collective into a TensorParallelError naming the rank that
died.

The group is torch.distributed's default group, gloo over TCP on 127.0.0.1 (one engine's ranks share a machine),
and a second group of the same ranks for the step messages. The two have different timeouts: waiting for the next
message has none in effect (an idle engine's workers wait in that broadcast for as long as the engine idles),
while a step's own collectives (all-reduces, gathers), and rank 0's sending of a message (gloo's sender waits until
each receiver takes it), time out after STEP_TIMEOUT, so that a rank that is alive but no longer takes part stops
the engine with an error instead of a hang. That is the backstop: a rank that dies, or
stops answering (stopped, or hung holding the GIL), is found within seconds by rank 0's watchdog (its exit code, its
heartbeat: distributed.workers), which names it; the timeout is left for a rank whose heartbeat goes on while its
step does not (a deadlock outside the GIL)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lora_server.errors import TensorParallelError

MESSAGE_TIMEOUT = timedelta(days=365)  # waiting for the next step's message: in effect none
STEP_TIMEOUT = timedelta(minutes=10)  # a step's collectives: far beyond any step's compute on a rank
JOIN_TIMEOUT = timedelta(minutes=10)  # every rank at the rendezvous: a worker builds its arena and host tier first
KINDS = ("all_reduce", "gather", "broadcast", "scatter")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refuse_second_group() -> None:
    """One tensor-parallel engine a process (torch.distributed's default group): a second is refused."""
    if dist.is_initialized():
        raise TensorParallelError(
            "a tensor-parallel engine is already running in this process (one per process: torch.distributed's "
            "default group); close it first (ModelRunner.close)"
        )


def init_group(rank: int, world: int, port: int) -> dist.ProcessGroup:
    """Join the default process group as ``rank`` of ``world`` (blocks until every rank has joined, for at most
    JOIN_TIMEOUT), its collectives timing out after STEP_TIMEOUT; returns the group of the same ranks for the step
    messages.

    The rendezvous has its own timeout: with init_method's, it would wait STEP_TIMEOUT for a worker still building
    its arena. And it fails before init_process_group names a group: a failed join leaves torch's count of groups,
    which names the next group's keys, where a worker process (which counts from 0) expects it."""
    refuse_second_group()
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=JOIN_TIMEOUT)
    except dist.DistError as exc:  # DistStoreError: a rank never came; DistNetworkError: no master to reach
        raise TensorParallelError(
            f"the tensor-parallel ranks did not all meet at 127.0.0.1:{port} within "
            f"{JOIN_TIMEOUT.total_seconds():g} s (rank {rank}): {exc}"
        ) from exc
    store.set_timeout(STEP_TIMEOUT)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world, timeout=STEP_TIMEOUT
    )
    messages = dist.new_group(backend="gloo", timeout=MESSAGE_TIMEOUT)
    assert messages is not None
    return messages


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(slots=True)
class CommCounter:
    """Collectives this rank took part in since the last reset: calls and bytes per kind (KINDS). Bytes are those
    of the tensor this rank hands in or gets (an all-reduce's, a gather's local part, a broadcast's message, the
    part a scatter gives it)."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.nbytes

    def reset(self) -> None:
        for kind in KINDS:
            self.calls[kind] = self.bytes[kind] = 0


class Comm:
    """This rank's collectives: a step's on the default group, the step messages (broadcasts, scatters) on
    ``messages`` (init_group's, set once the ranks have joined). ``diagnose``: called when a collective raises,
    returns the failure to report (rank 0's watchdog names the dead rank) or None (the collective's own error is
    reported)."""

    def __init__(self, rank: int, world: int, diagnose: Callable[[], str | None] = lambda: None) -> None:
        self.rank, self.world = rank, world
        self.counter = CommCounter()
        self.diagnose = diagnose
        self.messages: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: ``tensor`` becomes the sum over the ranks; returns it."""
        self.counter.add("all_reduce", tensor)
        self._run(lambda: dist.all_reduce(tensor))
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (equal shapes), in rank order, on rank 0; None on the others."""
        self.counter.add("gather", tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world)] if self.rank == 0 else None
        self._run(lambda: dist.gather(tensor, parts, dst=0))
        return parts

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: rank 0's ``tensor`` on every rank; returns it."""
        self.counter.add("broadcast", tensor)
        self._run(lambda: self._message(dist.broadcast(tensor, src=0, group=self.messages, async_op=True)))
        return tensor

    def scatter_from_first(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``parts`` (one per rank, in rank order, equal shapes; None on the others): rank r's into its
        ``out``; returns it."""
        self.counter.add("scatter", out)
        self._run(lambda: self._message(dist.scatter(out, parts, src=0, group=self.messages, async_op=True)))
        return out

    def _message(self, work: dist.Work | None) -> None:
        """Wait for a step message's collective: on rank 0, the sender, for at most STEP_TIMEOUT (gloo's sender
        waits until each receiver takes the message, and a rank that never does would hold rank 0 for the message
        group's year); on the others for as long as rank 0 takes to send the next one."""
        assert work is not None
        if self.rank == 0:
            work.wait(timeout=STEP_TIMEOUT)
        else:
            work.wait()

    def _run(self, collective: Callable[[], object]) -> None:
        try:
            collective()
        except RuntimeError as exc:  # a peer's socket closed (it died), it timed out, or the group broke
            reason = self.diagnose()
            if reason is None and "timed out" in str(exc).lower():
                reason = (
                    f"a collective on rank {self.rank} timed out after {STEP_TIMEOUT.total_seconds():g} s: a rank is "
                    f"alive but no longer takes part in the step (hung or stopped): {exc}"
                )
            raise TensorParallelError(reason or f"a collective failed on rank {self.rank}: {exc}") from exc
