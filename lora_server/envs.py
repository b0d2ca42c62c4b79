"""Every environment variable the package reads, read here and only when asked."""

from __future__ import annotations

import os


def admin_key() -> str | None:
    """LORA_SERVER_ADMIN_KEY: the admin API key when --admin-key is not given."""
    return os.environ.get("LORA_SERVER_ADMIN_KEY") or None


def data_dir() -> str:
    """LORA_SERVER_DATA_DIR: where the embedded registry (SQLite) lives; default ./lora-server-data."""
    return os.environ.get("LORA_SERVER_DATA_DIR", "lora-server-data")
