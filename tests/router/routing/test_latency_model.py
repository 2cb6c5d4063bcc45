"""The router's TTFT and TPOT models (router/routing/latency_model.py) and how the placement core feeds them: exact
fits on synthetic observations, the non-negative refit, no prediction before enough observations, the features a
request is placed with, and placement by the targets."""

from __future__ import annotations

import math
import random

import pytest

from router.routing.latency_model import (
    LatencyModel,
    TPOTFeatures,
    TTFTFeatures,
    tpot_features,
    ttft_features,
)
from router.routing.placement import HashedPrompt, Placement, PlacementConfig
from router.routing.policies import POLICIES, ReplicaView
from router.routing.replicas import PREFILL_RATE_TAU_S, CircuitBreaker, EngineLoad, ReplicaState


def _truth(x: TTFTFeatures) -> float:
    return (0.02 + 0.0005 * x.prompt_tokens + 0.0004 * x.ahead_tokens + 0.1 * x.waiting + 0.003 * x.running
            + 2e-5 * x.prompt_x_running + 1e-5 * x.ahead_x_running)


def _samples(n: int, seed: int = 0) -> list[TTFTFeatures]:
    rng = random.Random(seed)
    return [TTFTFeatures.of(rng.randrange(1, 4000), rng.randrange(0, 8000), rng.randrange(0, 5), rng.randrange(0, 64))
            for _ in range(n)]


def test_the_fit_minimises_the_absolute_relative_error():
    """Two kinds of first token the features cannot tell apart, 0.1 s and 1 s, eight of each: least squares would
    predict their mean (0.55 s, 450% off the fast ones), least squares of the relative error 11 / 101 s (9% and 89%
    off); the least absolute relative error, |c - 0.1| / 0.1 + |c - 1| / 1 per pair, is least at c = 0.1: half the
    observations exactly, which is what the median error judges. Observations under MIN_WEIGHT_S weigh as one of
    10 ms."""
    m = LatencyModel(min_samples=16)
    for _ in range(8):
        m.observe(TTFTFeatures.of(0, 0, 0, 0), 0.1)
        m.observe(TTFTFeatures.of(0, 0, 0, 0), 1.0)
    assert m.predict(TTFTFeatures.of(0, 0, 0, 0)) == pytest.approx(0.1, rel=1e-3)
    tiny = LatencyModel(min_samples=16)
    for _ in range(8):
        tiny.observe(TTFTFeatures.of(0, 0, 0, 0), 0.0)  # weighs as 10 ms: |c| / 0.01 + |c - 0.02| / 0.02, least at 0
        tiny.observe(TTFTFeatures.of(0, 0, 0, 0), 0.02)
    assert tiny.predict(TTFTFeatures.of(0, 0, 0, 0)) == pytest.approx(0.0, abs=1e-4)


def test_slow_outliers_do_not_pull_the_fit():
    """Eleven prompts whose first token took 20 ms per 100 tokens, and five that took five times that (stalled
    behind work the features do not see): the fit keeps the eleven's slope (1,000 tokens: 0.2 s), where least
    squares of the relative error said 0.204 s."""
    m = LatencyModel(min_samples=16)
    for i in range(16):
        tokens = 100.0 * (i % 4 + 1)
        m.observe(TTFTFeatures.of(tokens, 0, 0, 0), tokens * 0.0002 * (5 if i < 5 else 1))
    assert m.predict(TTFTFeatures.of(1000, 0, 0, 0)) == pytest.approx(0.2, rel=1e-3)


def test_the_fit_recovers_the_coefficients_of_exact_observations():
    m = LatencyModel(min_samples=16)
    for x in _samples(15):
        m.observe(x, _truth(x))
    assert not m.ready and m.predict(TTFTFeatures.of(100, 0, 0, 0)) is None  # 15 < min_samples: no prediction
    x = _samples(1, seed=9)[0]
    m.observe(x, _truth(x))
    assert m.ready
    assert m.coefficients == pytest.approx((0.02, 0.0005, 0.0004, 0.1, 0.003, 2e-5, 1e-5), rel=1e-6)
    probe = TTFTFeatures.of(2048, 512, 1, 8)
    assert m.predict(probe) == pytest.approx(_truth(probe), rel=1e-9)


def test_it_refits_every_refit_every_observations_until_the_window_is_full_then_every_eighth_of_it():
    m = LatencyModel(window=64, min_samples=16, refit_every=4)
    fits = []
    m._fit = lambda: (fits.append(len(m.samples)), setattr(m, "_new", 0), setattr(m, "coefficients", (1.0,) * 7))
    for i in range(64 + 24):
        m.observe(TTFTFeatures.of(i, 0, 0, 0), 0.1)
    # the first at min_samples, every 4 while it fills (up to the 60th), then every 64 // 8 = 8 new ones once it is
    # full: the 68th, 76th and 84th observation
    assert fits == [16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 64, 64]
    assert m._new == 4


def test_a_feature_that_would_come_out_negative_is_fixed_at_zero_and_the_rest_refitted():
    m = LatencyModel(min_samples=16)
    rng = random.Random(3)
    for x in _samples(64, seed=1):
        # running does not matter here; noise would give it a small negative coefficient unconstrained
        m.observe(x, 0.05 + 0.001 * x.prompt_tokens + 0.0005 * x.ahead_tokens + rng.uniform(-1e-3, 1e-3))
    assert all(c >= 0 for c in m.coefficients)
    assert m.coefficients[1] == pytest.approx(0.001, rel=0.01) and m.coefficients[2] == pytest.approx(0.0005, rel=0.02)


def test_negative_or_nan_seconds_are_not_observations():
    m = LatencyModel(min_samples=5)
    for x in _samples(5):
        m.observe(x, float("nan"))
        m.observe(x, -1.0)
    assert len(m.samples) == 0 and not m.ready


def test_features_read_the_view_as_the_kv_cost_does():
    v = ReplicaView("http://a", running=6, waiting=4, finished=2, new_requests=3, pending=1, pending_tokens=900)
    assert ttft_features(v, 744) == TTFTFeatures.of(744.0, 900.0, 3.0, 7.0)


def test_a_request_with_a_ttft_target_counts_ahead_only_the_pending_prefill_due_before_it():
    from dataclasses import replace

    v = ReplicaView("http://a", running=6, waiting=4, finished=2, new_requests=3, pending=1, pending_tokens=900)
    assert ttft_features(replace(v, due_ahead_tokens=120), 744) == TTFTFeatures.of(744.0, 120.0, 3.0, 7.0)
    st = ReplicaState("http://a", CircuitBreaker(3, 5.0))
    st.on_dispatch(1000, 0.0)  # batch: no target
    st.on_dispatch(100, 0.5, ttft_target_s=1.0)  # due 1.5
    st.on_dispatch(40, 0.6, ttft_target_s=2.0)  # due 2.6
    st.on_dispatch(7, 0.0, ttft_target_s=0.5)  # due 0.5: past by 1.0, best effort
    st.on_first_token(st.on_dispatch(300, 0.9, ttft_target_s=0.1))  # streaming already: not pending
    assert st.view(1.0, 5.0).due_ahead_tokens is None and st.view(1.0, 5.0).pending_tokens == 1147
    assert st.view(1.0, 5.0, due_at=2.0).due_ahead_tokens == 100
    assert st.view(1.0, 5.0, due_at=3.0).due_ahead_tokens == 140
    assert st.view(1.0, 5.0, due_at=1.2).due_ahead_tokens == 0


def test_a_tpot_target_an_engine_keeps_caps_the_prediction_at_the_step_it_keeps():
    from router.routing.latency_model import bounded_tpot

    m = LatencyModel(min_samples=5)
    m.coefficients = (0.02, 0.002, 0.0, 0.0001, 0.0, 0.0002)  # c0, running, kv, ahead, waiting, prefill rate
    busy = TPOTFeatures(running=10, kv_tokens=0, ahead_tokens=600, waiting=0, prefill_rate=300)
    assert m.predict(busy) == pytest.approx(0.02 + 0.02 + 0.06 + 0.06)  # 160 ms
    assert bounded_tpot(m, busy, None, True) == pytest.approx(0.16)  # no target
    assert bounded_tpot(m, busy, 0.1, False) == pytest.approx(0.16)  # an engine that does not keep it
    assert bounded_tpot(m, busy, 0.1, True) == pytest.approx(0.09)  # kept at 90% of 100 ms: 40 ms without prefill
    assert bounded_tpot(m, busy, 0.5, True) == pytest.approx(0.16)  # below the bound already
    crowded = busy._replace(running=40)  # 100 ms a step without any prefill: the engine cannot keep 90 ms
    assert bounded_tpot(m, crowded, 0.1, True) == pytest.approx(m.predict(crowded))
    # the paced model (streams' seconds per token over their bound) speaks once ready: 0.3 + 0.001 per token ahead
    paced = LatencyModel(min_samples=5)
    assert bounded_tpot(m, busy, 0.1, True, paced) == pytest.approx(0.09)  # not ready: as without it
    paced.coefficients = (0.3, 0.0, 0.0, 0.001, 0.0, 0.0)
    assert bounded_tpot(m, busy._replace(ahead_tokens=200), 0.1, True, paced) == pytest.approx(0.5 * 0.09)
    assert bounded_tpot(m, busy, 0.1, True, paced) == pytest.approx(0.9 * 0.09)
    assert bounded_tpot(m, busy._replace(ahead_tokens=1000), 0.1, True, paced) == pytest.approx(0.09)  # at most it
    assert bounded_tpot(m, crowded, 0.1, True, paced) == pytest.approx(m.predict(crowded))  # not kept: the model
    assert bounded_tpot(m, busy, None, True, paced) == pytest.approx(0.16)  # no target: the model


def test_streams_with_a_step_bound_also_teach_the_paced_model():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    p.replicas["http://a"].engine = "kvfleet"
    for target, seconds in ((0.1, 0.081), (None, 0.03)):
        ticket = p.on_routed("http://a", HashedPrompt(num_prompt_tokens=100, tpot_target_s=target), 0, 1.0)
        assert ticket.tpot_bound_s == (None if target is None else pytest.approx(0.09))
        p.on_first_token("http://a", ticket, 1.5)
        assert p.on_decoded(ticket, 11, 1.5 + 10 * seconds) == pytest.approx(seconds)
        p.on_done("http://a", ticket)
    assert [y for _, y in p.tpot_paced.samples] == [pytest.approx(0.9)]  # 81 ms of a 90 ms bound
    assert [y for _, y in p.tpot.samples] == [pytest.approx(0.081), pytest.approx(0.03)]  # every stream
    p.replicas["http://a"].engine = "vllm"  # an engine that keeps no bound: its streams teach the TPOT model
    ticket = p.on_routed("http://a", HashedPrompt(num_prompt_tokens=100, tpot_target_s=0.1), 0, 2.0)
    assert ticket.tpot_bound_s is None


def test_the_placement_core_learns_from_first_tokens_and_predicts_at_dispatch():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    p.on_load("http://a", EngineLoad(running=2, waiting=0), 0.0, 0.0)
    now = 1.0
    for i, x in enumerate(_samples(20, seed=4)):
        prompt = HashedPrompt(num_prompt_tokens=int(x.prompt_tokens))
        ticket = p.on_routed("http://a", prompt, 0, now)
        assert ticket.ttft_features.prompt_tokens == x.prompt_tokens
        assert (ticket.predicted_ttft_s is None) == (i < 16)  # ready after the 16th first token
        seconds = _truth(ticket.ttft_features)
        assert p.on_first_token("http://a", ticket, now + seconds) == pytest.approx(seconds)
        assert p.on_first_token("http://a", ticket, now + 2 * seconds) is None  # one observation per attempt
        p.on_done("http://a", ticket)
        now += 10.0
    assert p.ttft.ready and len(p.ttft.samples) == 20


def _two_replicas_fitted() -> Placement:
    """Replicas a (10 short sequences running) and b (one 4,000-token prefill of this router's ahead, due at 1.5 s),
    the model fitted exactly: least-load prefers b (1 request against 10), the model a for a request due after 1.5 s
    (b's prefill comes first)."""
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a", "http://b"])
    for u, running in (("http://a", 10), ("http://b", 0)):
        p.on_health(u, True, 0.0)
        p.on_load(u, EngineLoad(running=running), 0.0, 0.0)
    for x in _samples(16, seed=2):
        p.ttft.observe(x, _truth(x))
    p.on_routed("http://b", HashedPrompt(num_prompt_tokens=4000, ttft_target_s=1.0), 0, 0.5)
    return p


def test_a_request_with_a_ttft_target_goes_only_where_it_is_predicted_to_be_met():
    p = _two_replicas_fitted()
    prompt = HashedPrompt(num_prompt_tokens=1000)
    predicted = p.predict_ttft(prompt, 1.0)
    assert predicted == pytest.approx({"http://a": _truth(TTFTFeatures.of(1000, 0, 0, 10)),
                                       "http://b": _truth(TTFTFeatures.of(1000, 4000, 0, 1))})
    assert {p.choose(prompt, 1.0).url for _ in range(4)} == {"http://b"}  # no target: the policy's choice
    targeted = HashedPrompt(num_prompt_tokens=1000, ttft_target_s=0.8)  # a: 0.75 s, b: 2.18 s
    assert {p.choose(targeted, 1.0).url for _ in range(4)} == {"http://a"}
    assert {p.choose(HashedPrompt(num_prompt_tokens=1000, ttft_target_s=5.0), 1.0).url for _ in range(4)} == {"http://b"}  # both meet it: the policy
    unmeetable = HashedPrompt(num_prompt_tokens=1000, ttft_target_s=0.1)  # neither meets it: the policy decides (the admission refuses it before)
    assert p.choose(unmeetable, 1.0) is not None


def test_no_prediction_before_the_model_is_fitted():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    assert p.predict_ttft(HashedPrompt(num_prompt_tokens=10), 0.0) == {}


def _tpot_truth(x: TPOTFeatures) -> float:
    return (0.008 + 0.0006 * x.running + 0.0000002 * x.kv_tokens + 0.00003 * x.ahead_tokens + 0.004 * x.waiting
            + 0.00002 * x.prefill_rate)


def test_tpot_features_count_the_batch_the_request_joins_and_what_it_reads():
    v = ReplicaView("http://a", running=6, waiting=4, finished=2, new_requests=3, pending=1, pending_tokens=900,
                    kv_tokens=5000.0, prefill_rate=250.0)
    # running: 6 scraped - 2 finished since + 3 sent since + the request itself; KV: held + its prompt
    assert tpot_features(v, 1000) == TPOTFeatures(8.0, 6000.0, 900.0, 3.0, 250.0)


def test_the_placement_core_learns_tpot_from_streams_that_ended():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    now = 1.0
    for i in range(20):
        p.on_load("http://a", EngineLoad(running=4, waiting=0, kv_usage=0.5, kv_capacity_tokens=8000), now - 1, now)
        before = tpot_features(p.replicas["http://a"].view(now, p.cfg.stale_s), 100 + 10 * i)
        ticket = p.on_routed("http://a", HashedPrompt(num_prompt_tokens=100 + 10 * i), 0, now)
        assert ticket.tpot_features == before
        assert before[:4] == (5.0, 4000.0 + 100 + 10 * i, 0.0, 0.0)
        assert (ticket.predicted_tpot_s is None) == (i < 16)  # ready after the 16th stream that ended
        assert p.on_decoded(ticket, 11, now + 1.0) is None  # no first token seen: no TPOT clock
        p.on_first_token("http://a", ticket, now + 0.1)
        assert p.on_decoded(ticket, 1, now + 1.0) is None  # one token: nothing after the first
        seconds = _tpot_truth(ticket.tpot_features)
        assert p.on_decoded(ticket, 11, now + 0.1 + 10 * seconds) == pytest.approx(seconds)
        p.on_done("http://a", ticket)
        now += 10.0
    assert p.tpot.ready and len(p.tpot.samples) == 20
    probe = ticket.tpot_features
    assert p.tpot.predict(probe) == pytest.approx(_tpot_truth(probe), rel=1e-6)


def _two_replicas_tpot_fitted() -> Placement:
    """Replicas a (40 sequences decoding, half its KV held) and b (2 decoding, a 3,000-token prefill of this
    router's ahead): least-load prefers b, and b's first token is later, but each of its later tokens is sooner."""
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a", "http://b"])
    for u, running, usage in (("http://a", 40, 0.5), ("http://b", 2, 0.05)):
        p.on_health(u, True, 0.0)
        p.on_load(u, EngineLoad(running=running, kv_usage=usage, kv_capacity_tokens=100_000), 0.0, 0.0)
    rng = random.Random(5)
    for _ in range(16):
        x = TPOTFeatures(rng.randrange(1, 64), rng.randrange(0, 100_000), rng.randrange(0, 8000), rng.randrange(0, 4),
                         rng.uniform(0, 2000))
        p.tpot.observe(x, _tpot_truth(x))
    p.on_routed("http://b", HashedPrompt(num_prompt_tokens=3000), 0, 0.5)
    return p


def test_a_request_with_a_tpot_target_goes_only_where_it_is_predicted_to_be_met():
    p = _two_replicas_tpot_fitted()
    prompt = HashedPrompt(num_prompt_tokens=1000)
    predicted = p.predict_tpot(prompt, 1.0)
    rate = 3000 / PREFILL_RATE_TAU_S * math.exp(-0.5 / PREFILL_RATE_TAU_S)  # b's 3,000 tokens sent 0.5 s before
    a, b = _tpot_truth(TPOTFeatures(41, 51_000, 0, 0, 0)), _tpot_truth(TPOTFeatures(4, 6_000, 3000, 0, rate))
    assert predicted == pytest.approx({"http://a": a, "http://b": b})  # a: 0.043 s, b: 0.107 s
    assert {p.choose(prompt, 1.0).url for _ in range(4)} == {"http://b"}  # no target: the policy's choice
    fast = HashedPrompt(num_prompt_tokens=1000, tpot_target_s=0.05)
    assert {p.choose(fast, 1.0).url for _ in range(4)} == {"http://a"}
    loose = HashedPrompt(num_prompt_tokens=1000, tpot_target_s=0.2)  # both meet it: the policy
    assert {p.choose(loose, 1.0).url for _ in range(4)} == {"http://b"}
    assert p.choose(HashedPrompt(num_prompt_tokens=1000, tpot_target_s=0.01), 1.0) is not None  # none: the policy


def test_on_kvfleet_engines_a_tpot_target_b_keeps_by_cutting_its_prefill_goes_to_the_policys_choice():
    p = _two_replicas_tpot_fitted()
    for u in ("http://a", "http://b"):
        p.replicas[u].engine = "kvfleet"
    # b's step without prefill fits 90% of 100 ms: b keeps it (the engine cuts the prefill), predicted at most 90 ms
    target = HashedPrompt(num_prompt_tokens=1000, tpot_target_s=0.1)
    b_free = _tpot_truth(TPOTFeatures(4, 6_000, 0, 0, 0))
    assert b_free <= 0.09 and p.predict_tpot(target, 1.0)["http://b"] == pytest.approx(0.09)
    assert {p.choose(target, 1.0).url for _ in range(4)} == {"http://b"}
    p.replicas["http://b"].engine = "vllm"  # an engine that does not keep it: the model's 107 ms, which misses
    assert {p.choose(target, 1.0).url for _ in range(4)} == {"http://a"}


def test_no_tpot_prediction_before_the_model_is_fitted():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    assert p.predict_tpot(HashedPrompt(num_prompt_tokens=10), 0.0) == {}


def test_the_prefill_rate_is_the_tokens_sent_lately_decayed_over_its_window():
    st = ReplicaState("http://a", None)
    assert st.prefill_rate(0.0) == 0.0
    st.on_dispatch(1000, 10.0)
    st.on_dispatch(500, 10.0)
    assert st.prefill_rate(10.0) == pytest.approx(1500 / PREFILL_RATE_TAU_S)
    assert st.prefill_rate(10.0 + PREFILL_RATE_TAU_S) == pytest.approx(1500 / PREFILL_RATE_TAU_S / math.e)
    st.on_dispatch(0, 20.0)  # a fully cached request adds nothing; the rate decays to its time
    assert st.prefill_rate(20.0) == pytest.approx(1500 / PREFILL_RATE_TAU_S / math.e)
    assert st.view(20.0, 3.0).prefill_rate == st.prefill_rate(20.0)
