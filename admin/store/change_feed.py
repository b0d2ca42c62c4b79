"""The registry's change feed: tells a server process, within a fraction of a second, that the registry store it
shares with other processes has changed (an adapter or a tenant: see ``RegistryStore.revision``).

A feed is a wake-up call, not a log: it says that the store's revision moved, and the listener reads the store for
what is true now (``lora_server.server.registry_sync``). A wake-up lost to a dropped connection costs only time: a
feed compares revisions itself when it (re)connects and whenever a wait times out.

- ``RedisFeed``: the store publishes each new revision on its channel in the transaction of the write (pub/sub);
  a change made by any replica wakes the others within milliseconds.
- ``PollingFeed``: reads the revision every ``POLL_S`` seconds (SQLite: several processes may share one data
  directory, and SQLite has no notifications across processes).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from lora_server.admin.store.base import RegistryStore
from lora_server.admin.store.errors import StoreUnavailableError

if TYPE_CHECKING:  # the redis package is needed only with a Redis store
    import redis

    from lora_server.admin.store.redis import RedisStore

POLL_S = 0.1  # PollingFeed: how often the revision is read


class ChangeFeed(ABC):
    """Waits for the revision of one registry store to move. One thread waits at a time; ``close`` may be called
    from another thread, and makes a wait under way return within about ``POLL_S``."""

    @abstractmethod
    def wait(self, seen: int, timeout: float) -> int:
        """Block until the store's revision differs from ``seen``, or for ``timeout`` seconds; returns the store's
        revision as last heard (``seen`` itself when nothing changed). Raises StoreUnavailableError when the
        backend cannot be reached (the next call tries again)."""

    @abstractmethod
    def close(self) -> None:
        """Release the feed's connection; calling it again does nothing."""


class PollingFeed(ChangeFeed):
    """Any store: reads ``store.revision()`` every ``poll_s`` seconds (one small query)."""

    def __init__(self, store: RegistryStore, poll_s: float = POLL_S) -> None:
        self.store, self.poll_s = store, poll_s
        self._closed = threading.Event()

    def wait(self, seen: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            revision = self.store.revision()
            left = deadline - time.monotonic()
            if revision != seen or left <= 0 or self._closed.wait(min(self.poll_s, left)):
                return revision

    def close(self) -> None:
        self._closed.set()


class RedisFeed(ChangeFeed):
    """A Redis store's announcements (``RedisStore.changes_channel``), heard on a subscriber connection of its
    own, opened on the first wait and again after a failure."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._pubsub: redis.client.PubSub | None = None
        self._lock = threading.Lock()  # held by a wait; close takes it to release the connection
        self._closed = threading.Event()

    def wait(self, seen: int, timeout: float) -> int:
        from lora_server.admin.store.redis import UNREACHABLE_ERRORS

        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                return self._wait(seen, deadline)
            except (StoreUnavailableError, *UNREACHABLE_ERRORS) as exc:
                self._drop()  # the next wait subscribes again, then compares revisions
                if isinstance(exc, StoreUnavailableError):
                    raise
                raise StoreUnavailableError(
                    f"the registry's change feed (redis at {self.store.address}) failed: {exc}"
                ) from exc

    def _wait(self, seen: int, deadline: float) -> int:
        if self._pubsub is None:
            if self._closed.is_set():
                return seen
            self._pubsub = self.store.pubsub()
            self._pubsub.subscribe(self.store.changes_channel)
            revision = self.store.revision()  # read after subscribing: no change falls between the two
            if revision != seen:
                return revision
        while not self._closed.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return self.store.revision()  # nothing heard for the whole wait: make sure nothing was missed
            message = self._pubsub.get_message(timeout=min(POLL_S, left))
            if message is not None and message["type"] == "message" and int(message["data"]) != seen:
                return int(message["data"])
        return seen

    def _drop(self) -> None:
        if self._pubsub is not None:
            self._pubsub.close()
            self._pubsub = None

    def close(self) -> None:
        self._closed.set()
        with self._lock:  # a wait under way returns within POLL_S
            self._drop()


def open_feed(store: RegistryStore) -> ChangeFeed:
    """The feed for ``store``: Redis pub/sub for a Redis store, polling for any other."""
    from lora_server.admin.store.sqlite import SQLiteStore

    if isinstance(store, SQLiteStore):
        return PollingFeed(store)
    from lora_server.admin.store.redis import RedisStore  # the redis package is needed only for a Redis store

    return RedisFeed(store) if isinstance(store, RedisStore) else PollingFeed(store)
