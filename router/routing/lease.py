"""A lease on one replica for one attempt of one request: what the fleet hands the proxy instead of its
internals. The proxy reports how the attempt went; the lease updates the replica's in-flight bookkeeping and
circuit breaker.

    lease = fleet.lease(prep, tried)        # None: no routable replica left
    try:
        ... send to lease.url; lease.first_token() when a stream's first token comes back ...
        ... then one of lease.succeeded(output_tokens) / failed() / refused() ...
    finally:
        lease.release()                     # always; without a verdict the attempt was abandoned
"""

from __future__ import annotations

from collections.abc import Callable

from router.routing.policies import Decision, Reason
from router.routing.replicas import ReplicaState, Ticket
from router.states import StrEnum


class Verdict(StrEnum):
    SUCCEEDED = "succeeded"  # the replica answered (any status it is responsible for, incl. 4xx)
    FAILED = "failed"  # connection or upstream error, 502/504, or a stream that broke
    REFUSED = "refused"  # a healthy replica that said "not now" (503 draining, 429 queue full): retry elsewhere


class Lease:
    __slots__ = ("decision", "verdict", "_state", "_ticket", "_clock", "_released", "_on_first_token", "_on_decoded")

    def __init__(self, decision: Decision, state: ReplicaState, ticket: Ticket, clock: Callable[[], float],
                 on_first_token: Callable[[Ticket], None] | None = None,
                 on_decoded: Callable[[Ticket, int], None] | None = None):
        self.decision = decision
        self.verdict: Verdict | None = None
        self._state, self._ticket, self._clock = state, ticket, clock
        self._released = False
        self._on_first_token = on_first_token  # the placement core's (it learns TTFT from it); else the state's
        self._on_decoded = on_decoded  # the placement core's: it learns TPOT from a stream that ended

    @property
    def url(self) -> str:
        return self.decision.url

    @property
    def predicted_cached_tokens(self) -> int:
        return self.decision.predicted_cached_tokens

    @property
    def reason(self) -> Reason:
        return self.decision.reason

    def first_token(self) -> None:
        """The replica streamed the request's first token: its prefill is no longer queued there."""
        if self._on_first_token is not None:
            self._on_first_token(self._ticket)
        else:
            self._state.on_first_token(self._ticket)

    def succeeded(self, output_tokens: int = 0) -> None:
        """The replica answered. `output_tokens`: what a stream that ended here generated (its usage), from which
        the time per output token is learned (0: unknown, or not a stream)."""
        first = self.verdict is None
        self._settle(Verdict.SUCCEEDED)
        if first and output_tokens > 1 and self._on_decoded is not None:
            self._on_decoded(self._ticket, output_tokens)

    def failed(self) -> None:
        self._settle(Verdict.FAILED)

    def refused(self) -> None:
        self._settle(Verdict.REFUSED)

    def release(self) -> None:
        """The attempt is over: it leaves the replica's in-flight work. Idempotent."""
        if self._released:
            return
        self._released = True
        self._state.on_done(self._ticket)
        if self.verdict is None or self.verdict is Verdict.REFUSED:
            self._state.breaker.on_abandoned()  # no verdict on the replica's health: free a probe slot

    def _settle(self, verdict: Verdict) -> None:
        if self.verdict is not None:
            return
        self.verdict = verdict
        breaker = self._state.breaker
        if verdict is Verdict.SUCCEEDED:
            breaker.on_success()
        elif verdict is Verdict.FAILED:
            breaker.on_failure(self._clock())
