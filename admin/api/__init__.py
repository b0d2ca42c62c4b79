"""The admin API: the HTTP router for adapters, tenants and pool figures (``router``), and ``ApiError``, the one
error type of the HTTP edge in OpenAI's error shape (``errors``). It reaches the registry store through
``lora_server.admin.store`` and the serving side through ``AdapterControl`` and the values it returns
(``control``); it does not import the engine.

Re-exported here: what the server imports to mount the router and to check the admin key.
"""

from lora_server.admin.api.control import AdapterControl
from lora_server.admin.api.errors import ApiError
from lora_server.admin.api.router import (
    admin_router,
    checked_name,
    presented_key,
    require_admin_key,
    tenant_json,
)

__all__ = [
    "AdapterControl",
    "ApiError",
    "admin_router",
    "checked_name",
    "presented_key",
    "require_admin_key",
    "tenant_json",
]
