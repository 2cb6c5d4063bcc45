"""The goodput bench's arithmetic: attainment counts refusals and errors as misses, goodput is the highest rate that
reaches the goal. Exact."""

from __future__ import annotations

from loadtest.slo_goodput_bench import Outcome, goodput, summarize


def test_attainment_counts_a_refusal_or_a_late_token_as_a_miss_and_batch_tokens_per_second():
    out = [Outcome(True, 200, 0.5, 0.05, 32), Outcome(True, 200, 2.0, 0.05, 32),  # met; TTFT late
           Outcome(True, 200, 0.5, 0.2, 32), Outcome(True, 429),  # TPOT late; refused
           Outcome(False, 200, 3.0, 0.3, 64), Outcome(False, 599)]  # batch: served (no targets), failed
    s = summarize(out, 8.0, 1.5, 0.1)
    assert (s["sent"], s["refused"], s["errors"], s["attainment"]) == (4, 1, 1, 0.25)
    assert (s["batch"], s["batch_tok_s"]) == (1, 8.0)


def test_goodput_is_the_highest_rate_reaching_the_goal():
    rows = [(1.0, {"attainment": 1.0}), (2.0, {"attainment": 0.95}), (3.0, {"attainment": 0.7}),
            (4.0, {"attainment": 0.91})]
    assert goodput(rows, 0.9) == 4.0
    assert goodput(rows[:3], 0.9) == 2.0
    assert goodput([(1.0, {"attainment": 0.5})], 0.9) == 0.0
