"""A request's failure told from the engine's: a device fault (or a dead rank) stops the engine, anything else
fails the one request, with the error it gets."""

from __future__ import annotations

import logging
import traceback

import torch

from lora_server.engine.request import Request
from lora_server.errors import AdapterUnavailableError, RequestFailedError, TensorParallelError

_DEVICE_FAULTS = (
    "CUDA error",
    "device-side assert",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "illegal memory access",
    "unspecified launch failure",
)
log = logging.getLogger("lora_server")


def is_device_fault(exc: BaseException) -> bool:
    """Whether an exception means the device (or the host's memory) can no longer be trusted: the engine stops
    instead of failing one request."""
    if isinstance(exc, TensorParallelError):  # a rank died or the ranks fell out of step
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, MemoryError) and not isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _DEVICE_FAULTS)


def request_failed(request: Request, reason: str) -> RequestFailedError:
    return RequestFailedError(f"request {request.request_id} failed: {reason}")


def adapter_unavailable(request: Request, reason: str) -> AdapterUnavailableError:
    """The error of a request whose adapter the loader could not stage (``reason`` names no path)."""
    name = "?" if request.adapter is None else request.adapter.name
    return AdapterUnavailableError(f"adapter `{name}` cannot be served now: {reason}")


def describe(exc: BaseException) -> str:
    """Why a request failed, for its error message; the log gets the innermost frame too."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    if frame:
        log.error("serving a request raised %s at %s:%d", type(exc).__name__, frame[0].filename, frame[0].lineno)
    return f"{type(exc).__name__}: {exc}"
