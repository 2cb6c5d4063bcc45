"""The scheduler's fair share across fairness ids (engine/fair_share.py) and its steps bounded by the step-time
model (engine/step_time.py), on the fake engine loop of test_scheduler_harness."""

from __future__ import annotations

import random

import pytest

from engine.sequence import SequenceStatus
from engine.step_time import StepShape, StepTimeModel
from tests.engine.test_scheduler import random_trace
from tests.engine.test_scheduler_harness import FakeEngine


def steps(eng: FakeEngine, n: int = 1) -> list[dict[str, int]]:
    return [{i.seq.request_id: i.num_new_tokens for i in eng.step().scheduled} for _ in range(n)]


def flood(eng: FakeEngine, a: str, b: str) -> None:
    """Tenant a queues five 12-token prompts, then tenant b one of 4 tokens."""
    for k in range(1, 6):
        eng.add(f"a{k}", [k] * 12, max_tokens=2, fairness_id=a)
    eng.add("b1", [9] * 4, max_tokens=2, fairness_id=b)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_other_tenants_prompt_goes_after_one_of_the_floods_not_after_all(policy):
    eng = FakeEngine(budget=16, policy=policy)
    flood(eng, "a", "b")
    # counters a 0, b lifted to 0: a1 (a's head is ahead), then b1 (b 0 < a 12), then a2...
    assert steps(eng) == [{"a1": 12, "b1": 4}]
    assert eng.sched.fair.counters == {"a": 12 + 2, "b": 4 + 2}  # prompts at 1, each first sampled token at 2


@pytest.mark.parametrize("ids", [("", ""), ("t", "t")])
def test_one_fairness_id_is_first_come_first_served(ids):
    eng = FakeEngine(budget=16)
    flood(eng, *ids)
    assert steps(eng, 3) == [{"a1": 12, "a2": 4}, {"a1": 1, "a2": 8, "a3": 7}, {"a2": 1, "a3": 5, "a4": 10}]


def test_a_single_id_schedules_exactly_as_no_id_on_a_random_trace():
    runs = []
    for fid in ("", "solo"):
        eng = FakeEngine(num_blocks=40, budget=24, max_num_seqs=4)
        for rid, prompt, max_tokens in random_trace(7, 40):
            eng.add(rid, prompt, max_tokens, fairness_id=fid)
        eng.run()
        runs.append(([[(i.seq.request_id, i.num_new_tokens) for i in o.scheduled] for o in eng.outputs],
                     eng.outputs_by_seq()))
    assert runs[0] == runs[1]


def test_priority_goes_first_and_the_counters_order_equal_priorities():
    eng = FakeEngine(budget=16, policy="priority")
    for k in range(1, 4):
        eng.add(f"a{k}", [k] * 12, max_tokens=2, fairness_id="a", priority=0)
    eng.add("b1", [9] * 4, max_tokens=2, fairness_id="b", priority=1)  # a worse priority: after all of a's
    eng.add("c1", [8] * 4, max_tokens=2, fairness_id="c", priority=0)
    assert steps(eng) == [{"a1": 12, "c1": 4}]
    assert [s.request_id for s in eng.sched.waiting] == ["a2", "a3", "b1"]


def test_a_tenant_back_from_idle_is_lifted_and_does_not_jump_the_queue_with_banked_time():
    eng = FakeEngine(budget=16)
    eng.add("b0", [9] * 4, max_tokens=1, fairness_id="b")
    eng.run()  # b served a little, then idle
    flood(eng, "a", "x")
    eng.sched.finish(eng.seqs[-1], SequenceStatus.FINISHED_ABORTED)  # x's b1 gone: a floods alone
    steps(eng, 4)
    a = eng.sched.fair.counters["a"]
    assert a > eng.sched.fair.counters["b"]
    eng.add("b2", [7] * 4, max_tokens=2, fairness_id="b")
    assert eng.sched.fair.counters["b"] == a


def test_preempted_sequences_stay_at_the_head_of_the_queue_whatever_their_counter():
    rng = random.Random(3)
    eng = FakeEngine(num_blocks=14, budget=16, max_num_seqs=6)
    trace = random_trace(11, 40, max_prompt=20, max_out=16)
    preempted = 0
    for k, (rid, prompt, max_tokens) in enumerate(trace):
        eng.add(rid, prompt, max_tokens, fairness_id=rng.choice("abc"))
        if k % 3 == 2:
            out = eng.step()
            preempted += len(out.preempted)
            flags = [s.num_preemptions > 0 for s in eng.sched.waiting]
            assert flags == sorted(flags, reverse=True)
    eng.run()
    assert preempted > 0
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs)


# ---- bounded steps -------------------------------------------------------------------------------------------------

COEF = (0.010, 0.002, 0.005, 0.0001)  # c0 s, s per prompt token, per decoding sequence, per context token


def two_decoding(max_step_ms: float = 100.0) -> FakeEngine:
    eng = FakeEngine(budget=64, max_step_ms=max_step_ms)
    eng.add("a", [1] * 4, max_tokens=10)
    eng.add("b", [2] * 4, max_tokens=10)
    assert steps(eng) == [{"a": 4, "b": 4}]  # no model yet: the whole budget
    return eng


def test_prompt_tokens_are_cut_to_keep_the_predicted_step_under_the_target():
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    # the step aims at 90% of --max-step-ms (TPOT_MARGIN), 0.090 s; decodes: 2 sequences reading 5 + 5 tokens:
    # 0.010 + 2 * 0.005 + 10 * 0.0001 = 0.021 s; room 0.069 s at 0.002 + 0.0001 per prompt token = 32.9 -> 32
    out = eng.step()
    assert {i.seq.request_id: i.num_new_tokens for i in out.scheduled} == {"a": 1, "b": 1, "c": 32}
    assert out.shape == StepShape(32, 2, 5 + 5 + 32)
    assert out.predicted_s == pytest.approx(0.010 + 32 * 0.002 + 2 * 0.005 + 42 * 0.0001)
    assert out.predicted_s <= 0.090


def test_cut_steps_that_took_longer_than_predicted_are_cut_shorter():
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    out = eng.step()  # as above: 32 prompt tokens, predicted 0.0894 s, cut to the target
    assert out.cut and out.shape.prefill_tokens == 32
    eng.sched.step_time.overrun = 1.5  # cut steps have taken 1.5x their prediction
    eng.sched.step_time.coefficients = COEF  # (the step just observed refits nothing: 3 samples)
    out = eng.step()
    # aim 0.090 / 1.5 = 0.060 s; decodes 0.010 + 2 * 0.005 + (6 + 6 + 32) * 0.0001 = 0.0244 s; room 0.0356 s at
    # 0.0021 per prompt token: 16
    assert {i.seq.request_id: i.num_new_tokens for i in out.scheduled} == {"a": 1, "b": 1, "c": 16}
    assert out.cut


def test_prompts_always_progress_by_at_least_one_block():
    eng = two_decoding()
    eng.sched.step_time.coefficients = (0.2, *COEF[1:])  # the decodes alone are over the target
    eng.add("c", [3] * 100, max_tokens=1)
    assert steps(eng) == [{"a": 1, "b": 1, "c": 4}]  # block_size 4


def test_a_short_prompts_step_keeps_other_chunks_under_half_the_target():
    """b's whole 8-token prompt fits the step: c's chunk (running, not finishing) shares only the tokens that keep
    the step under half the target; the step after b's first token is bounded by the whole target again."""
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    assert steps(eng) == [{"a": 1, "b": 1, "c": 32}]  # as above: no waiting prompt to protect
    eng.add("d", [4] * 8, max_tokens=2)  # alone 0.010 + 8 * 0.0021 = 0.0268 s: too long for a step of its own
    # decodes 2 reading 6 + 6, c's 32 computed: 0.010 + 0.010 + 44 * 0.0001 = 0.0244 s; half the target (0.045 s)
    # leaves 0.0206 s: 9.8 -> 9 prompt tokens for chunks; d's 8 tokens are whole (not cut): 9 + 8 <= the full room
    assert steps(eng) == [{"a": 1, "b": 1, "c": 9, "d": 8}]
    # nobody waits: the whole target (3 decodes reading 7 + 7 + 9, c 41 computed: 0.0314 s; 0.0586 s -> 27)
    assert steps(eng) == [{"a": 1, "b": 1, "c": 27, "d": 1}]


def test_short_waiting_prompts_get_a_step_of_their_own_and_the_decodes_the_next():
    """d's and e's whole prompts finish in a step predicted at most a quarter of the target (SHORT_HEADS_SHARE):
    they get it alone, before the decodes and c's chunk; f, a third, would take it past the quarter and waits."""
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    assert steps(eng) == [{"a": 1, "b": 1, "c": 32}]
    for i, rid in enumerate(("d", "e", "f")):
        eng.add(rid, [10 + i] * 2, max_tokens=2)
    # d + e: 0.010 + 4 * 0.002 + 4 * 0.0001 = 0.0184 s <= a quarter of 0.090 s; with f 0.0226 s: over
    out = eng.step()
    assert {i.seq.request_id: i.num_new_tokens for i in out.scheduled} == {"d": 2, "e": 2}
    assert out.predicted_s == pytest.approx(0.010 + 4 * 0.002 + 4 * 0.0001)
    # never two in a row: the decodes go on, f with them (whole: it finishes), c's chunk under half the target
    nxt = steps(eng)[0]
    assert nxt["a"] == nxt["b"] == nxt["d"] == nxt["e"] == 1 and nxt["f"] == 2 and 4 <= nxt["c"] < 32


def test_a_head_too_long_for_a_quarter_step_or_a_running_tpot_target_gets_no_step_of_its_own():
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("d", [4] * 5, max_tokens=2)  # 0.010 + 5 * 0.002 + 5 * 0.0001 = 0.0205 s: short enough
    assert steps(eng) == [{"d": 5}]
    eng = FakeEngine(budget=64, max_step_ms=100.0)
    eng.add("a", [1] * 4, max_tokens=10, tpot_target_s=0.5)
    eng.add("b", [2] * 4, max_tokens=10)
    steps(eng)
    eng.sched.step_time.coefficients = COEF
    eng.add("d", [4] * 5, max_tokens=2)
    assert steps(eng) == [{"a": 1, "b": 1, "d": 5}]  # a's steps are already cut to its target
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("d", [4] * 5, max_tokens=2)
    eng.add("e", [5] * 6, max_tokens=2)  # alone 0.010 + 6 * 0.0021 = 0.0226 s: too long for a step of its own
    assert steps(eng, 2) == [{"d": 5}, {"a": 1, "b": 1, "d": 1, "e": 6}]


def test_a_step_that_cannot_finish_the_waiting_head_is_not_shortened():
    eng = two_decoding()
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    eng.add("d", [4] * 100, max_tokens=1)  # too long to finish in one step: chunks as before
    out = steps(eng)
    assert out[0]["a"] == out[0]["b"] == 1 and sum(out[0].values()) == 2 + 32


def test_chunks_progress_by_a_block_even_when_the_decodes_take_half_the_target():
    eng = two_decoding()
    eng.sched.step_time.coefficients = (0.045, *COEF[1:])  # decodes alone 0.0601 s: over half of 0.100
    eng.add("c", [3] * 100, max_tokens=1)
    steps(eng)
    eng.add("d", [4] * 6, max_tokens=2)
    assert steps(eng)[0] == {"a": 1, "b": 1, "c": 4, "d": 6}  # block_size 4 for c; d whole


def test_a_lone_prompt_gets_the_whole_budget():
    eng = FakeEngine(budget=64)
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 150, max_tokens=1)
    assert steps(eng, 3) == [{"c": 64}, {"c": 64}, {"c": 22}]


def test_a_lone_prompt_without_a_target_while_targets_come_is_cut_to_a_third_of_the_strictest():
    eng = FakeEngine(budget=64)
    eng.sched.step_time.coefficients = COEF
    eng.add("i", [5] * 80, max_tokens=1, ttft_target_s=0.6)
    eng.add("j", [6] * 4, max_tokens=1, ttft_target_s=0.3)
    eng.run()
    eng.now = 30.0
    eng.add("c", [3] * 150, max_tokens=1)
    # steps of 0.3 / 3 x TPOT_MARGIN = 0.09 s: 0.010 + 0.0021 x p + 0.0001 x context read before <= 0.09
    assert steps(eng, 5) == [{"c": 38}, {"c": 36}, {"c": 34}, {"c": 32}, {"c": 10}]
    eng.now = 30.0 + 61  # no target for a minute: whole again
    eng.add("d", [4] * 150, max_tokens=1)
    assert steps(eng, 3) == [{"d": 64}, {"d": 64}, {"d": 22}]
    eng.add("e", [7] * 150, max_tokens=1, ttft_target_s=0.3)  # a lone prompt with its own target: whole
    assert steps(eng, 3) == [{"e": 64}, {"e": 64}, {"e": 22}]


@pytest.mark.parametrize("fitted, max_step_ms", [(False, 100.0), (True, 0.0)])
def test_unbounded_until_fitted_and_when_off(fitted, max_step_ms):
    eng = two_decoding(max_step_ms)
    if fitted:
        eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    assert steps(eng) == [{"a": 1, "b": 1, "c": 62}]


def test_the_model_fitted_from_observed_steps_bounds_the_next_ones():
    eng = FakeEngine(num_blocks=200, budget=64, max_num_seqs=8, max_step_ms=60.0, prefix_caching=False)
    eng.sched.step_time = StepTimeModel(min_samples=16, refit_every=1)

    def seconds(shape: StepShape) -> float:
        return COEF[0] + COEF[1] * shape.prefill_tokens + COEF[2] * shape.decode_seqs + COEF[3] * shape.context_tokens

    for rid, prompt, max_tokens in random_trace(5, 60, max_prompt=60, max_out=20):
        eng.add(rid, prompt, max_tokens)
    bounded = 0
    while eng.sched.has_unfinished():
        contended = eng.sched.num_running + eng.sched.num_waiting > 1
        fitted = eng.sched.step_time.ready
        out = eng.step()
        eng.sched.observe_step(out, seconds(out.shape))
        if fitted and contended and out.shape.prefill_tokens > 4:
            bounded += 1
            # a one-token prompt admitted is a decode in the step's shape (engine/step_time.py): one decode over
            assert out.predicted_s <= 0.060 + COEF[2] + 1e-9
    assert eng.sched.step_time.coefficients == pytest.approx(COEF, rel=1e-6, abs=1e-9)
    assert bounded > 10


def test_a_running_prompt_leaves_room_to_the_waiting_prompt_of_a_tenant_below_its_counter():
    eng = FakeEngine(budget=24)
    eng.add("a1", [1] * 60, max_tokens=2, fairness_id="a")
    assert steps(eng) == [{"a1": 24}]
    eng.add("b1", [9] * 6, max_tokens=2, fairness_id="b")
    eng.add("c1", [8] * 6, max_tokens=2, fairness_id="c")
    eng.sched.fair.counters.update(b=10, c=70)  # b below a's 60 (its prompt, charged whole), c above
    assert steps(eng) == [{"a1": 18, "b1": 6}]  # b1's tokens kept from a1's chunk, not c1's
    eng.add("d1", [7] * 30, max_tokens=2, fairness_id="d")
    eng.sched.fair.counters.update(d=0)
    # d1's 30 tokens wait below a's counter: a1 leaves them all its chunk (c1 waits)
    assert steps(eng) == [{"b1": 1, "d1": 23}]


def test_running_prompts_progress_when_the_room_they_left_was_not_taken():
    eng = FakeEngine(budget=24, max_num_seqs=2)
    eng.add("x1", [2] * 4, max_tokens=9, fairness_id="x")
    eng.add("a1", [1] * 60, max_tokens=2, fairness_id="a")
    assert steps(eng) == [{"x1": 4, "a1": 20}]
    eng.add("b1", [9] * 6, max_tokens=2, fairness_id="b")  # no seat for it
    b1 = eng.sched.waiting[0]
    eng.sched.fair.counters.update(b=0)
    eng.sched._startable = lambda budget, first_only=False: [(b1, 100)]  # as if it could start, but it will not
    assert steps(eng, 3) == [{"x1": 1}, {"a1": 23, "x1": 1}, {"x1": 1}]  # a1 left room once, then went on


def test_with_one_id_a_running_prompt_goes_first_as_before():
    eng = FakeEngine(budget=16)
    eng.add("a1", [1] * 40, max_tokens=2, fairness_id="t")
    eng.add("b1", [9] * 4, max_tokens=2, fairness_id="t")
    assert steps(eng, 2) == [{"a1": 16}, {"a1": 16}]


@pytest.mark.parametrize("max_step_ms", [100.0, 0.0])
def test_a_running_sequences_tpot_target_lowers_the_step_target(max_step_ms):
    """a streams with a 50 ms TPOT target: the step keeps under 45 ms (the margin), not max_step_ms (nor unbounded
    when off)."""
    eng = FakeEngine(budget=64, max_step_ms=max_step_ms)
    eng.add("a", [1] * 4, max_tokens=10, tpot_target_s=0.05)
    eng.add("b", [2] * 4, max_tokens=10)
    assert steps(eng) == [{"a": 4, "b": 4}]
    eng.sched.step_time.coefficients = COEF
    eng.add("c", [3] * 100, max_tokens=1)
    # decodes 0.021 s as above; room 0.045 - 0.021 = 0.024 s at 0.0021 per prompt token = 11.4 -> 11
    out = eng.step()
    assert {i.seq.request_id: i.num_new_tokens for i in out.scheduled} == {"a": 1, "b": 1, "c": 11}
    assert out.predicted_s <= 0.045


def test_the_step_target_is_the_strictest_of_max_step_ms_and_the_running_tpot_targets_with_a_margin():
    from types import SimpleNamespace

    from engine.scheduler import step_target_s

    def seq(t, prompt_left=0):  # a decode (one token to compute), or a prompt with `prompt_left` tokens to go
        return SimpleNamespace(params=SimpleNamespace(tpot_target_s=t), num_tokens=10 + max(prompt_left, 1),
                               num_computed_tokens=10)

    # 90% of each bound (TPOT_MARGIN): a step aimed at the bound itself overruns it about half the time
    assert step_target_s(150.0, []) == pytest.approx(0.135) and step_target_s(0.0, []) is None
    assert step_target_s(150.0, [seq(None), seq(0.08), seq(0.2)]) == pytest.approx(0.072)  # 90% of 80 ms
    assert step_target_s(0.0, [seq(0.3)]) == pytest.approx(0.27)
    assert step_target_s(50.0, [seq(0.3)]) == pytest.approx(0.045)
    # a prompt still computing has no token to pace: its target bounds the steps only once it decodes
    assert step_target_s(150.0, [seq(0.05, prompt_left=300), seq(0.2)]) == pytest.approx(0.135)
    assert step_target_s(0.0, [seq(0.05, prompt_left=2)]) is None
