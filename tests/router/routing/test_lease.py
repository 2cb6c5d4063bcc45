"""The fleet's lease: what an attempt's verdict does to the replica's circuit breaker and in-flight count,
and that the proxy sees replicas only through leases."""

from __future__ import annotations

import ast
import pathlib

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.routing.fleet import DEFAULT_POOL, Fleet
from router.routing.policies import HashRing
from router.routing.prepare import PreparedRequest
from router.routing.replicas import CircuitBreaker, ReplicaState
from router.states import CircuitState

A, B = "http://a:1", "http://b:1"


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _fleet(policy: str = "round-robin", failures: int = 2) -> tuple[Fleet, Clock]:
    cfg = RouterConfig(replicas=(A, B), policy=policy, breaker_failures=failures, breaker_open_s=5.0)
    clock = Clock()
    fleet = Fleet(cfg, RouterMetrics(cfg.policy), clock)
    for url in (A, B):  # as set_replicas would, without starting the background checks
        st = fleet.replicas[url] = ReplicaState(url, CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_s))
        st.ready = True
    fleet.members[DEFAULT_POOL] = [A, B]
    fleet.pool_of.update({A: DEFAULT_POOL, B: DEFAULT_POOL})
    fleet.rings[DEFAULT_POOL] = HashRing([A, B])
    return fleet, clock


def _prep(tokens: list[int] | None = None) -> PreparedRequest:
    return PreparedRequest(token_ids=tokens, cache_salt=None, session_key=None, stream=False)


def test_lease_dispatches_and_release_takes_it_back():
    fleet, _ = _fleet()
    lease = fleet.lease(_prep(list(range(40))))
    assert (lease.url, lease.reason, lease.predicted_cached_tokens) == (A, "round-robin", 0)
    st = fleet.replicas[A]
    assert st.inflight == 1
    assert st.view(100.0, 3.0).new_tokens == 40  # uncached prompt tokens on their way there
    v = st.view(100.0, 3.0)
    assert (v.pending, v.pending_tokens) == (1, 40)  # no token back yet: its prefill is still ahead there
    lease.first_token()
    v = st.view(100.0, 3.0)
    assert (v.pending, v.pending_tokens, v.inflight) == (0, 0, 1)
    lease.succeeded()
    lease.release()
    lease.release()  # idempotent
    assert st.inflight == 0
    # the next lease goes elsewhere (round-robin), and an excluded replica is never leased
    assert fleet.lease(_prep()).url == B
    assert fleet.lease(_prep(), {A}).url == B
    assert fleet.lease(_prep(), {A, B}) is None


def test_failures_open_the_circuit_and_success_closes_it():
    fleet, clock = _fleet(failures=2)
    st = fleet.replicas[A]
    for _ in range(2):
        lease = fleet.lease(_prep(), {B})
        lease.failed()
        lease.release()
    assert st.breaker.state(clock.now) is CircuitState.OPEN and st.inflight == 0
    assert fleet.lease(_prep(), {B}) is None  # A is not routable while open
    clock.now += 5.0
    assert st.breaker.state(clock.now) is CircuitState.HALF_OPEN
    probe = fleet.lease(_prep(), {B})
    assert probe.url == A and fleet.lease(_prep(), {B}) is None  # one probe at a time
    probe.succeeded()
    probe.release()
    assert st.breaker.state(clock.now) is CircuitState.CLOSED and st.breaker.failures == 0


def test_refusals_and_abandoned_attempts_are_no_verdict():
    fleet, clock = _fleet(failures=1)
    st = fleet.replicas[A]
    lease = fleet.lease(_prep(), {B})
    lease.refused()  # 429 / 503: a healthy replica that is full or draining
    lease.release()
    assert st.breaker.state(clock.now) is CircuitState.CLOSED and st.breaker.failures == 0
    lease = fleet.lease(_prep(), {B})
    lease.failed()
    lease.release()
    clock.now += 5.0
    for refuse in (True, False):  # a refused probe, or one whose client went away, frees the probe slot
        probe = fleet.lease(_prep(), {B})
        assert probe is not None and fleet.lease(_prep(), {B}) is None
        if refuse:
            probe.refused()
        probe.release()
        assert st.breaker.state(clock.now) is CircuitState.HALF_OPEN and st.inflight == 0
    lease = fleet.lease(_prep(), {B})
    lease.succeeded()
    lease.failed()  # the first verdict stands
    lease.release()
    assert st.breaker.state(clock.now) is CircuitState.CLOSED


def test_the_approx_index_learns_where_requests_went():
    fleet, _ = _fleet(policy="approx-prefix")
    fleet.lease(_prep(list(range(40))), {B}).release()
    assert fleet.predict_cached(_prep(list(range(40))), [A, B]) == {A: 32, B: 0}  # 2 full blocks of 16
    kv, _ = _fleet(policy="kv")  # kv: only for replicas without KV events (none known yet here)
    kv.lease(_prep(list(range(40))), {B}).release()
    assert kv.predict_cached(_prep(list(range(40))), [A, B]) == {}


def test_the_proxy_sees_replicas_only_through_leases():
    path = pathlib.Path(__file__).parents[3] / "router" / "http" / "proxy.py"
    tree = ast.parse(path.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"router.routing.replicas", "router.routing.fleet"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not (names | attrs) & {"ReplicaState", "CircuitBreaker", "breaker", "replicas", "fleet", "clock",
                                  "on_dispatch", "on_done", "record_routed"}
