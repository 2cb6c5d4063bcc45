"""Fair queuing across tenants when a pool is full: the Virtual Token Counter (VTC) of "Fairness in Serving
Large Language Models" (Sheng et al., OSDI 2024). Pure: no I/O, no clock (times are passed in).

Each tenant has a counter of the service it received, in weighted tokens: `prompt_weight x prompt tokens +
output_weight x output tokens`, divided by the tenant's weight (a tenant of weight 3 is charged a third, so it
gets three times the service). `charge` adds a request's prompt when it is dispatched and its output when it
ends. The next request to dispatch is the oldest best-priority one (the request's `priority`, lower first, then
arrival) of the backlogged tenant with the smallest counter (ties: the tenant whose head arrived first).

A tenant that becomes backlogged (its first queued request) has its counter lifted to at least the smallest
counter among the backlogged tenants (or, with none, the counter of the tenant dispatched last): service it did
not ask for while idle is not banked. So between two tenants backlogged over an interval, the service they
receive differs by at most 2 x U, U the largest weighted cost of one request (the paper's Theorem 4.4; checked
in tests/router/admission/test_fair_queue.py).

Bounded: at most `max_per_tenant` queued requests per tenant and `max_total` in all (`push` refuses past
them); `expired(now)` takes out those queued longer than `timeout_s`; `remove` takes out a cancelled one.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FairQueueConfig:
    prompt_weight: float = 1.0
    output_weight: float = 2.0  # the paper's choice: an output token costs about two prompt tokens
    max_per_tenant: int = 256
    max_total: int = 1024
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.prompt_weight >= 0 and self.output_weight >= 0 and self.prompt_weight + self.output_weight > 0):
            raise ValueError("prompt_weight and output_weight must be >= 0, not both 0")
        if self.max_per_tenant < 1 or self.max_total < 1 or not self.timeout_s > 0:
            raise ValueError("max_per_tenant and max_total must be >= 1 and timeout_s > 0")


_order = itertools.count()


@dataclass(eq=False)
class Queued:
    """One waiting request: whose, its priority (lower first), when it arrived, what it will be charged first."""

    tenant: str
    arrived: float
    priority: int = 0
    prompt_tokens: int = 0
    key: Hashable = None  # the caller's handle (e.g. a future)
    seq: int = field(default_factory=lambda: next(_order))

    def rank(self) -> tuple[int, float, int]:
        return self.priority, self.arrived, self.seq


class FairQueue:
    def __init__(self, cfg: FairQueueConfig | None = None):
        self.cfg = cfg or FairQueueConfig()
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.queues: dict[str, list[Queued]] = {}  # backlogged tenants only, each queue kept in rank order
        self.last_dispatched: str | None = None

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def depth(self, tenant: str) -> int:
        return len(self.queues.get(tenant, ()))

    def set_weight(self, tenant: str, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant {tenant}: weight must be > 0, got {weight}")
        self.weights[tenant] = weight

    def cost(self, tenant: str, prompt_tokens: int, output_tokens: int) -> float:
        c = self.cfg
        return (c.prompt_weight * prompt_tokens + c.output_weight * output_tokens) / self.weights.get(tenant, 1.0)

    # -- queue ---------------------------------------------------------------------------------------------
    def push(self, item: Queued) -> str | None:
        """Queue `item`; None, or why it is refused ("tenant" or "total": a depth limit)."""
        if self.depth(item.tenant) >= self.cfg.max_per_tenant:
            return "tenant"
        if len(self) >= self.cfg.max_total:
            return "total"
        queue = self.queues.get(item.tenant)
        if queue is None:  # newly backlogged: no credit for the time it was idle
            floor = min((self.counters.get(t, 0.0) for t in self.queues), default=None)
            if floor is None and self.last_dispatched is not None:
                floor = self.counters.get(self.last_dispatched, 0.0)
            self.counters[item.tenant] = max(self.counters.get(item.tenant, 0.0), floor or 0.0)
            queue = self.queues[item.tenant] = []
        queue.append(item)
        queue.sort(key=Queued.rank)
        return None

    def peek(self) -> Queued | None:
        """The request `pop` would return."""
        if not self.queues:
            return None
        tenant = min(self.queues, key=lambda t: (self.counters.get(t, 0.0), self.queues[t][0].arrived))
        return self.queues[tenant][0]

    def pop(self) -> Queued | None:
        """Dispatch the next request (see the module docstring) and charge its prompt."""
        item = self.peek()
        if item is None:
            return None
        self._take(item)
        self.last_dispatched = item.tenant
        self.charge(item.tenant, item.prompt_tokens, 0)
        return item

    def remove(self, item: Queued) -> bool:
        """Take out a queued request that will not be dispatched (cancelled); False if it is not queued."""
        queue = self.queues.get(item.tenant)
        if queue is None or item not in queue:
            return False
        self._take(item)
        return True

    def expired(self, now: float) -> list[Queued]:
        """Take out and return the requests queued longer than timeout_s."""
        out = [x for q in self.queues.values() for x in q if now - x.arrived > self.cfg.timeout_s]
        for x in out:
            self._take(x)
        return out

    def _take(self, item: Queued) -> None:
        queue = self.queues[item.tenant]
        queue.remove(item)
        if not queue:
            del self.queues[item.tenant]

    # -- service -------------------------------------------------------------------------------------------
    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Add service received: a dispatched request's prompt, an ended one's output."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + self.cost(tenant, prompt_tokens, output_tokens)
