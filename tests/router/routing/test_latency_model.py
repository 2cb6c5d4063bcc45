"""The router's TTFT model (router/routing/ttft_model.py) and how the placement core feeds it: exact fits on
synthetic observations, the non-negative refit, no prediction before enough first tokens, and the features a
request is placed with."""

from __future__ import annotations

import random

import pytest

from router.routing.placement import HashedPrompt, Placement, PlacementConfig
from router.routing.policies import POLICIES, ReplicaView
from router.routing.replicas import EngineLoad
from router.routing.ttft_model import TTFTFeatures, TTFTModel, features


def _truth(x: TTFTFeatures) -> float:
    return 0.02 + 0.0005 * x.prompt_tokens + 0.0004 * x.ahead_tokens + 0.1 * x.waiting + 0.003 * x.running


def _samples(n: int, seed: int = 0) -> list[TTFTFeatures]:
    rng = random.Random(seed)
    return [TTFTFeatures(rng.randrange(1, 4000), rng.randrange(0, 8000), rng.randrange(0, 5), rng.randrange(0, 64))
            for _ in range(n)]


def test_the_fit_minimises_the_relative_error():
    """Two kinds of first token the features cannot tell apart, 0.1 s and 1 s: plain least squares would predict
    their mean (0.55 s, 450% off the fast ones); the relative fit minimises ((c - 0.1) / 0.1)^2 + ((c - 1) / 1)^2:
    c = 11 / 101. Observations under MIN_WEIGHT_S weigh as one of 10 ms."""
    m = TTFTModel(min_samples=16)
    for _ in range(8):
        m.observe(TTFTFeatures(0, 0, 0, 0), 0.1)
        m.observe(TTFTFeatures(0, 0, 0, 0), 1.0)
    assert m.predict(TTFTFeatures(0, 0, 0, 0)) == pytest.approx(11 / 101)
    tiny = TTFTModel(min_samples=16)
    for _ in range(8):
        tiny.observe(TTFTFeatures(0, 0, 0, 0), 0.0)  # weighs as 10 ms: (c / 0.01)^2 + ((c - 0.02) / 0.02)^2
        tiny.observe(TTFTFeatures(0, 0, 0, 0), 0.02)
    assert tiny.predict(TTFTFeatures(0, 0, 0, 0)) == pytest.approx(0.02 / 5)


def test_the_fit_recovers_the_coefficients_of_exact_observations():
    m = TTFTModel(min_samples=16)
    for x in _samples(15):
        m.observe(x, _truth(x))
    assert not m.ready and m.predict(TTFTFeatures(100, 0, 0, 0)) is None  # 15 < min_samples: no prediction
    x = _samples(1, seed=9)[0]
    m.observe(x, _truth(x))
    assert m.ready
    assert m.coefficients == pytest.approx((0.02, 0.0005, 0.0004, 0.1, 0.003), rel=1e-6)
    probe = TTFTFeatures(2048, 512, 1, 8)
    assert m.predict(probe) == pytest.approx(_truth(probe), rel=1e-9)


def test_a_feature_that_would_come_out_negative_is_fixed_at_zero_and_the_rest_refitted():
    m = TTFTModel(min_samples=16)
    rng = random.Random(3)
    for x in _samples(64, seed=1):
        # running does not matter here; noise would give it a small negative coefficient unconstrained
        m.observe(x, 0.05 + 0.001 * x.prompt_tokens + 0.0005 * x.ahead_tokens + rng.uniform(-1e-3, 1e-3))
    assert all(c >= 0 for c in m.coefficients)
    assert m.coefficients[1] == pytest.approx(0.001, rel=0.01) and m.coefficients[2] == pytest.approx(0.0005, rel=0.02)


def test_negative_or_nan_seconds_are_not_observations():
    m = TTFTModel(min_samples=5)
    for x in _samples(5):
        m.observe(x, float("nan"))
        m.observe(x, -1.0)
    assert len(m.samples) == 0 and not m.ready


def test_features_read_the_view_as_the_kv_cost_does():
    v = ReplicaView("http://a", running=6, waiting=4, finished=2, new_requests=3, pending=1, pending_tokens=900)
    assert features(v, 1000, 256) == TTFTFeatures(744.0, 900.0, 3.0, 7.0)


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
    """Replicas a (10 short sequences running) and b (one 4,000-token prefill of this router's ahead), the model
    fitted exactly: least-load prefers b (1 request against 10), the model a (b's prefill comes first)."""
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a", "http://b"])
    for u, running in (("http://a", 10), ("http://b", 0)):
        p.on_health(u, True, 0.0)
        p.on_load(u, EngineLoad(running=running), 0.0, 0.0)
    for x in _samples(16, seed=2):
        p.ttft.observe(x, _truth(x))
    p.on_routed("http://b", HashedPrompt(num_prompt_tokens=4000), 0, 0.5)
    return p


def test_a_request_with_a_ttft_target_goes_only_where_it_is_predicted_to_be_met():
    p = _two_replicas_fitted()
    prompt = HashedPrompt(num_prompt_tokens=1000)
    predicted = p.predict_ttft(prompt, 1.0)
    assert predicted == pytest.approx({"http://a": _truth(TTFTFeatures(1000, 0, 0, 10)),
                                       "http://b": _truth(TTFTFeatures(1000, 4000, 0, 1))})
    assert {p.choose(prompt, 1.0).url for _ in range(4)} == {"http://b"}  # no target: the policy's choice
    targeted = _Targeted(1000, 0.6)  # a: 0.55 s, b: 2.12 s
    assert {p.choose(targeted, 1.0).url for _ in range(4)} == {"http://a"}
    assert {p.choose(_Targeted(1000, 5.0), 1.0).url for _ in range(4)} == {"http://b"}  # both meet it: the policy
    unmeetable = _Targeted(1000, 0.1)  # neither meets it: the policy decides (the admission refuses it before)
    assert p.choose(unmeetable, 1.0) is not None


def test_no_prediction_before_the_model_is_fitted():
    p = Placement(POLICIES["least-load"], PlacementConfig(block_size=16))
    p.set_members("default", ["http://a"])
    p.on_health("http://a", True, 0.0)
    assert p.predict_ttft(HashedPrompt(num_prompt_tokens=10), 0.0) == {}


class _Targeted(HashedPrompt):
    __slots__ = ("ttft_target_s",)

    def __init__(self, n: int, target: float):
        super().__init__(num_prompt_tokens=n)
        object.__setattr__(self, "ttft_target_s", target)
