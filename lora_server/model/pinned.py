"""Host memory for asynchronous copies to the device, pinned to the size asked for, and a pool of such buffers
reused for staged adapter images (``ImageBuffers``).

torch's pinned allocator rounds every block up to a power of two (an 80 MB adapter image would pin 128 MB, a 5 GiB
host tier 8 GiB). Here the memory is an ordinary host allocation of the exact size, page-aligned, registered with
CUDA (cudaHostRegister) so that copies from and to it are asynchronous, and unregistered when the last tensor that
views it is freed. Unlike torch's allocator, nothing keeps it alive while a copy from it is in flight: the caller
holds it until the copy has run (model.copy_order keeps a staged image until its load is known to be done)."""

from __future__ import annotations

import math
import threading
import weakref
from collections import defaultdict

import numpy as np
import torch

from lora_server.adapters.peft_files import new_host_memory


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized host tensor of ``shape`` and ``dtype`` from which copies to ``device`` are asynchronous:
    on CUDA registered memory of exactly its bytes; elsewhere ordinary memory (the CPU needs no pinning; the meta
    stand-in for CUDA, instrument.host_work, emulates torch's pin_memory and is asked for it)."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=device.type != "cpu")
    return torch.from_numpy(_registered(math.prod(shape) * dtype.itemsize)).view(dtype).view(shape)


def _registered(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] host memory registered with CUDA (copies from and to it are asynchronous), page-aligned, and
    unregistered once nothing views it."""
    buffer = raw = new_host_memory(nbytes)
    if nbytes:
        address = buffer.ctypes.data
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(address, nbytes, 1))  # 1: cudaHostRegisterPortable (any device)
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")
        weakref.finalize(raw, cudart.cudaHostUnregister, address)  # once no tensor views the memory
    return buffer


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """pinned_empty, zero-filled."""
    out = pinned_empty(shape, dtype, device)
    out.zero_()
    return out


class ImageBuffers:
    """uint8 [pages, page_bytes] host buffers for adapter images, from which copies to ``device`` are asynchronous
    (registered with CUDA there; ordinary memory elsewhere), each reused once nothing views it any more.

    ``take`` hands out a buffer; it comes back by itself when the last tensor on its memory is freed (the loader
    evicted the image and no copy from it is in flight: model.copy_order holds an image until its copy has run), and
    the next ``take`` of the same size gets it again, registered and faulted in already. Free buffers are kept while
    everything allocated fits ``keep_bytes``; beyond, a returning buffer is freed. Thread-safe."""

    def __init__(self, page_bytes: int, device: torch.device, keep_bytes: int) -> None:
        self.page_bytes, self.device, self.keep_bytes = page_bytes, device, keep_bytes
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)  # pages -> buffers no tensor views
        self.allocated_bytes = 0  # every live buffer's, handed out or free
        self.reused = 0  # takes served by a returned buffer
        self._lock = threading.Lock()

    def take(self, num_pages: int) -> torch.Tensor:
        """A buffer of ``num_pages`` pages (contents undefined)."""
        nbytes = num_pages * self.page_bytes
        with self._lock:
            raw = self._free[num_pages].pop() if self._free[num_pages] else None
            if raw is None:
                self._trim(self.keep_bytes - nbytes)
                self.allocated_bytes += nbytes
            else:
                self.reused += 1
        if raw is None:
            raw = _registered(nbytes) if self.device.type == "cuda" else new_host_memory(nbytes)
        handed = raw.view()  # its own object: the tensors' storage holds it, and it dies with the last of them
        weakref.finalize(handed, self._give_back, num_pages, raw)
        return torch.from_numpy(handed).view(num_pages, self.page_bytes)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(len(free) * pages * self.page_bytes for pages, free in self._free.items())

    def _give_back(self, num_pages: int, raw: np.ndarray) -> None:
        with self._lock:
            if self.allocated_bytes <= self.keep_bytes:
                self._free[num_pages].append(raw)
            else:
                self.allocated_bytes -= num_pages * self.page_bytes

    def _trim(self, target: int) -> None:
        """Free unused buffers, largest first, until the live ones take at most ``target`` bytes (lock held)."""
        for pages in sorted(self._free, reverse=True):
            free = self._free[pages]
            while free and self.allocated_bytes > target:
                free.pop()
                self.allocated_bytes -= pages * self.page_bytes
