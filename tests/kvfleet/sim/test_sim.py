"""The fleet simulator: a hand-computed case reproduced exactly, deterministic workloads, the router's exact
index mirroring the engines' real block pools, autoscaling, and the `kvfleet sim` command."""

from __future__ import annotations

import json

import pytest

from kvfleet.cli import main as kvfleet_main
from kvfleet.sim.cost import CostModel
from kvfleet.sim.fleet import Autoscale, SimConfig, Simulator
from kvfleet.sim.workload import Session, SimWorkload, Turn, mooncake, multi_turn
from router.config import ScoringConfig

COST = CostModel(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)


def _one_turn(t: float, prompt: int, output: int, hashes: tuple[int, ...], blocks: int) -> Session:
    return Session(None, t, (Turn(prompt, output, hashes, blocks),))


def test_two_replicas_four_requests_by_hand():
    # block size 4. At t=0 two cold requests: least load puts them on replica 0 and 1; at t=1 each repeats one
    # of them and the kv index (fed by the engines' KV events) sends it home for a 2-block hit.
    wl = SimWorkload((_one_turn(0.0, 9, 2, (1, 2), 2), _one_turn(0.0, 9, 1, (11, 12), 2),
                      _one_turn(1.0, 9, 2, (1, 2), 2), _one_turn(1.0, 13, 1, (11, 12, 13), 3)), block_size=4)
    sim = Simulator(SimConfig(2, "kv", COST, kv_tokens_per_replica=64), wl)
    out = sim.run()
    got = [(r.replica[-1], r.hit_blocks, r.ttft_s, r.predicted_cached_tokens) for r in sim.results]
    # TTFT = one step: 10 ms + 1 ms per uncached prompt token (9, 9, then 1 and 5 after the 8-token hits)
    assert got == [("0", 0, pytest.approx(0.019), 0), ("1", 0, pytest.approx(0.019), 0),
                   ("0", 2, pytest.approx(0.011), 8), ("1", 2, pytest.approx(0.015), 8)]
    assert out["block_hit_rate"] == round(4 / 9, 4)
    assert (out["ttft_p50"], out["ttft_p99"], out["max_over_mean_load"]) == (0.015, 0.019, 1.0)
    # request 0 decodes its second token in a 12 ms step (10 + 2 per sequence); request 2 ends at 1.011 + 0.012
    assert out["sim_seconds"] == pytest.approx(1.023)
    assert sim.engines["http://replica-000"].busy_s == pytest.approx(0.019 + 0.012 + 0.011 + 0.012)
    # the approximate index (where requests went) routes this case the same way
    approx = Simulator(SimConfig(2, "approx-prefix", COST, kv_tokens_per_replica=64), wl)
    approx.run()
    assert [(r.replica, r.hit_blocks) for r in approx.results] == [(r.replica, r.hit_blocks) for r in sim.results]


def test_prefill_weight_keeps_a_follow_up_home_behind_a_short_queue():
    # replica 0 holds A's 32-token history; B (sharing 3 of its blocks) has just gone there with 5 uncached
    # tokens when A's follow-up (45 tokens, 13 uncached there) comes:
    # weight 1: 13 + 5 (B pending) + 32 (B running) = 50 > 45 at the idle replica → moves and misses;
    # weight 3: 39 + 5 + 32 = 76 < 135 → stays, hits its 8 blocks, and its first token comes sooner
    hist = tuple(range(1, 9))
    wl = SimWorkload((_one_turn(0.0, 33, 1, hist, 8), _one_turn(0.6, 17, 1, (1, 2, 3, 100), 4),
                      _one_turn(0.601, 45, 1, (*hist, 9, 10), 11)), block_size=4)
    moved = Simulator(SimConfig(2, "kv", COST, 256, ScoringConfig(prefill_weight=1.0)), wl)
    moved.run()
    stayed = Simulator(SimConfig(2, "kv", COST, 256), wl)
    stayed.run()
    assert [(r.replica[-1], r.hit_blocks) for r in moved.results] == [("0", 0), ("0", 3), ("1", 0)]
    assert [(r.replica[-1], r.hit_blocks) for r in stayed.results] == [("0", 0), ("0", 3), ("0", 8)]
    # moved: 45 tokens on the idle replica, 55 ms; stayed: behind B's 15 ms step, then 13 tokens: 14 + 23 ms
    assert moved.results[2].ttft_s == pytest.approx(0.055)
    assert stayed.results[2].ttft_s == pytest.approx(0.014 + 0.023)


def test_exact_index_mirrors_the_engines_block_pools_through_evictions():
    wl = multi_turn(12, seed=1, turns=3, mean_user_tokens=60, reply_tokens=20, output_tokens=4,
                    system_tokens=40, concurrency=4, think_s=0.1, block_size=16)
    sim = Simulator(SimConfig(3, "kv", COST, kv_tokens_per_replica=16 * 40), wl)  # 40 blocks: evicts
    out = sim.run()
    assert out["completed"] == wl.num_requests == 36
    assert sum(e.pool.num_evictions for e in sim.engines.values()) > 0
    for url, e in sim.engines.items():
        assert sim.index.num_blocks(url) == len(e.pool.cached)
        assert sim.index.matched_blocks(tuple(e.pool.cached), [url])[url] >= 0
        assert set(sim.index._blocks[url]) == set(e.pool.cached)


def test_generated_sessions_are_deterministic_for_a_seed():
    a = multi_turn(5, seed=3, session_rate=2.0)
    assert a == multi_turn(5, seed=3, session_rate=2.0)
    assert a != multi_turn(5, seed=4, session_rate=2.0)
    s = a.sessions[0]
    # each turn's prompt extends the previous one: its leading block hashes are the previous turn's
    for prev, nxt in zip(s.turns, s.turns[1:], strict=False):
        assert nxt.block_hashes[:len(prev.block_hashes)] == prev.block_hashes
    assert [x.start_s for x in a.sessions] == sorted(x.start_s for x in a.sessions)


def test_mooncake_trace_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 3]})) + "\n")
    monkeypatch.setenv("KVFLEET_MOONCAKE_TRACE", str(path))
    wl = mooncake(time_scale=2.0)
    assert wl.block_size == 512 and wl == mooncake(path, time_scale=2.0)
    # 1,100 tokens: 2 cacheable full blocks (the third is partial); 1,025: 2 (never the last prompt token)
    assert [(s.start_s, s.turns[0].block_hashes, s.turns[0].num_blocks) for s in wl.sessions] == \
        [(0.0, (0, 1), 3), (3.0, (0, 1), 3)]
    out = Simulator(SimConfig(2, "kv", COST, 4096), wl).run()
    assert out["block_hit_rate"] == round(2 / 6, 4)  # the second request finds both blocks on the first's replica


def test_autoscaling_follows_the_hpa(tmp_path):
    wl = multi_turn(60, seed=0, turns=2, mean_user_tokens=100, reply_tokens=20, output_tokens=20,
                    session_rate=3.0, think_s=0.2, block_size=16)
    auto = Autoscale(min_replicas=1, max_replicas=3, scale_down_stabilization_s=30, sync_s=5, start_s=2)
    out = Simulator(SimConfig(1, "kv", COST.scaled(0.25), 1 << 14, autoscale=auto), wl).run()
    counts = [n for _, n in out["replicas_over_time"]]
    assert counts[0] == 1 and max(counts) == 3


def test_kvfleet_sim_command(capsys):
    assert kvfleet_main(["sim", "--format", "sessions", "--sessions", "6", "--replicas", "2", "--policy",
                         "session", "--output-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 24 and out["completed"] == 24
    for key in ("block_hit_rate", "max_over_mean_load", "ttft_p50", "ttft_p99", "follow_ups_home"):
        assert key in out


def test_a_follow_up_pulls_its_history_to_the_idle_replica():
    """test_prefill_weight_keeps_a_follow_up_home_behind_a_short_queue's case with peer pulls over a link of
    1 MB/s, 1 ms set-up, 100 bytes per token (0.1 prefill tokens per pulled token, 1 per pull): A's follow-up
    costs 3 * 13 + 1 + 3.2 at the idle replica against 76 at home, goes there and pulls its 8 blocks first."""
    from kvfleet.sim.link import PullLink

    hist = tuple(range(1, 9))
    wl = SimWorkload((_one_turn(0.0, 33, 1, hist, 8), _one_turn(0.6, 17, 1, (1, 2, 3, 100), 4),
                      _one_turn(0.601, 45, 1, (*hist, 9, 10), 11)), block_size=4)
    link = PullLink(bandwidth_bytes_s=1e6, latency_s=0.001, kv_bytes_per_token=100)
    assert link.seconds(32) == pytest.approx(0.0042)
    sim = Simulator(SimConfig(2, "kv", COST, 256, pull=link), wl)
    out = sim.run()
    assert [(r.replica[-1], r.hit_blocks, r.predicted_cached_tokens) for r in sim.results] == \
        [("0", 0, 0), ("0", 3, 12), ("1", 8, 32)]  # B stays home (15 < 3 * 5 + 1 + 1.2 there); A pulls
    assert (out["pulls"], out["pulled_blocks"]) == (1, 8)
    assert sim.results[2].ttft_s == pytest.approx(0.0042 + 0.023)  # the pull, then 13 tokens in one step
    for url, e in sim.engines.items():  # the pulled blocks reached the router's index in the puller's events
        assert set(sim.index._blocks[url]) == set(e.pool.cached)
    assert set(hist) <= set(sim.engines["http://replica-001"].pool.cached)


def test_a_simulated_engine_computes_a_new_prefix_once_for_requests_that_arrive_together():
    """As the engine's scheduler: b shares a's 3 new blocks and waits while a computes them (c, unrelated, goes
    first), then hits all three and computes only its own last block."""
    from kvfleet.sim.engine import SimEngine, SimSeq

    eng = SimEngine("e", num_blocks=64, block_size=4, cost=COST, max_batched_tokens=8)
    a = SimSeq(0, (1, 2, 3), 12, 1, 0.0)
    b = SimSeq(1, (1, 2, 3, 4), 16, 1, 0.0)
    c = SimSeq(2, (9,), 4, 1, 0.0)
    for s in (a, b, c):
        eng.add(s, 0.0)
    steps = []
    now = 0.0
    while eng.plan is not None:
        steps.append(sorted((s.rid, n) for s, n in eng.plan.chunks))
        now += eng.plan.dt * eng.plan.steps
        eng.finish(now)
        eng.start(now)
    assert steps == [[(0, 8)], [(0, 4), (2, 4)], [(1, 4)]]
    assert b.hit_blocks == 3 and eng.prefill_tokens == 12 + 4 + 4
