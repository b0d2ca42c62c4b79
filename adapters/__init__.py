"""PEFT LoRA adapters: reading, validation and conversion to the kernel layout, and the shipped demo adapters."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_NAMES = ("emoji", "pirate", "upper")  # trained by adapters/demo/train.py; adapters/demo/README.md says how


def demo_adapters() -> dict[str, Path]:
    """The demo adapters shipped with the package: name -> directory. Only these names: a folder someone drops under
    adapters/demo is not served by surprise."""
    return {name: DEMO_DIR / name for name in DEMO_NAMES if (DEMO_DIR / name / "adapter_config.json").is_file()}
