"""The seeded chat workloads: deterministic, lengths as specified, prefixes shared where the mode says."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvfleet.peers import mooncake_trace
from kvfleet.workload import generate_trace, read_mooncake

DATA = Path(__file__).parent / "data"


def test_same_seed_same_trace_other_seed_other_trace():
    a = generate_trace(50, seed=3)
    assert a == generate_trace(50, seed=3)
    assert [r.messages for r in a] != [r.messages for r in generate_trace(50, seed=4)]


def test_single_mode_lengths():
    trace = generate_trace(400, seed=0)
    assert len({r.request_id for r in trace}) == 400
    assert all(16 <= r.max_tokens <= 128 for r in trace)
    words = [len(r.messages[-1]["content"].split()) for r in trace]
    assert 45 < statistics.mean(words) < 75  # log-normal around ~60 tokens
    assert statistics.median(words) < statistics.mean(words)  # right-skewed
    assert all(len(r.messages) == 1 and r.messages[0]["role"] == "user" for r in trace)


def test_shared_system_prompts_repeat():
    trace = generate_trace(40, seed=1, mode="shared_system", num_system_prompts=3)
    systems = {r.messages[0]["content"] for r in trace}
    assert len(systems) == 3
    assert all(r.messages[0]["role"] == "system" and r.session_id.startswith("system-") for r in trace)


def test_multi_turn_extends_the_previous_turn():
    trace = generate_trace(12, seed=2, mode="multi_turn", turns_per_session=4)
    by_session: dict[str, list] = {}
    for r in trace:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 3
    for turns in by_session.values():
        assert [t.turn for t in turns] == [0, 1, 2, 3]
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert list(cur.messages[:len(prev.messages)]) == list(prev.messages)  # the prefix is the earlier turn
            assert cur.messages[len(prev.messages)]["role"] == "assistant"


def test_poisson_arrivals_and_body():
    trace = generate_trace(100, seed=0, request_rate=10.0)
    times = [r.arrival_s for r in trace]
    assert times == sorted(times) and 5 < times[-1] < 20
    body = trace[0].body("smollm2", stream=True)
    assert body["model"] == "smollm2" and body["stream"] and body["max_tokens"] == trace[0].max_tokens
    json.dumps(body)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        generate_trace(1, mode="chaos")
    with pytest.raises(ValueError):
        generate_trace(1, min_output_tokens=10, max_output_tokens=5)


def _check_prefix_reuse(trace) -> None:
    assert all(r.approx_prompt_tokens <= 1536 and r.max_tokens >= 1 for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    # requests whose trace block 0 is the same share their first 32 words (512 tokens / 16)
    first = [r for r in trace if r.extra["hash_ids"][:1] == [0]]
    assert len(first) > 2
    heads = {" ".join(r.messages[0]["content"].split()[:32]) for r in first}
    assert len(heads) == 1
    others = {" ".join(r.messages[0]["content"].split()[:32]) for r in trace if r.extra["hash_ids"][:1] != [0]}
    assert heads.isdisjoint(others)


def test_mooncake_prefix_reuse_carries_over():
    trace = read_mooncake(DATA / "mooncake_excerpt.jsonl", token_scale=1 / 16)
    assert len(trace) == 200
    _check_prefix_reuse(trace)


@pytest.mark.slow
def test_mooncake_prefix_reuse_carries_over_on_the_whole_trace():
    path = mooncake_trace()
    if not path.is_file():
        pytest.skip(f"the Mooncake trace is not at {path} (set KVFLEET_MOONCAKE_TRACE or KVFLEET_SHARED_DIR)")
    trace = read_mooncake(path, token_scale=1 / 16)
    assert len(trace) == sum(1 for _ in path.open(encoding="utf-8"))
    _check_prefix_reuse(trace)


def test_multi_turn_reply_tokens_sets_the_history_replies():
    trace = generate_trace(8, seed=5, mode="multi_turn", turns_per_session=4, mean_prompt_tokens=300,
                           min_output_tokens=16, max_output_tokens=16, reply_tokens=100)
    replies = [m for r in trace for m in r.messages if m["role"] == "assistant"]
    assert len(replies) == 2 * (1 + 2 + 3)  # turn k carries k earlier replies, two sessions
    assert {len(m["content"].split()) for m in replies} == {100}
    default = generate_trace(8, seed=5, mode="multi_turn", turns_per_session=4, min_output_tokens=16,
                             max_output_tokens=16)
    assert {len(m["content"].split()) for r in default for m in r.messages if m["role"] == "assistant"} == {8}
    with pytest.raises(ValueError, match="reply_tokens"):
        generate_trace(1, mode="multi_turn", reply_tokens=0)
