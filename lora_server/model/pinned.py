"""Host memory for asynchronous copies to the device, pinned to the size asked for.

torch's pinned allocator rounds every block up to a power of two (an 80 MB adapter image would pin 128 MB, a 5 GiB
host tier 8 GiB). Here the memory is an ordinary host allocation of the exact size, page-aligned, registered with
CUDA (cudaHostRegister) so that copies from and to it are asynchronous, and unregistered when the last tensor that
views it is freed. Unlike torch's allocator, nothing keeps it alive while a copy from it is in flight: the caller
holds it until the copy has run (model.copy_order keeps a staged image until its load is known to be done)."""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

PAGE = 4096  # registration covers whole pages: the buffer starts on one


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized host tensor of ``shape`` and ``dtype`` from which copies to ``device`` are asynchronous:
    on CUDA registered memory of exactly its bytes; elsewhere ordinary memory (the CPU needs no pinning; the meta
    stand-in for CUDA, instrument.host_work, emulates torch's pin_memory and is asked for it)."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=device.type != "cpu")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    buffer = raw[start : start + nbytes]
    if nbytes:
        address = buffer.ctypes.data
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(address, nbytes, 1))  # 1: cudaHostRegisterPortable (any device)
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")
        weakref.finalize(raw, cudart.cudaHostUnregister, address)  # once no tensor views the memory
    return torch.from_numpy(buffer).view(dtype).view(shape)


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """pinned_empty, zero-filled."""
    out = pinned_empty(shape, dtype, device)
    out.zero_()
    return out
