"""One entry point for reading an adapter from local disk, whatever its format: a PEFT directory
(adapters.peft_format) or a llama.cpp GGUF LoRA file (adapters.gguf_lora, a path ending in .gguf). Every refusal is
an AdapterError."""

from __future__ import annotations

from pathlib import Path

from lora_server.adapters.lora_types import BaseShapes, LoraAdapter, content_hash
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.adapters.peft_files import ReadBuffer
from lora_server.adapters.peft_format import read_peft_adapter


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def read_adapter(
    name: str,
    path: str | Path,
    base: BaseShapes,
    max_rank: int,
    allowed_roots: list[Path] | None = None,
    read_buffer: ReadBuffer | None = None,
) -> PeftAdapter | LoraAdapter:
    """The adapter at ``path``, validated but for its weights' values where they stay as stored (a PEFT directory:
    a PeftAdapter, see check_weights, its weights in ``read_buffer`` when given: read_peft_adapter); a GGUF file is
    read whole into a LoraAdapter (``allowed_roots`` None allows any path)."""
    if is_gguf(path):
        from lora_server.adapters.gguf_lora import load_gguf_adapter

        return load_gguf_adapter(name, path, base, max_rank, allowed_roots)
    return read_peft_adapter(name, path, base, max_rank, allowed_roots, read_buffer)


def load_adapter(
    name: str, path: str | Path, base: BaseShapes, max_rank: int, allowed_roots: list[Path] | None = None
) -> LoraAdapter:
    """The adapter at ``path``, validated, as a float32 LoraAdapter."""
    adapter = read_adapter(name, path, base, max_rank, allowed_roots)
    if isinstance(adapter, PeftAdapter):
        adapter.check_weights()
        return adapter.lora()
    return adapter


def adapter_digest(adapter: PeftAdapter | LoraAdapter) -> str:
    """The key of what an adapter serves (equal keys, equal outputs): a PEFT adapter's stored weights and scalings
    (PeftAdapter.digest), a GGUF adapter's float32 weights (content_hash)."""
    return adapter.digest() if isinstance(adapter, PeftAdapter) else content_hash(adapter)
