"""A stand-in for CUDA on a machine without a GPU, and a counter of the host work the engine's CUDA code path
does: for tests (the decode step's guard: no sync, no pageable copy) and for ``lora-server bench-engine
--host-work``, which counts one decode step.

How the CUDA path runs without CUDA: the engine is built on the ``meta`` device (tensors with shape, dtype and
device, no storage) and ``lora_server.kernels.ops.use_kernels`` answers True for it, so every op the model calls
goes down its Triton side. ``HostWorkCounter`` (a TorchDispatchMode) sees every aten op the host issues and counts:

- ops: eager aten ops that are not views; torch_launches: those on the device that run a kernel there (not
  allocations, not transfers);
- triton_launches: Triton kernel launches (``JITFunction.run`` is replaced by a counter: nothing is compiled);
- h2d / h2d_pageable: host-to-device copies, and those whose source is not pinned memory (a pageable copy is
  synchronous on CUDA);
- syncs: device-to-host transfers and ops whose output shape depends on device data (.item(), .tolist(),
  .cpu(), nonzero, boolean indexing, unique, ...): each one stalls the host until the device catches up.

Why ``meta`` and not a fake ``cuda``: torch's FakeTensorMode can make tensors that say ``cuda:0``, but a CPU-only
torch build has no CUDA device guard, and Python indexing, ``copy_`` and ``.to("cuda")`` each open one, so the
engine's code fails on its first ``x[i]``; ``meta`` has a guard and every shape function. PrivateUse1 needs a
C++ extension. Limits: code that branches on ``device.type == "cuda"`` takes its CPU side (today: the runner's
pinned host tier and its swap stream, outside a decode step, and CUDA graphs: the decode forward runs eagerly, padded
to its bucket as on CUDA, and is counted apart); staging buffers are seen as pinned when they were allocated pinned
for a device that is not the CPU (``stand_in_cuda`` emulates the pinning a CPU-only torch cannot do). The device
computes nothing, so what the host reads back is zeros (the sampled tokens are all 0, ``.item()`` is 0): control
flow that depends on device values follows the zero branch. The host time is that of the counted meta step, whose
dispatch (a Python mode on every op) costs more than CUDA's: it overstates the real figure in proportion to the op
count. cuBLAS is not modelled.

``no_sync_or_pageable_copy()`` is the guard built on the same counter: it raises ``HostWorkError`` at the first
sync beyond those allowed or at the first pageable host-to-device copy inside its block (for a decode step's tests;
on a real GPU as well)."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

from lora_server.config import EngineConfig
from lora_server.model.cuda_graphs import bucket_for

if TYPE_CHECKING:
    from lora_server.engine import Engine
    from lora_server.model.batch import ForwardBatch

aten = torch.ops.aten
STAND_IN = torch.device("meta")  # the device that stands for CUDA (see the module's docstring)

# Ops whose output shape depends on device data: on CUDA they wait for the device.
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.is_nonzero.default,
    aten.equal.default,
}
# Ops that allocate device memory and launch nothing.
_ALLOCATIONS = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
}
# Ops that are bookkeeping rather than work: never counted.
_IGNORED = {
    torch.ops.prim.device.default,
    aten.lift_fresh.default,
    aten.detach.default,
    aten.detach_.default,
    aten.is_pinned.default,
}


class _PinnedSet:
    """Host tensors that stand for pinned memory where torch cannot pin (no CUDA): known by their storage, so that
    views of them are pinned too, and only while the tensor allocated pinned lives."""

    def __init__(self) -> None:
        self._by_storage: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, t: torch.Tensor) -> None:
        self._by_storage[t.untyped_storage().data_ptr()] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._by_storage.get(t.untyped_storage().data_ptr())
        return ref is not None and ref() is not None


class HostWorkError(RuntimeError):
    """A synchronization or a pageable host-to-device copy where none is allowed."""


@dataclass
class HostWork:
    """What one block of host code asked of the device."""

    ops: int = 0  # eager aten ops that are not views
    torch_launches: int = 0  # of them, those that run a kernel on the device (not allocations, not transfers)
    launches: int = 0  # Triton kernel launches
    h2d: int = 0  # host-to-device copies
    h2d_pageable: int = 0  # of them, from memory that is not pinned
    syncs: int = 0  # device-to-host transfers and data-dependent ops
    op_names: Counter[str] = field(default_factory=Counter)
    kernel_names: Counter[str] = field(default_factory=Counter)
    sync_names: Counter[str] = field(default_factory=Counter)

    def totals(self) -> dict[str, int]:
        """The counts alone."""
        return dict(
            ops=self.ops,
            torch_launches=self.torch_launches,
            triton_launches=self.launches,
            launches=self.torch_launches + self.launches,
            h2d=self.h2d,
            h2d_pageable=self.h2d_pageable,
            syncs=self.syncs,
        )

    def summary(self, top: int = 12) -> dict[str, Any]:
        return dict(
            **self.totals(),
            top_ops=dict(self.op_names.most_common(top)),
            kernels=dict(self.kernel_names),
            sync_ops=dict(self.sync_names),
        )


def _is_device(t: object, device_type: str) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == device_type


class HostWorkCounter(TorchDispatchMode):
    """Counts the host's requests to ``device_type`` into ``self.work`` (see the module's docstring).

    emulate: the device is the meta stand-in: answer what meta tensors cannot (a read back is a zero tensor,
    ``.item()`` 0, a data-dependent shape empty) and allocate "pinned" host memory unpinned (a CPU-only build
    cannot pin).
    strict: raise HostWorkError at the first pageable host-to-device copy and at the first sync beyond
    ``allowed_syncs``.
    Pinned host tensors are those allocated with pin_memory=True or pinned inside the block, and whatever
    ``is_pinned()`` says (on a real device; under ``stand_in_cuda``, those allocated pinned within it)."""

    def __init__(
        self, device_type: str = "cuda", *, emulate: bool = False, strict: bool = False, allowed_syncs: int = 0
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self.emulate = emulate
        self.strict = strict
        self.allowed_syncs = allowed_syncs
        self.work = HostWork()
        self._pinned = _PinnedSet()  # host tensors pinned inside the block

    def __enter__(self) -> HostWorkCounter:
        # under stand_in_cuda, what is pinned is the stand-in's to know: share its set (the allocations this
        # counter emulates included), so that buffers pinned before or under another counter stay pinned
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, _EmulatedPinning):
                self._pinned = mode.pinned
        super().__enter__()
        return self

    def reset(self) -> HostWork:
        """Start a new count; returns the previous one."""
        work, self.work = self.work, HostWork()
        return work

    def launch(self, name: str) -> None:
        self.work.launches += 1
        self.work.kernel_names[name] += 1

    def _pinned_source(self, t: torch.Tensor) -> bool:
        return t in self._pinned or t.is_pinned()

    def _pin(self, t: torch.Tensor) -> None:
        self._pinned.add(t)

    def _sync(self, name: str) -> None:
        self.work.syncs += 1
        self.work.sync_names[name] += 1
        if self.strict and self.work.syncs > self.allowed_syncs:
            raise HostWorkError(f"{name} synchronizes the host with the device")

    def _h2d(self, src: torch.Tensor) -> None:
        self.work.h2d += 1
        if not self._pinned_source(src):
            self.work.h2d_pageable += 1
            if self.strict:
                raise HostWorkError(f"a host-to-device copy from pageable memory ({tuple(src.shape)} {src.dtype})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(_is_device(t, self.device_type) for t in tensors)
        if not func.is_view:
            self.work.ops += 1
            self.work.op_names[func.__name__] += 1
        if func in _TRANSFERS:
            return self._copy(func, args, kwargs)
        if not func.is_view and func not in _ALLOCATIONS and func is not aten._local_scalar_dense.default and on_device:
            self.work.torch_launches += 1
        if self.emulate and on_device and kwargs.get("generator") is not None:
            kwargs = {**kwargs, "generator": None}  # meta kernels take no generator
        if func is aten._pin_memory.default:
            out = args[0].clone() if self.emulate else func(*args, **kwargs)
            self._pin(out)
            return out
        if func in _DATA_DEPENDENT and on_device:
            self._sync(func.__name__)
            if self.emulate:
                return _placeholder(func, args)
        if func is aten.index.Tensor and on_device and _bool_index(args[1]):
            self._sync("boolean index")
            if self.emulate:
                return args[0].new_empty((0, *args[0].shape[len(args[1]) :]))
        pinned = kwargs.get("pin_memory")
        if pinned and self.emulate:
            kwargs = {**kwargs, "pin_memory": False}
        out = func(*args, **kwargs)
        if pinned and isinstance(out, torch.Tensor):
            self._pin(out)
        return out

    def _copy(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        src = args[1] if func is aten.copy_.default else args[0]
        src_device = src.device.type == self.device_type
        dst_device = _target_device(func, args, kwargs).type == self.device_type
        if dst_device and not src_device:
            self._h2d(src)
        elif src_device and dst_device:
            out = func(*args, **kwargs)
            if out is not src or func is aten.copy_.default:  # ``to`` answers its input when nothing changes
                self.work.torch_launches += 1
                self.work.ops += func.is_view
            return out
        elif src_device and not dst_device:
            self._sync(f"{func.__name__} to host")
            if self.emulate:
                if func is aten.copy_.default:
                    return args[0]
                dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), src.dtype)
                with _disable_current_modes():
                    return torch.zeros(src.shape, dtype=dtype)
        return func(*args, **kwargs)


# Ops that move data between devices (``to`` reaches a mode undecomposed under inference_mode).
_TRANSFERS = {
    aten._to_copy.default,
    aten.copy_.default,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten.to.dtype,
}


def _target_device(func, args, kwargs) -> torch.device:  # type: ignore[no-untyped-def]
    """Where a transfer op's result lives."""
    if func is aten.copy_.default:
        return args[0].device
    if func is aten.to.device:
        return torch.device(args[1])
    if func is aten.to.other:
        return args[1].device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else args[0].device


def _bool_index(indices: list[torch.Tensor | None]) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _placeholder(func, args):  # type: ignore[no-untyped-def]
    """What a data-dependent op answers on the meta stand-in: zero, or an empty result."""
    x = args[0]
    if func is aten._local_scalar_dense.default:
        return False if x.dtype == torch.bool else 0.0 if x.dtype.is_floating_point else 0
    if func in (aten.is_nonzero.default, aten.equal.default):
        return False
    if func is aten.nonzero.default:
        return x.new_empty((0, x.dim()), dtype=torch.long)
    if func in (aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default):
        return x.new_empty(0), x.new_empty(0, dtype=torch.long), x.new_empty(0, dtype=torch.long)
    if func is aten._unique.default:
        return x.new_empty(0), x.new_empty(0, dtype=torch.long)
    return x.new_empty(0)


@contextlib.contextmanager
def counting_triton_launches(counter: HostWorkCounter, run: bool) -> Iterator[None]:
    """Within the block each ``kernel[grid](...)`` of a @triton.jit function is counted by ``counter``; it runs
    only when ``run`` (on the meta stand-in nothing can). Without triton, nothing to count."""
    with _triton_launches(counter.launch, run):
        yield


@contextlib.contextmanager
def _triton_launches(seen: Callable[[str], None] | None, run: bool) -> Iterator[None]:
    """Within the block each Triton kernel launch calls ``seen`` with the kernel's name, and runs only when ``run``."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    patches = []
    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def launch(self, *args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            if seen is not None:
                seen(getattr(getattr(self, "fn", None), "__name__", "triton kernel"))
            return _original(self, *args, **kwargs) if run else None

        patches.append(mock.patch.object(cls, "run", launch))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextlib.contextmanager
def no_sync_or_pageable_copy(device: torch.device | str = "cuda", allowed_syncs: int = 0) -> Iterator[HostWork]:
    """Raises HostWorkError at the first pageable host-to-device copy that the block asks of ``device``'s type, and
    at the first device-to-host sync beyond ``allowed_syncs``; Triton launches are counted and run, except on the
    meta stand-in (see ``stand_in_cuda``), where reads answer zeros as in the benchmark. Yields the count."""
    device_type = torch.device(device).type
    emulate = device_type == STAND_IN.type
    counter = HostWorkCounter(device_type, emulate=emulate, strict=True, allowed_syncs=allowed_syncs)
    with counter, counting_triton_launches(counter, run=not emulate):
        yield counter.work


_Generator = torch.Generator


class _HostGenerator(torch.Generator):
    """torch.Generator(device=meta) gives a CPU generator (meta tensors draw nothing)."""

    def __new__(cls, device: Any = "cpu") -> torch.Generator:  # type: ignore[misc]
        return _Generator()


def _use_kernels(device: torch.device | str) -> bool:
    return torch.device(device).type in ("cuda", STAND_IN.type)


class _EmulatedPinning(TorchDispatchMode):
    """Host memory allocated pinned (pin_memory=True, ``.pin_memory()``) is allocated unpinned, and ``is_pinned()``
    answers True for it: what a CPU-only torch, which cannot pin, needs to run code written for CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned = _PinnedSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return args[0].device.type == "cpu" and args[0] in self.pinned
        if func is aten._pin_memory.default:
            out = args[0].clone()
            self.pinned.add(out)
            return out
        pinned = kwargs.get("pin_memory")
        if pinned:
            kwargs = {**kwargs, "pin_memory": False}
        out = func(*args, **kwargs)
        if pinned and isinstance(out, torch.Tensor):
            self.pinned.add(out)
        return out


@contextlib.contextmanager
def stand_in_cuda(triton_runs: bool = False) -> Iterator[torch.device]:
    """Within the block, the meta device takes the CUDA path: ``kernels.ops.use_kernels`` says yes to it, Triton
    kernels are not launched (nothing can run on meta; a counter inside still counts them) unless
    ``triton_runs`` (then Triton's own launch path runs: for bench.kernel_aot, which catches each launch before it
    compiles), ``torch.Generator(device=...)`` gives a CPU generator, and pinned host memory is emulated
    (_EmulatedPinning). Yields the device."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("lora_server.kernels.ops.use_kernels", _use_kernels))
        stack.enter_context(mock.patch.object(torch, "Generator", _HostGenerator))
        if not triton_runs:
            stack.enter_context(_triton_launches(None, run=False))
        stack.enter_context(_EmulatedPinning())
        yield STAND_IN


class StandInConfig(EngineConfig):
    """The engine's config on the meta device (see STAND_IN); its device field says "cpu" to pass validation."""

    __slots__ = ()

    @property
    def torch_device(self) -> torch.device:
        return STAND_IN


@contextlib.contextmanager
def counting_forward_passes(engine: Engine, counter: HostWorkCounter) -> Iterator[list[dict[str, int]]]:
    """Within the block, each forward pass of the engine's runner (its eager forward: the decode graph's body)
    appends the counter's totals it added to the list yielded."""
    runner = engine.core.runner
    counts: list[dict[str, int]] = []
    eager_forward = runner._eager_forward

    def counted_forward(forward_batch: ForwardBatch) -> torch.Tensor:
        before = counter.work.totals()
        hidden = eager_forward(forward_batch)
        counts.append({k: v - before[k] for k, v in counter.work.totals().items()})
        return hidden

    with mock.patch.object(runner, "_eager_forward", counted_forward):
        yield counts


def decode_bucket(engine: Engine, batch: int) -> int | None:
    """The decode bucket a batch of ``batch`` is padded to on the engine (None: not padded)."""
    return bucket_for(batch, engine.core.runner.decode_buckets)
