"""The engine: requests in, token streams out. ``Engine`` is its public surface (see engine.py)."""

from lora_server.engine.admission import Prompt
from lora_server.engine.engine import Engine
from lora_server.engine.reports import EngineSnapshot, ModelInfo
from lora_server.engine.request import TenantShare

__all__ = ["Engine", "EngineSnapshot", "ModelInfo", "Prompt", "TenantShare"]
