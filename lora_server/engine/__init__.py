"""The engine: requests in, token streams out. ``Engine`` is its public surface (see engine.py)."""

from lora_server.engine.engine import Engine, EngineSnapshot, ModelInfo, Prompt

__all__ = ["Engine", "EngineSnapshot", "ModelInfo", "Prompt"]
