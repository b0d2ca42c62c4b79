"""PEFT LoRA adapters: reading, validation and conversion to the kernel layout, and the shipped demo adapters."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"


def demo_adapters() -> dict[str, Path]:
    """The demo adapters shipped with the package (trained by adapters/train_demo.py): name -> directory."""
    if not DEMO_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(DEMO_DIR.iterdir()) if (p / "adapter_config.json").is_file()}
