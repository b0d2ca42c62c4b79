"""The registry store's errors (every backend raises these)."""

from __future__ import annotations


class TenantExistsError(Exception):
    """``create_tenant`` was given a name that is already taken."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} already exists")
        self.name = name


class UnknownTenantError(Exception):
    """``issue_key``, ``retire_key`` or ``set_share`` was given a tenant that does not exist (reads answer None
    instead)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} does not exist")
        self.name = name


class UnknownKeyError(Exception):
    """``retire_key`` was given a key id that the tenant does not hold."""

    def __init__(self, tenant: str, key_id: str) -> None:
        super().__init__(f"tenant {tenant!r} holds no key with id {key_id!r}")
        self.tenant, self.key_id = tenant, key_id


class StoreUnavailableError(Exception):
    """The store's backend cannot be reached or takes no writes now: Redis is down, hung or still loading, or refuses
    writes (a read-only replica, memory full, a failed snapshot, too few replicas), or the SQLite file is locked by
    another process for longer than the store's timeout, or cannot be opened. Raised by the stores' constructors and
    by every public method but ``status`` and ``close``. A write that raised it may or may not have taken effect. The
    store object stays usable: once the backend is back, calls succeed again."""
