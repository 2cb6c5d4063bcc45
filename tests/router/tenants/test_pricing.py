"""Prices per model and what usage costs (router/tenants/pricing.py), the tenants file's `model_prices` and
tenants' own `prices`, and settlement at those prices: exact figures, no I/O."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from router.metrics import RouterMetrics
from router.tenants.file import TenantsFileError, parse_tenants
from router.tenants.pricing import Prices, Usage, budget_tokens, cost_usd, usage_of

A, B = "a" * 64, "b" * 64
FILE = f"""
tenants:
  cheap:
    api_key_sha256: ["{A}"]
    tokens_per_minute: 100000
    prices: {{smollm2: {{cached_input: 0.005}}, own-model: {{input: 1, output: 3}}}}
  plain:
    api_key_sha256: ["{B}"]
    tokens_per_minute: 100000
model_prices:
  smollm2: {{input: 0.10, cached_input: 0.01, output: 0.40}}
"""


def test_usage_reads_openai_usage_and_never_more_cached_than_prompt():
    assert usage_of({"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                     "prompt_tokens_details": {"cached_tokens": 96}}) == Usage(100, 96, 7)
    assert usage_of({"prompt_tokens": 10, "completion_tokens": 2}) == Usage(10, 0, 2)  # no details: none cached
    assert usage_of({"prompt_tokens": 10, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 99}}) == Usage(10, 10, 2)
    assert usage_of({"total_tokens": 12}) == Usage(12, 0, 0)  # a total only: all at the full rate
    for bad in (None, 7, {}, {"prompt_tokens": -1, "completion_tokens": 2}, {"prompt_tokens": True,
                                                                             "completion_tokens": 1}):
        assert usage_of(bad) is None, bad


def test_cost_in_dollars_is_exact():
    p = Prices.of("0.10", "0.40", cached_input="0.01")
    # 4 computed x 0.10 + 96 cached x 0.01 + 7 out x 0.40 = 0.4 + 0.96 + 2.8 = 4.16 per million
    assert cost_usd(Usage(100, 96, 7), p) == Fraction(416, 100) / 1_000_000
    assert Prices.of(1, 2) == Prices(Fraction(1), Fraction(1), Fraction(1), Fraction(2))  # no discount by default


def test_budget_tokens_discount_cached_tokens_only_where_the_model_has_prices():
    p = Prices.of("0.10", "0.40", cached_input="0.01")  # cached at a tenth
    w = Fraction(5, 2)
    assert budget_tokens(Usage(100, 0, 7), w, None) == budget_tokens(Usage(100, 0, 7), w, p) == 268  # ceil(107 x 2.5)
    assert budget_tokens(Usage(100, 90, 7), w, None) == 268  # without prices: as budgets always charged
    assert budget_tokens(Usage(100, 90, 7), w, p) == 65  # ceil((10 + 9 + 7) x 2.5)
    assert budget_tokens(Usage(100, 90, 7), Fraction(1), Prices.of(0, 1)) == 107  # free input: no ratio


def test_the_file_reads_model_prices_and_tenant_overrides_field_by_field():
    reg = parse_tenants(FILE)
    assert reg.prices("plain", "smollm2") == Prices.of("0.10", "0.40", cached_input="0.01", cache_write="0.10")
    assert reg.prices("cheap", "smollm2") == Prices.of("0.10", "0.40", cached_input="0.005", cache_write="0.10")
    assert reg.prices("cheap", "own-model") == Prices.of(1, 3)
    assert reg.prices("plain", "own-model") is None and reg.prices("plain", None) is None


@pytest.mark.parametrize("text, field, problem", [
    ("model_prices: {m: {input: 1}}", "model_prices.m.output", "missing"),
    ("model_prices: {m: {input: -1, output: 1}}", "model_prices.m.input", "a number >= 0, got -1"),
    ("model_prices: {m: {input: 1, output: 1, tip: 2}}", "model_prices.m", "tip"),
    ("model_prices: {m: 3}", "model_prices.m", "must be a mapping"),
    ("model_prices: {m: {input: '1', output: 1}}", "model_prices.m.input", "a number >= 0"),
])
def test_bad_prices_name_the_field(text, field, problem):
    with pytest.raises(TenantsFileError) as e:
        parse_tenants(f'tenants:\n  a: {{api_key_sha256: ["{A}"], tokens_per_minute: 1}}\n{text}\n', "t.yaml")
    assert field in str(e.value) and problem in str(e.value), str(e.value)


def test_a_tenant_pricing_a_model_alone_needs_input_and_output():
    text = f'tenants:\n  a: {{api_key_sha256: ["{A}"], tokens_per_minute: 1, prices: {{m: {{output: 1}}}}}}\n'
    with pytest.raises(TenantsFileError, match=r"tenants\.a\.prices\.m\.input: missing"):
        parse_tenants(text, "t.yaml")


def test_settle_charges_cached_tokens_at_their_price_and_counts_dollars(tmp_path):
    from router.config import RateLimitConfig
    from router.tenants.ratelimit import RateLimiter

    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    rl = RateLimiter(RateLimitConfig(tenants_file=str(path)), RouterMetrics("kv"), lambda: (None, None), 30.0)
    reg = rl.file.registry

    async def run(tenant: str, usage: dict) -> None:
        got = await rl.reserve(reg.get(tenant), 164, "smollm2")  # 100 prompt + 64 max_tokens: worst case
        assert got.reservation.amount == 164
        await rl.settle(got, usage, True)

    usage = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 90}}
    asyncio.run(run("plain", usage))  # 10 + 90 x 0.1 + 7 = 26
    asyncio.run(run("cheap", usage))  # 10 + 90 x 0.05 + 7 = 21.5 -> 22
    asyncio.run(run("plain", {"prompt_tokens": 100, "completion_tokens": 7}))  # nothing cached: 107, as today
    text = rl.metrics.render().decode()
    assert 'kvfleet_router_ratelimit_tokens_total{kind="used",tenant="plain"} 133.0' in text
    assert 'kvfleet_router_ratelimit_tokens_total{kind="used",tenant="cheap"} 22.0' in text
    # plain: (10 x 0.1 + 90 x 0.01 + 7 x 0.4) + (100 x 0.1 + 7 x 0.4) = 4.7 + 12.8 = 17.5 per million
    assert 'kvfleet_router_tenant_cost_dollars_total{model="smollm2",tenant="plain"} 1.75e-05' in text


COST_FILE = f"""
tenants:
  dollars:
    api_key_sha256: ["{A}"]
    dollars_per_minute: 0.05
model_prices:
  smollm2: {{input: 0.10, cached_input: 0.01, output: 0.40}}
"""


def test_reserve_and_charge_units_of_token_and_cost_budgets_are_exact():
    from router.tenants.pricing import charge_units, reserve_units

    p = Prices.of("0.10", "0.40", "0.01")
    assert reserve_units(164, Fraction(1), p, False) == 164 and reserve_units(164, Fraction(3, 2), p, False) == 246
    assert reserve_units(164, Fraction(1), p, True) == 66  # 164 tokens at the highest price, 0.40 micro-dollars each
    u = Usage(100, 90, 7)
    assert charge_units(u, Fraction(1), p, False) == budget_tokens(u, Fraction(1), p) == 26
    assert charge_units(u, Fraction(1), p, True) == 5  # 10 x 0.1 + 90 x 0.01 + 7 x 0.4 = 4.7 micro-dollars, up
    with pytest.raises(ValueError):
        charge_units(u, Fraction(1), None, True)


def test_a_cost_budget_is_read_in_micro_dollars_and_one_budget_is_required():
    t = parse_tenants(COST_FILE, "t.yaml").tenants["dollars"]
    assert t.cost_budget and t.tokens_per_minute == 50_000
    both = COST_FILE.replace("dollars_per_minute: 0.05", "dollars_per_minute: 0.05\n    tokens_per_minute: 10")
    with pytest.raises(TenantsFileError, match="tokens_per_minute or dollars_per_minute, not both"):
        parse_tenants(both, "t.yaml")


def test_a_cost_budget_reserves_the_worst_case_and_settles_the_exact_cost(tmp_path):
    from router.config import RateLimitConfig
    from router.tenants.ratelimit import RateLimiter

    path = tmp_path / "tenants.yaml"
    path.write_text(COST_FILE)
    rl = RateLimiter(RateLimitConfig(tenants_file=str(path)), RouterMetrics("kv"), lambda: (None, None), 30.0)
    tenant = rl.file.registry.get("dollars")

    async def run():
        got = await rl.reserve(tenant, 164, "smollm2")
        assert got.reservation.amount == 66
        await rl.settle(got, {"prompt_tokens": 100, "completion_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 90}}, True)
        unpriced = await rl.reserve(tenant, 10, "other-model")
        assert unpriced.status == 400 and unpriced.body["error"]["code"] == "model_not_priced"
        assert unpriced.body["error"]["param"] == "model"

    asyncio.run(run())
    text = rl.metrics.render().decode()
    assert 'kvfleet_router_ratelimit_tokens_total{kind="used",tenant="dollars"} 5.0' in text
    assert 'kvfleet_router_ratelimit_tokens_total{kind="refunded",tenant="dollars"} 61.0' in text


WRITE = Prices.of("3", "15", cached_input="0.30", cache_write="3.75")  # Anthropic's: a write at 1.25 x input


def test_usage_reads_written_tokens_and_tiers_and_caps_written_to_the_computed():
    report = {"prompt_tokens": 1000, "completion_tokens": 7, "cache_creation_input_tokens": 600,
              "cache_read_input_tokens": 300,
              "prompt_tokens_details": {"cached_tokens": 300,
                                        "cached_tokens_by_tier": {"device": 200, "lower_tier": 64, "peer": 36}}}
    assert usage_of(report) == Usage(1000, 300, 7, 600, (200, 64, 36))
    assert usage_of({**report, "cache_creation_input_tokens": 900}).written_tokens == 700  # never beyond computed
    assert usage_of({**report, "cache_creation_input_tokens": -1}).written_tokens == 0  # malformed: none
    bad_tier = {**report, "prompt_tokens_details": {"cached_tokens": 300, "cached_tokens_by_tier": {"device": 300}}}
    assert usage_of(bad_tier) == Usage(1000, 300, 7, 600, None)  # a tier missing: not reported
    assert usage_of({"prompt_tokens": 10, "completion_tokens": 2}) == Usage(10, 0, 2, 0, None)


def test_a_request_with_breakpoints_pays_cache_write_for_the_written_tokens():
    u = Usage(1000, 300, 7, 600)
    # 100 computed x 3 + 600 written x 3.75 + 300 cached x 0.30 + 7 out x 15 = 300 + 2250 + 90 + 105 = 2745
    assert cost_usd(u, WRITE) == Fraction(2745, 1_000_000)
    # budget tokens: 100 + 600 x 1.25 + 300 x 0.1 + 7 = 887
    assert budget_tokens(u, Fraction(1), WRITE) == 887
    assert budget_tokens(u, Fraction(2), WRITE) == 1774
    assert budget_tokens(u, Fraction(1), None) == 1007  # without prices: every token 1, as always
    assert budget_tokens(u, Fraction(1), Prices.of(0, 1, cache_write=5)) == 1007  # free input: no ratio


def test_a_request_without_breakpoints_is_charged_exactly_as_before():
    u = Usage(1000, 300, 7)  # no cache_creation_input_tokens: written 0
    assert usage_of({"prompt_tokens": 1000, "completion_tokens": 7,
                     "prompt_tokens_details": {"cached_tokens": 300}}) == u
    # 700 computed x 3 + 300 cached x 0.30 + 7 x 15 = 2100 + 90 + 105 = 2295; budget 700 + 30 + 7 = 737
    assert cost_usd(u, WRITE) == Fraction(2295, 1_000_000)
    assert budget_tokens(u, Fraction(1), WRITE) == 737
    p = Prices.of("0.10", "0.40", cached_input="0.01")  # cache_write defaults to input: a write costs as before
    assert cost_usd(Usage(100, 0, 7, 60), p) == cost_usd(Usage(100, 0, 7), p) == Fraction(128, 10) / 1_000_000
    assert budget_tokens(Usage(100, 0, 7, 60), Fraction(1), p) == budget_tokens(Usage(100, 0, 7), Fraction(1), p)


def test_token_reservations_bound_a_charge_with_every_prompt_token_written():
    from router.tenants.pricing import charge_units, reserve_units

    # 1000 prompt + 64 max_tokens: the prompt at 1.25, the output at 1
    assert reserve_units(1064, Fraction(1), WRITE, False, 1000) == 1314
    assert reserve_units(1064, Fraction(1), WRITE, False) == 1330  # prompt unknown: ceil(1064 x 1.25)
    worst = Usage(1000, 0, 64, 1000)
    assert charge_units(worst, Fraction(1), WRITE, False) == 1314 == reserve_units(1064, Fraction(1), WRITE, False,
                                                                                  1000)
    assert charge_units(worst, Fraction(3, 2), WRITE, False) == 1971 == reserve_units(1064, Fraction(3, 2), WRITE,
                                                                                     False, 1000)
    p = Prices.of("0.10", "0.40", cached_input="0.01")  # no write above input: reserved as ever
    assert reserve_units(1064, Fraction(1), p, False, 1000) == reserve_units(1064, Fraction(1), None, False) == 1064
    assert reserve_units(1064, Fraction(1), WRITE, True, 1000) == 15960  # cost budget: 1064 x 15, as before
    assert charge_units(worst, Fraction(1), WRITE, True) == 4710  # 1000 x 3.75 + 64 x 15 micro-dollars


def test_settle_charges_written_tokens_at_the_cache_write_price_and_counts_them(tmp_path):
    from router.config import RateLimitConfig
    from router.tenants.ledger import RecordMeta, UsageRecord
    from router.tenants.ratelimit import RateLimiter

    path = tmp_path / "tenants.yaml"
    path.write_text(FILE + "  claude: {input: 3, cached_input: 0.30, cache_write: 3.75, output: 15}\n")
    rl = RateLimiter(RateLimitConfig(tenants_file=str(path)), RouterMetrics("kv"), lambda: (None, None), 30.0)
    tenant = rl.file.registry.get("plain")
    usage = {"prompt_tokens": 100, "completion_tokens": 7, "cache_creation_input_tokens": 60,
             "prompt_tokens_details": {"cached_tokens": 20,
                                       "cached_tokens_by_tier": {"device": 20, "lower_tier": 0, "peer": 0}}}

    async def run():
        got = await rl.reserve(tenant, 164, "claude", prompt_tokens=100)
        assert got.reservation.amount == 189  # 100 prompt x 1.25 + 64 max_tokens
        await rl.settle(got, usage, True, RecordMeta("req_1", None, "p", "http://e1", "200", 0.5, 0.1))
        rows = await rl.limiter.records("plain", 0, 2**40)
        return UsageRecord.from_json(rows[-1])

    rec = asyncio.run(run())
    # 20 computed + 60 written x 1.25 + 20 cached x 0.1 + 7 = 104; (20 x 3 + 60 x 3.75 + 20 x 0.3 + 7 x 15) / 1e6
    assert (rec.budget_tokens, rec.cost_usd, rec.written_tokens) == (104, "0.000396", 60)
    assert rec.cached_by_tier == {"device": 20, "lower_tier": 0, "peer": 0}
    text = rl.metrics.render().decode()
    assert 'kvfleet_router_tenant_tokens_total{kind="written",model="claude",tenant="plain"} 60.0' in text
    assert 'kvfleet_router_tenant_tokens_total{kind="computed",model="claude",tenant="plain"} 80.0' in text
