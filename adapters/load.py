"""One entry point for reading an adapter from local disk, whatever its format: a PEFT directory
(adapters.peft_format) or a llama.cpp GGUF LoRA file (adapters.gguf_lora, a path ending in .gguf). Every refusal is
an AdapterError; the result is a validated LoraAdapter either way."""

from __future__ import annotations

from pathlib import Path

from lora_server.adapters.peft_format import BaseShapes, LoraAdapter, load_peft_adapter


def load_adapter(
    name: str, path: str | Path, base: BaseShapes, max_rank: int, allowed_roots: list[Path] | None = None
) -> LoraAdapter:
    """The adapter at ``path`` (load_peft_adapter's contract: ``allowed_roots`` None allows any path)."""
    if str(path).endswith(".gguf"):
        from lora_server.adapters.gguf_lora import load_gguf_adapter

        return load_gguf_adapter(name, path, base, max_rank, allowed_roots)
    return load_peft_adapter(name, path, base, max_rank, allowed_roots)
