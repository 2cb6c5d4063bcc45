"""The admission stages alone, with exact expectations, and the pipeline as a table of requests and outcomes
(real RateLimiter over the in-process budget store, real RouterMetrics, real pool choice)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from contract.request import Endpoint, parse_request
from router.admission.pipeline import Admission, Admitted
from router.admission.shedding import Pressure
from router.admission.stages import (
    pool_caps,
    pressure,
    request_cost,
    shed,
    tenant_context,
    tenant_limits,
)
from router.config import RateLimitConfig, SheddingConfig
from router.metrics import RouterMetrics
from router.pools.choice import PoolSpec, choose_pool
from router.pools.models import catalog
from router.refusal import Refusal
from router.tenants.ratelimit import RateLimiter
from router.tenants.registry import Tenant, key_sha256

MSGS = [{"role": "user", "content": "hi"}]
CAPPED = PoolSpec("p", "v1", 1, max_tokens_cap=8)


def chat(**fields):
    return parse_request(Endpoint.CHAT, json.dumps({"messages": MSGS, **fields}).encode())


def upstream(req) -> dict:
    return json.loads(req.upstream_body())


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}, {"max_completion_tokens": None},
                                    {"max_completion_tokens": None, "max_tokens": 60}, {"max_tokens": 60},
                                    {"max_completion_tokens": 60}, {"max_completion_tokens": 60, "max_tokens": 5}])
def test_a_pool_cap_holds_for_every_spelling(fields):
    req, lowered = pool_caps(chat(**fields), CAPPED)
    assert lowered == 8 and req.max_tokens == 8
    body = upstream(req)
    assert [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None] == [8]


def test_pool_caps_leave_what_is_under_the_cap_and_apply_the_default():
    req = chat(max_tokens=5)
    assert pool_caps(req, CAPPED) == (req, None)
    with_default = PoolSpec("p", "v1", 1, max_tokens_cap=8, default_max_tokens=3)
    got, lowered = pool_caps(chat(), with_default)
    assert lowered is None and got.max_tokens == 3 and upstream(got)["max_tokens"] == 3
    uncapped = PoolSpec("p", "v1", 1)
    assert pool_caps(chat(), uncapped)[0].upstream_body() == chat().raw  # nothing to change: the client's bytes


def tenant(**kw) -> Tenant:
    return Tenant("t", frozenset({"x"}), 100_000, **kw)


def test_tenant_limits():
    over = tenant_limits(chat(max_completion_tokens=41), tenant(max_tokens=40))
    assert isinstance(over, Refusal) and over.status == 400 and over.body["error"]["param"] == "max_completion_tokens"
    # bug 1's spelling is checked against the cap too
    over = tenant_limits(chat(max_completion_tokens=None, max_tokens=41), tenant(max_tokens=40))
    assert isinstance(over, Refusal) and over.body["error"]["param"] == "max_tokens"
    got = tenant_limits(chat(), tenant(max_tokens=40))
    assert got.max_tokens == 40 and upstream(got)["max_tokens"] == 40  # the cap is the tenant's default
    iso = tenant_limits(chat(cache_salt="mine"), tenant(isolate_cache=True))
    assert iso.cache_salt == tenant(isolate_cache=True).cache_salt() and upstream(iso)["cache_salt"] == iso.cache_salt
    plain = chat(max_tokens=3)
    assert tenant_limits(plain, tenant(max_tokens=40)) is plain


def test_request_cost_and_context():
    assert request_cost(chat(max_tokens=10, n=2), [100]) == 120
    assert request_cost(parse_request(Endpoint.COMPLETIONS, b'{"prompt": ["a", "b"], "max_tokens": 4}'),
                        [10, 20]) == 38
    assert request_cost(parse_request(Endpoint.COMPLETIONS, b'{"prompt": "a"}'), [10]) == 26  # OpenAI's 16
    assert request_cost(chat(), [100]) == 100
    assert request_cost(chat(), [100], context_limit=300) == 300
    assert tenant_context(chat(max_tokens=50), tenant(max_context_tokens=150), [100]) is None
    too_long = tenant_context(chat(max_tokens=51), tenant(max_context_tokens=150), [100])
    assert too_long.status == 400 and too_long.body["error"]["code"] == "context_length_exceeded"
    assert too_long.body["error"]["param"] == "messages"


def test_one_pressure_reading_and_shedding():
    cfg = SheddingConfig(min_cost_tokens=100)
    assert pressure(Pressure.NONE, pool_sheds=True) is Pressure.HIGH
    assert pressure(Pressure.CRITICAL, pool_sheds=True) is Pressure.CRITICAL
    assert pressure(Pressure.NONE, pool_sheds=False) is Pressure.NONE
    assert shed(Pressure.NONE, 10_000, 0, (0, 0), "p", False, cfg) is None
    assert shed(Pressure.HIGH, 99, 0, (0, 0), "p", True, cfg) is None
    r = shed(Pressure.HIGH, 100, 0, (0, 0), "p", True, cfg)
    assert r.status == 503 and (b"retry-after", b"2") in r.headers and "pool p is degraded" in r.body["error"]["message"]
    assert shed(Pressure.HIGH, 100, 1, (0, 1), "p", False, cfg) is None  # the highest priority is never shed


# -- the pipeline, as a table ---------------------------------------------------------------------------------
KEY_CAPPED, KEY_SMALL, KEY_NARROW = "sk-capped-1", "sk-small-2", "sk-narrow-3"
BIG = PoolSpec("b", "v1", 1, models=("big",))


class StaticPools:
    """The Pools interface the pipeline calls (catalog, choose, version, shedding) over fixed specs: the real
    catalog and choice; a pool that declares no model serves "m"."""

    def __init__(self, specs, shedding=()):
        self.specs, self.shed = specs, set(shedding)
        self.catalog = catalog(specs, {s.name: frozenset({"m"}) for s in specs})

    def choose(self, model, session_key, prompt_tokens, max_tokens):
        served = self.catalog.pools_of.get(model, ())
        return choose_pool([s for s in self.specs if s.name in served], session_key, prompt_tokens, max_tokens, 0,
                           random.Random(0))

    def version(self, pool):
        return "v1"

    def shedding(self, pool):
        return pool in self.shed


@pytest.fixture
def ratelimit(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""tenants:
  capped:
    api_key_sha256: ["{key_sha256(KEY_CAPPED)}"]
    tokens_per_minute: 100000
    max_tokens: 40
  small:
    api_key_sha256: ["{key_sha256(KEY_SMALL)}"]
    tokens_per_minute: 100
  narrow:
    api_key_sha256: ["{key_sha256(KEY_NARROW)}"]
    tokens_per_minute: 100000
    models: [big]
model_token_weights:
  big: 2.5
""")
    cfg = RateLimitConfig(tenants_file=str(path), shedding=SheddingConfig(min_cost_tokens=100))
    return RateLimiter(cfg, RouterMetrics("kv"), lambda: (None, None), 30.0)


def auth(key):
    return [(b"authorization", f"Bearer {key}".encode())]


PIPELINE = [  # (key or None, pools, shedding pools, request fields, prompt tokens, expected)
    (None, [CAPPED], (), {"max_completion_tokens": None, "max_tokens": 60}, [10], ("ok", 8, 8)),
    (None, [CAPPED], (), {}, [10], ("ok", 8, 8)),
    (None, [CAPPED], (), {"max_tokens": 5}, [10], ("ok", 5, None)),
    (None, [PoolSpec("p", "v1", 1, max_context_tokens=50)], (), {"max_tokens": 45}, [10], (400, "context_length_exceeded")),
    (None, [PoolSpec("p", "v1", 0)], (), {}, [10], (503, "no_pool")),
    (None, [CAPPED], ("p",), {"max_tokens": 8, "n": 16}, [10], (503, "overloaded")),
    (None, [CAPPED], ("p",), {"max_tokens": 8}, [10], ("ok", 8, None)),  # cheap: not shed
    ("nokey", [CAPPED], (), {}, [10], (401, "invalid_api_key")),
    (KEY_CAPPED, [CAPPED], (), {"max_tokens": 41}, [10], (400, "invalid_value")),
    (KEY_CAPPED, [PoolSpec("p", "v1", 1)], (), {}, [10], ("ok", 40, None)),
    (KEY_CAPPED, [CAPPED], (), {}, [10], ("ok", 8, 8)),  # tenant first (40), then the pool (8)
    (KEY_SMALL, [CAPPED], (), {"max_tokens": 8, "n": 20}, [10], (400, "request_too_large")),
    # the model: named, the default ("m"), unknown, not this tenant's, and its pools only
    (None, [CAPPED, BIG], (), {"model": "big", "max_tokens": 60}, [10], ("ok", 60, None, "b")),
    (None, [CAPPED, BIG], (), {"model": "nope"}, [10], (404, "model_not_found")),
    (KEY_NARROW, [CAPPED, BIG], (), {"max_tokens": 5}, [10], (404, "model_not_found")),  # "m": not its model
    (KEY_NARROW, [CAPPED, BIG], (), {"model": "big", "max_tokens": 5}, [10], ("ok", 5, None, "b")),
    (None, [PoolSpec("p", "v1", 0), BIG], (), {}, [10], (503, "no_pool")),  # "m": its only pool is drained
]


@pytest.mark.parametrize("key, specs, shedding, fields, prompts, expected", PIPELINE)
def test_pipeline_table(ratelimit, key, specs, shedding, fields, prompts, expected):
    admission = Admission(StaticPools(specs, shedding), ratelimit, RouterMetrics("kv"), SheddingConfig(min_cost_tokens=100),
                          default_model="m")
    if key is None:
        admission.ratelimit = None
        who = None
    else:
        who = admission.identify(auth(key) if key != "nokey" else [])
    got = who if isinstance(who, Refusal) else admission.model(chat(**fields), who)
    if not isinstance(got, Refusal):
        got = asyncio.run(admission.admit(got, who, None, prompts))
    if expected[0] == "ok":
        assert isinstance(got, Admitted), got
        _, max_tokens, lowered, *pool = expected
        assert got.request.max_tokens == max_tokens
        assert upstream(got.request)["model"] == fields.get("model", "m") == got.request.model
        headers = dict(got.headers)
        assert headers[b"x-kvfleet-pool"] == (pool[0] if pool else "p").encode()
        assert headers.get(b"x-kvfleet-max-tokens-lowered") == (str(lowered).encode() if lowered else None)
    else:
        assert isinstance(got, Refusal), got
        assert (got.status, got.body["error"]["code"]) == expected


def test_weighted_models_reserve_and_charge_their_weight(ratelimit):
    """`big` weighs 2.5: 10 prompt + 5 max_tokens reserve ceil(15 x 2.5) = 38 budget tokens; an answer that used
    7 tokens is charged ceil(7 x 2.5) = 18, and the rest is refunded."""
    admission = Admission(StaticPools([CAPPED, BIG]), ratelimit, RouterMetrics("kv"), SheddingConfig(), default_model="m")
    who = admission.identify(auth(KEY_NARROW))
    got = asyncio.run(admission.admit(admission.model(chat(model="big", max_tokens=5), who), who, None, [10]))
    assert isinstance(got, Admitted) and got.budget.reservation.amount == 38
    assert dict(got.headers)[b"x-ratelimit-remaining-tokens"] == b"99962"
    asyncio.run(ratelimit.settle(got.budget, {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}, True))
    metrics = ratelimit.metrics.render().decode()
    assert 'kvfleet_router_ratelimit_tokens_total{kind="used",tenant="narrow"} 18.0' in metrics
    assert 'kvfleet_router_ratelimit_tokens_total{kind="refunded",tenant="narrow"} 20.0' in metrics


def test_a_request_without_a_model_needs_the_default():
    admission = Admission(StaticPools([CAPPED]), None, RouterMetrics("kv"), SheddingConfig())
    got = admission.model(chat(), None)
    assert isinstance(got, Refusal) and got.status == 400
    assert got.body["error"]["param"] == "model" and got.body["error"]["code"] == "missing_required_parameter"
    assert "model" not in json.loads(chat().upstream_body())
