"""Every environment variable the package reads, read here and only when asked."""

from __future__ import annotations

import os
from pathlib import Path


def admin_key() -> str | None:
    """LORA_SERVER_ADMIN_KEY: the admin API key when --admin-key is not given."""
    return os.environ.get("LORA_SERVER_ADMIN_KEY") or None


def data_dir() -> tuple[str, str]:
    """Where the embedded registry (SQLite) lives, and where that choice came from: LORA_SERVER_DATA_DIR, else the
    user's data directory ($XDG_DATA_HOME/lora-server, by default ~/.local/share/lora-server)."""
    chosen = os.environ.get("LORA_SERVER_DATA_DIR")
    if chosen:
        return chosen, "$LORA_SERVER_DATA_DIR"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "lora-server"), "the user's data directory (XDG)"


def adapter_cache_dir() -> str:
    """Where adapters downloaded from a source are kept when --adapter-cache-dir is not given: the user's cache
    directory ($XDG_CACHE_HOME/lora-server/adapters, by default ~/.cache/lora-server/adapters)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lora-server" / "adapters")


def hf_endpoint() -> str | None:
    """HF_ENDPOINT, read when asked (huggingface_hub reads it once, at its import): the Hub to download from."""
    return os.environ.get("HF_ENDPOINT") or None


def kernel_cache_dir() -> str:
    """Where the CPU kernels built on first use are kept (kernels.cpu_decode): $XDG_CACHE_HOME/lora-server/kernels,
    by default ~/.cache/lora-server/kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lora-server" / "kernels")


def cpu_kernels_enabled() -> bool:
    """LORA_SERVER_CPU_KERNELS=0 keeps the CPU decode step on torch's kernels (else kernels.cpu_decode is built)."""
    return os.environ.get("LORA_SERVER_CPU_KERNELS", "1") != "0"


def fused_decode_enabled() -> bool:
    """LORA_SERVER_FUSED_DECODE=0 keeps each decoder layer's CPU decode calls one by one (model.fused_decode makes
    them one C call a layer, with the same numbers: the switch is for comparing the two)."""
    return os.environ.get("LORA_SERVER_FUSED_DECODE", "1") != "0"
