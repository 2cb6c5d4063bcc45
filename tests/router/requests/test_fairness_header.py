"""The router names the request's tenant to the engines in llm-d's fairness header (contract/fairness.py), and
the latency targets a request took from its tenant or pool in llm-d's SLO headers (contract/slo.py)."""

from __future__ import annotations

from types import SimpleNamespace

from contract.fairness import FAIRNESS_HEADER
from router.requests.flow import Flow
from router.tenants.registry import Tenant

H = FAIRNESS_HEADER.encode()


RID = (b"x-request-id", b"req_1")


def entry(tenant: str | None, ttft_s: float | None = None, tpot_s: float | None = None):
    return SimpleNamespace(tenant=None if tenant is None else Tenant(tenant, frozenset(), 1000), request_id="req_1",
                           prep=SimpleNamespace(ttft_target_s=ttft_s, tpot_target_s=tpot_s))


def test_the_tenants_name_goes_upstream_and_a_clients_own_value_is_dropped():
    headers = [(b"content-type", b"application/json"), (b"X-LLM-D-Inference-Fairness-Id", b"someone-else")]
    assert Flow.upstream_headers(entry("team-a"), headers) == [(b"content-type", b"application/json"), RID,
                                                                (H, b"team-a")]
    assert Flow.upstream_headers(entry("team-b"), [])[-1] == (H, b"team-b")


def test_without_tenants_the_clients_or_gateways_value_goes_as_sent():
    headers = [(H, b"gw-tenant"), (b"accept", b"*/*")]
    assert Flow.upstream_headers(entry(None), headers) == [*headers, RID]
    assert Flow.upstream_headers(entry(None), []) == [RID]


def test_the_routers_own_request_id_goes_upstream_never_a_clients():
    headers = [(b"X-Request-Id", b"client-chosen"), (b"accept", b"*/*")]
    for tenant in (None, "team-a"):
        out = Flow.upstream_headers(entry(tenant), headers)
        assert [v for k, v in out if k.lower() == b"x-request-id"] == [b"req_1"]


def test_targets_from_the_tenant_or_pool_go_upstream_as_headers_and_a_clients_own_go_as_sent():
    assert Flow.upstream_headers(entry(None, 0.5, 0.08), []) == [RID, (b"x-llm-d-slo-ttft-ms", b"500"),
                                                                 (b"x-llm-d-slo-tpot-ms", b"80")]
    own = [(b"X-LLM-D-SLO-TPOT-MS", b"40")]  # the client's target (the one the request carries) goes as sent
    assert Flow.upstream_headers(entry(None, None, 0.04), own) == [*own, RID]
    assert Flow.upstream_headers(entry(None, 0.25), []) == [RID, (b"x-llm-d-slo-ttft-ms", b"250")]
