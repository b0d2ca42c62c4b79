"""The connection layer under the app: deadlines and a connection cap that uvicorn lacks.

uvicorn (0.54, h11) bounds an idle keep-alive connection (``timeout_keep_alive``, 5 s) and the size of a request
head, but not how long a head or a body may take to arrive: a client that trickles a head a byte at a time, or
opens a connection and sends nothing, holds a socket for ever. Its ``limit_concurrency`` answers 503 beyond a count
of requests but still accepts every socket, so a flood of silent connections uses up the descriptors and /health
itself can no longer connect. ``GuardedH11Protocol`` closes a connection whose request head has not arrived
``head_timeout`` seconds after the connection opened (or after its previous response ended), whose body has not
arrived ``body_timeout`` seconds after its head, and a new connection beyond ``max_connections``;
``raise_descriptor_limit`` lifts the process's soft descriptor limit to the hard one, and ``connection_cap`` keeps
the cap below it (the model, the registry and the logs need descriptors too)."""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("lora_server")
RESERVED_DESCRIPTORS = 256  # kept for files, the registry store, pipes and threads beside the connections
MAX_DESCRIPTORS = 1 << 20  # the soft limit asked for when the hard one is unlimited


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_DESCRIPTORS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("the descriptor limit stays at %d: %s", soft, exc)
    return MAX_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


def connection_cap(asked: int | None, descriptors: int) -> int:
    """The most open connections: ``asked`` (--max-connections), never closer than RESERVED_DESCRIPTORS to the
    descriptor limit."""
    ceiling = max(1, descriptors - RESERVED_DESCRIPTORS)
    return ceiling if asked is None else min(asked, ceiling)


def guarded_protocol(head_timeout: float, body_timeout: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for uvicorn's ``http`` setting, with these bounds."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"head_timeout": head_timeout, "body_timeout": body_timeout, "max_connections": max_connections},
    )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and body, and a cap on connections (a
    connection beyond it is closed as soon as it is accepted, before it holds anything). Contract: at most one
    deadline is armed per connection; it is the head's while no request is being read, the body's while one is."""

    head_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 1 << 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.close()  # connection_lost forgets it
            return
        self._arm(self.head_timeout, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        reading = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return  # no request, or answered already (on_response_complete armed the next head's deadline)
        if not cycle.more_body:
            self._disarm()  # its body is whole: the app has it
        elif cycle is not reading:
            self._arm(self.body_timeout, self._body_late)  # a new request's head arrived, its body has not

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.head_timeout, self._head_late)  # the next request's head, on a kept-alive connection

    def _arm(self, seconds: float, late: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def _body_late(self) -> None:
        self._deadline = None
        if self.cycle is not None and self.cycle.more_body and not self.cycle.response_complete:
            self.transport.close()  # the app reads a disconnect
