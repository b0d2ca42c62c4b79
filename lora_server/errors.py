"""Typed errors the engine raises; the HTTP layer maps each to an OpenAI-shaped error response."""

from __future__ import annotations


class LoraServerError(Exception):
    """Base of every error this package raises on purpose."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(LoraServerError, ValueError):
    """The request itself is wrong (HTTP 400); nothing was changed."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens do not fit the model's context (HTTP 400, code context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class QueueFullError(LoraServerError):
    """The waiting queue is at its bound (HTTP 429 with Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"


class EngineDeadError(LoraServerError):
    """The engine stopped after a fault it cannot recover from, such as a device error (HTTP 503); the server
    process exits so that its supervisor restarts it."""

    http_status = 503
    error_type = "service_unavailable"


class RequestFailedError(LoraServerError):
    """Serving one request raised (in its sampling, logprobs, detokenizing, stop handling or its adapter's
    arithmetic): that request alone ended, its blocks were freed, the rest of the batch goes on (HTTP 500)."""

    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_failed")


class AdapterUnavailableError(InvalidRequestError):
    """The request's adapter is registered but cannot be served now: its files changed, went or were truncated
    since it was registered (HTTP 400, param ``model``). The message names the adapter, never its path; nothing
    ran, and a later request of the adapter reads its files again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="adapter_unavailable")


class ModelLoadError(LoraServerError, ValueError):
    """A model file or directory cannot be loaded (wrong format, unsupported architecture, missing tensors)."""


class ConfigError(LoraServerError, ValueError):
    """A flag or setting is out of its range or contradicts another (the command line says which; nothing ran)."""


class UnknownAdapterError(InvalidRequestError):
    """A request or an admin call named an adapter (a model) that is not registered."""

    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", param="model", code="model_not_found")


class TensorParallelError(LoraServerError, RuntimeError):
    """A tensor-parallel rank died, or the ranks fell out of step: the engine cannot go on (it stops as on a device
    fault); the message names the rank where it is known."""
