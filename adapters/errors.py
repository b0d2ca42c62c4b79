"""AdapterError: why an adapter cannot be served, for the operator and for callers without the admin key."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be served, and why. ``str()`` is the whole reason, filesystem paths included (for the
    operator: logs, the admin API); ``public`` is the same reason without any path (for callers without the admin
    key: on-demand loads, requests whose adapter cannot be staged)."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = message if public is None else public
