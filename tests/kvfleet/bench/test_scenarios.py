"""Bench workloads: deterministic for a seed, lengths as declared, traces replayed as written."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from kvfleet.bench.runner import Load, arrival_times
from kvfleet.bench.scenarios import MATRIX, PRESETS, build, read_trace

DATA = Path(__file__).resolve().parents[1] / "data"


def n_words(s: str) -> int:
    return len(s.split())


def test_every_preset_is_deterministic_and_seed_dependent():
    for name in MATRIX:
        assert build(name, 5, seed=1, scale=0.5) == build(name, 5, seed=1, scale=0.5)
        assert build(name, 5, seed=1, scale=0.5) != build(name, 5, seed=2, scale=0.5)


@pytest.mark.parametrize("name", ["short-short", "long-short", "short-long", "long-long"])
def test_fixed_presets_have_their_lengths(name):
    p = PRESETS[name]
    for scale in (1.0, 0.25):
        for c in build(name, 4, scale=scale):
            (turn,) = c.turns
            assert n_words(turn.user) == round(p.prompt * scale) and turn.max_tokens == round(p.output * scale)
            assert c.prefix == () and c.n == 1


def test_multi_turn_rag_shared_system_parallel():
    conv = build("multi-turn", 3)
    assert all(len(c.turns) == 4 and all(n_words(t.user) == 96 for t in c.turns) for c in conv)
    rag = build("rag", 20, seed=3)
    templates = {c.prefix[0]["content"] for c in rag}
    assert len(templates) == 1 and n_words(templates.pop()) == 192  # one template shared by all
    contexts = [c.prefix[1]["content"] for c in rag]
    assert all(c.count("[") == 3 for c in contexts) and len(set(contexts)) > 1  # 3 retrieved chunks each
    system = build("shared-system", 6)
    assert len({json.dumps(c.prefix) for c in system}) == 1 and n_words(system[0].prefix[0]["content"]) == 512
    assert all(c.n == 4 for c in build("parallel-n", 3))


def test_sharegpt_lengths_follow_their_lognormal():
    convs = build("sharegpt", 4000, seed=7)
    prompts = [n_words(c.turns[0].user) for c in convs]
    outs = [c.turns[0].max_tokens for c in convs]
    assert min(prompts) >= 8 and max(prompts) <= 2048 and min(outs) >= 8 and max(outs) <= 1024
    # log-normal with mean m and sigma s has median m * exp(-s^2 / 2): 256 * e^-0.5 = 155.3, 192 * e^-0.32 = 139.4
    assert statistics.median(prompts) == pytest.approx(256 * math.exp(-0.5), rel=0.06)
    assert statistics.median(outs) == pytest.approx(192 * math.exp(-0.32), rel=0.06)
    assert statistics.stdev(math.log(x) for x in prompts) == pytest.approx(1.0, rel=0.06)


def test_poisson_arrivals_are_seeded_with_the_asked_rate():
    ts = arrival_times(5000, 4.0, seed=0)
    assert ts == arrival_times(5000, 4.0, seed=0) and ts != arrival_times(5000, 4.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *ts[:-1]], ts, strict=True)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.06)  # exponential: CV 1


def test_load_needs_exactly_one_mode():
    with pytest.raises(ValueError, match="exactly one"):
        Load(concurrency=2, rate=1.0)
    with pytest.raises(ValueError, match="--rate"):
        Load(rate=0)


def test_read_our_trace_and_mooncake(tmp_path):
    convs = read_trace(DATA / "tiny_trace.jsonl", time_scale=0.5)
    assert len(convs) == 9 and convs[1].arrival_s == 0.5
    assert [m["role"] for m in convs[1].prefix] == ["system", "user", "assistant"] and convs[1].turns[0].user == \
        "ten eleven twelve"
    assert n_words(convs[3].turns[0].user) == 100 and convs[3].turns[0].max_tokens == 40
    moon = read_trace(DATA / "tiny_mooncake.jsonl", mooncake_token_scale=1 / 100)
    assert [c.arrival_s for c in moon] == [0.0, 1.0, 3.0, 4.0, 6.0]
    assert [c.turns[0].max_tokens for c in moon] == [1, 2, 1, 3, 4]  # output_length / 100, at least 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="max_tokens"):
        read_trace(bad)
