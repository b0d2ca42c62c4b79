"""An adapter's files read once, and what identifies them without reading them again.

``read_file`` reads a file's bytes with ordinary reads, never memory-mapped: a mapped file truncated by another
process kills the reader with SIGBUS. A file that changed while it was read is refused. ``FileStamp`` is what the
file system says of a file (device, inode, size, modification and change times); ``FilesIdentity`` the stamps of an
adapter's files and when they were read, which tells a later reader whether the files are still the bytes read
then (``same_bytes``), so that staging a registered adapter again need not hash it again.
``SafetensorsFile`` parses a safetensors header, checks every offset against the bytes read, and gives each tensor
as a view of them (no copy)."""

from __future__ import annotations

import json
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from lora_server.adapters.errors import AdapterError

# A file changed within this long before it was read may change again with stamps that equal the ones taken, as
# file systems keep times at a coarse grain (ext4 a few ms, HFS+ 1 s, FAT 2 s): such a read vouches for nothing
# later, and the bytes are hashed when they are read again (git's "racy" files, the same rule).
SETTLE_NS = 2_000_000_000
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_Memory = TypeVar("_Memory", bytearray, memoryview)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # what LoRA weights may be stored in


@dataclass(frozen=True, slots=True)
class FileStamp:
    """A file's identity as the file system tells it: equal stamps, taken apart in time, mean the same bytes unless
    the file was written in the same grain of its clock as it was read (see FilesIdentity)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int  # the inode's change time, which no user can set back (utime sets only mtime and atime)

    @classmethod
    def of(cls, stat: os.stat_result) -> FileStamp:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class FilesIdentity:
    """The stamps of the files read for an adapter and the wall-clock time their reading began."""

    stamps: tuple[FileStamp, ...]
    read_ns: int

    def same_bytes(self, now: FilesIdentity) -> bool:
        """Whether files that stamp ``now`` hold the bytes read then: the same stamps, and files that had settled
        before that read (changed at least SETTLE_NS before it began), so that no write since can have left the
        stamps as they were."""
        return now.stamps == self.stamps and all(s.ctime_ns < self.read_ns - SETTLE_NS for s in self.stamps)


class ReadBuffer:
    """Memory a reader reuses from one file to the next (a staging worker's): new memory is faulted in page by page
    as it is first written, which costs more than the read itself on some machines (a VM: 40 ms for an 84 MB file
    into new memory). Grows to the largest file read; one reader at a time."""

    def __init__(self) -> None:
        self._memory = new_host_memory(0)

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of it (the same memory as the last take's: what was read into it before is overwritten)."""
        if nbytes > self._memory.size:
            self._memory = new_host_memory(max(nbytes, 2 * self._memory.size))
        return self._memory.data[:nbytes]


def new_host_memory(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] of new host memory, page-aligned, its pages faulted in at once where the system can (Linux's
    MAP_POPULATE): touching new pages one by one, as the first writes to them do, takes several times as long (5x
    measured on a 2-core VM: 8 MiB in 13-16 ms against 2.7-3.2 ms)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=flags), dtype=np.uint8, count=nbytes)


def read_file(path: Path) -> tuple[bytearray, FileStamp]:
    """The file's bytes and its stamp, read once with ordinary reads. AdapterError (naming the file, not its
    directory) if it cannot be read, or if it changed while it was read: its stamp moved between the read's start
    and end, or the bytes read are not its size."""
    return _read(path, bytearray)


def read_file_into(path: Path, into: ReadBuffer) -> tuple[memoryview, FileStamp]:
    """read_file into ``into``'s memory (valid until its next take)."""
    return _read(path, into.take)


def _read(path: Path, memory: Callable[[int], _Memory]) -> tuple[_Memory, FileStamp]:
    """The file read into ``memory(its size)``, and its stamp (read_file's checks)."""
    try:
        with path.open("rb", buffering=0) as file:
            before = os.fstat(file.fileno())
            data = memory(before.st_size)
            got = file.readinto(data) if before.st_size else 0
            extra = file.read(1)  # a file grown since the stat
            after = os.fstat(file.fileno())
    except OSError as exc:
        raise AdapterError(f"{path} cannot be read: {exc}", f"{path.name} cannot be read: {exc.strerror}") from exc
    stamp = FileStamp.of(after)
    if FileStamp.of(before) != stamp or got != after.st_size or extra:
        raise AdapterError(
            f"{path.name} changed while it was read ({path}): write adapter files elsewhere and move them into "
            "place, then register again",
            f"{path.name} changed while it was read; retry once it is written",
        )
    return data, stamp


def read_files(paths: tuple[Path, ...]) -> tuple[list[bytearray], FilesIdentity]:
    """Each file's bytes (read_file), in order, and their identity."""
    start = time.time_ns()
    read = [read_file(path) for path in paths]
    return [data for data, _ in read], FilesIdentity(tuple(stamp for _, stamp in read), start)


def stamp_files(paths: tuple[Path, ...]) -> FilesIdentity:
    """The files' identity now, without reading them (OSError if one is gone)."""
    start = time.time_ns()
    return FilesIdentity(tuple(FileStamp.of(os.stat(path)) for path in paths), start)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file: its dtype, shape and bytes [start, end) within the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """A safetensors file's bytes (``data``, kept: the views share them), its header checked: every tensor's dtype
    known, its shape non-negative integers, its bytes inside the data section, of the size its shape and dtype
    make, and overlapping no other tensor's. AdapterError naming the file's problem otherwise."""

    def __init__(self, data: bytearray | memoryview, what: str = "adapter_model.safetensors") -> None:
        self.data = data
        self.tensors: dict[str, TensorInfo] = {}
        if len(data) < 8:
            raise AdapterError(f"{what} cannot be read: {len(data)} bytes is shorter than a safetensors header")
        header_len = int.from_bytes(data[:8], "little")
        if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
            raise AdapterError(f"{what} cannot be read: its header length {header_len} is beyond the file")
        try:
            header = json.loads(bytes(data[8 : 8 + header_len]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise AdapterError(f"{what} cannot be read: its header is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise AdapterError(f"{what} cannot be read: its header is not a JSON object")
        self.data_start = 8 + header_len
        size = len(data) - self.data_start
        for name, entry in header.items():
            if name == "__metadata__":
                if not isinstance(entry, dict):
                    raise AdapterError(f"{what} cannot be read: __metadata__ is not an object")
                continue
            self.tensors[name] = _tensor_info(name, entry, size, what)
        ranges = sorted((t.start, t.end, n) for n, t in self.tensors.items() if t.end > t.start)
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:], strict=False):
            if start < end:
                raise AdapterError(f"{what} cannot be read: the bytes of tensors {first} and {second} overlap")

    def view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the file's bytes (copied only when its offset does not suit its dtype)."""
        info = self.tensors[name]
        count = math.prod(info.shape)
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        offset = self.data_start + info.start
        if offset % info.dtype.itemsize:  # a header whose length is not padded: copy into aligned memory
            raw = torch.frombuffer(self.data, dtype=torch.uint8, count=info.end - info.start, offset=offset)
            return raw.clone().view(info.dtype).reshape(info.shape)
        return torch.frombuffer(self.data, dtype=info.dtype, count=count, offset=offset).reshape(info.shape)

    def views(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, as views (``view``)."""
        return {name: self.view(name) for name in self.tensors}

    def raw(self, name: str) -> memoryview:
        """Tensor ``name``'s bytes as they are in the file (for hashing)."""
        info = self.tensors[name]
        return memoryview(self.data)[self.data_start + info.start : self.data_start + info.end]


def _tensor_info(name: str, entry: object, size: int, what: str) -> TensorInfo:
    bad = f"{what} cannot be read: tensor {name}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError(f"{bad} is not described by dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise AdapterError(f"{bad} has dtype {dtype!r}, which this server does not read")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise AdapterError(f"{bad} has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise AdapterError(f"{bad} has data_offsets {offsets!r}, not two integers")
    start, end = offsets
    if not 0 <= start <= end <= size:
        raise AdapterError(f"{bad} lies at bytes [{start}, {end}), outside the file's {size} bytes of data")
    torch_dtype = DTYPES[dtype]
    if end - start != math.prod(shape) * torch_dtype.itemsize:
        raise AdapterError(f"{bad}: {end - start} bytes do not hold shape {shape} of {dtype}")
    return TensorInfo(torch_dtype, tuple(shape), start, end)
