"""The scheduler's waiting line: which waiting request is admitted next.

Fair sharing (the default) is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024): every tenant has a counter of the tokens the engine computed for it, divided by its weight,
and the next admission goes to the tenant with the lowest counter among those that wait and are under their cap
of running requests (ties: the earliest arrival). Tokens are what the tenants share: every step has one token
budget, a prefill chunk and a decode each take their tokens of it, so a tenant of long prompts pays for them and
a tenant of many short requests gets no more than its share (counting requests would let long ones take more).
The scheduler charges each step's tokens as it schedules them, so several admissions in one step alternate.

A tenant that starts waiting again has its counter lifted to the lowest counter of the tenants already waiting
(to the last admitted tenant's counter when none waits): being idle earns no credit, so a tenant that returns
shares fairly from then on instead of taking the engine over to catch up, and a tenant that floods the queue is
passed by every newcomer until their counters meet.

Within a tenant, requests wait by (priority, arrival), lower priority values first (vLLM's ``priority``); a
preempted request goes back to the front of its tenant's line. With fair sharing off the line is one FIFO as
before (arrival order, preempted requests at the front): tenants, weights, caps and priorities are ignored."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Container, Iterator, Mapping

from lora_server.engine.request import Request, TenantShare

# A waiting request's place in its tenant's line: (0, -n) for the n-th request put back at the front (the latest
# first), (1, priority, arrival number) for one that arrived.
_Place = tuple[int, ...]


class FairQueue:
    """Waiting requests by tenant. ``next`` chooses without removing; the scheduler ``admit``s what it takes in,
    ``remove``s what ends while waiting, and ``charge``s every token it schedules. Iteration yields every waiting
    request, tenant by tenant (lowest counter first), each tenant's in its line's order."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._lines: dict[str, list[tuple[_Place, Request]]] = {}  # tenant -> its waiting requests, in order
        self._places: dict[Request, _Place] = {}
        self._shares: dict[str, TenantShare] = {}  # each tenant's weight and cap, as its latest request carried
        self.counters: dict[str, float] = {}  # tenant -> tokens computed for it / its weight (virtual time)
        self._last_admitted = 0.0  # the counter of the tenant admitted last: where a tenant that returns starts
        self._arrivals = itertools.count()
        self._fronts = itertools.count(1)

    def __len__(self) -> int:
        return len(self._places)

    def __bool__(self) -> bool:
        return bool(self._places)

    def __contains__(self, request: object) -> bool:
        return request in self._places

    def __iter__(self) -> Iterator[Request]:
        for tenant in sorted(self._lines, key=lambda t: (self.counters.get(t, 0.0), t)):
            yield from (r for _, r in self._lines[tenant])

    def _tenant(self, request: Request) -> str:
        return request.tenant.name if self.fair else ""

    def push(self, request: Request) -> None:
        """A request arrives: it waits behind its tenant's requests of the same or a lower priority value."""
        priority = request.priority if self.fair else 0
        self._insert(request, (1, priority, next(self._arrivals)))

    def push_front(self, request: Request) -> None:
        """A preempted request: first in its tenant's line (ahead of those put back before it)."""
        self._insert(request, (0, -next(self._fronts)))

    def _insert(self, request: Request, place: _Place) -> None:
        if request in self._places:
            raise ValueError(f"request {request.request_id!r} is waiting already")
        tenant = self._tenant(request)
        line = self._lines.get(tenant)
        if not line:
            self._start_waiting(tenant)
            line = self._lines[tenant] = []
        self._shares[tenant] = request.tenant
        bisect.insort(line, (place, request), key=lambda entry: entry[0])
        self._places[request] = place

    def _start_waiting(self, tenant: str) -> None:
        """Lift a tenant that was not waiting to the others' counters: no credit for the time it was idle."""
        waiting = [self.counters.get(t, 0.0) for t, line in self._lines.items() if line]
        floor = min(waiting) if waiting else self._last_admitted
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def remove(self, request: Request) -> None:
        """Take a request out of the line (admitted, aborted or finished); KeyError if it does not wait."""
        place = self._places.pop(request)
        tenant = self._tenant(request)
        line = self._lines[tenant]
        del line[bisect.bisect_left(line, place, key=lambda entry: entry[0])]
        if not line:
            del self._lines[tenant]

    def next(self, running: Mapping[str, int], passed: Container[Request] = ()) -> Request | None:
        """The request to admit next, or None when every waiting tenant is at its cap (``running``: tenant ->
        its running requests). Requests in ``passed`` are stepped over (the scheduler cannot take them now); the
        request returned stays in the line until ``remove``."""
        best: tuple[float, float, str] | None = None
        firsts: dict[str, Request] = {}
        for tenant, line in self._lines.items():
            cap = self._shares[tenant].max_running if self.fair else 0
            if cap and running.get(tenant, 0) >= cap:
                continue
            first = next((r for _, r in line if r not in passed), None)
            if first is None:
                continue
            firsts[tenant] = first
            key = (self.counters.get(tenant, 0.0), first.arrival_time, tenant)
            if best is None or key < best:
                best = key
        return None if best is None else firsts[best[2]]

    def admit(self, request: Request) -> None:
        """Take the request out of the line to run it (it was ``next``)."""
        self.remove(request)
        self._last_admitted = max(self._last_admitted, self.counters.get(self._tenant(request), 0.0))

    def charge(self, request: Request, num_tokens: int) -> None:
        """Count ``num_tokens`` computed for the request's tenant (negative: give back tokens charged for work
        that was dropped, a preempted request's step)."""
        if self.fair:
            tenant = request.tenant.name
            self.counters[tenant] = self.counters.get(tenant, 0.0) + num_tokens / request.tenant.weight
