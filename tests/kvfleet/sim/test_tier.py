"""The simulator's lower KV tier: evictions spill to it, a prompt continuing there reloads instead of prefilling
(exact block counts and times), and the router's index mirrors both the pools and the tiers."""

from __future__ import annotations

import pytest

from kvfleet.sim.cost import CostModel
from kvfleet.sim.fleet import SimConfig, Simulator
from kvfleet.sim.link import PullLink
from kvfleet.sim.tier import TierSpec
from kvfleet.sim.workload import Session, SimWorkload, Turn, multi_turn

COST = CostModel(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)
LINK = PullLink(bandwidth_bytes_s=1e6, latency_s=0.001, kv_bytes_per_token=100)  # 8 tokens: 1 + 0.8 ms


def _one_turn(t: float, prompt: int, output: int, hashes: tuple[int, ...]) -> Session:
    return Session(None, t, (Turn(prompt, output, hashes, len(hashes)),))


# block size 4, one replica of 6 blocks. A (blocks 1, 2) finishes; B needs all 6 blocks and evicts 1 and 2; C
# repeats A's prompt: its 2 blocks are in the tier (with one) or gone (without)
WL = SimWorkload((_one_turn(0.0, 9, 1, (1, 2)), _one_turn(1.0, 17, 7, (11, 12, 13, 14)),
                  _one_turn(2.0, 9, 1, (1, 2))), block_size=4)


def test_evicted_blocks_reload_from_the_tier_instead_of_prefilling():
    sim = Simulator(SimConfig(1, "kv", COST, kv_tokens_per_replica=24, tier=TierSpec(1 / 3, LINK)), WL)  # 2 blocks
    out = sim.run()
    engine = sim.engines["http://replica-000"]
    assert engine.tier is not None
    a, b, c = sim.results
    assert (a.hit_blocks, b.hit_blocks, c.hit_blocks, c.reloaded_blocks) == (0, 0, 2, 2)
    assert c.predicted_cached_tokens == 8  # the router saw them in the tier's events
    # C: its 8 tokens reloaded (1 ms + 800 bytes at 1 MB/s) in the step that prefills its last token
    assert c.ttft_s == pytest.approx(0.0018 + 0.010 + 0.001)
    assert out["tier_reloaded_blocks"] == engine.reloaded_blocks == 2
    assert out["block_hit_rate"] == round(2 / 8, 4)
    # evictions: B took 1 and 2 (spilled to the tier), C took 14 (spilled; the tier, full, let 1 go: the pool
    # holds it again)
    assert engine.pool.num_evictions == 3 and engine.tier.spilled_blocks == 3
    assert engine.tier.hashes() == [2, 14]
    assert set(engine.pool.cached) == {1, 2, 11, 12, 13}
    assert set(sim.index._blocks[engine.name]) == set(engine.pool.cached)
    assert sim.index._tier[engine.name] == {2, 14}


def test_without_a_tier_the_evicted_prompt_is_prefilled_again():
    sim = Simulator(SimConfig(1, "kv", COST, kv_tokens_per_replica=24), WL)
    out = sim.run()
    c = sim.results[2]
    assert (c.hit_blocks, c.reloaded_blocks, c.ttft_s) == (0, 0, pytest.approx(0.010 + 0.009))
    assert "tier_reloaded_blocks" not in out


def test_the_index_mirrors_pools_and_tiers_through_evictions():
    wl = multi_turn(12, seed=1, turns=3, mean_user_tokens=60, reply_tokens=20, output_tokens=4,
                    system_tokens=40, concurrency=4, think_s=0.1, block_size=16)
    # 30 blocks per replica: with bursts kept on the replica computing them (in-flight prefixes), 40 evicted too
    # little to reach the tier's reloads
    sim = Simulator(SimConfig(3, "kv", COST, kv_tokens_per_replica=16 * 30, tier=TierSpec(0.5, LINK)), wl)
    out = sim.run()
    assert out["completed"] == 36 and out["tier_reloaded_blocks"] > 0
    for url, e in sim.engines.items():
        assert e.tier is not None and len(e.tier) <= 15
        assert set(sim.index._blocks[url]) == set(e.pool.cached)
        assert sim.index._tier.get(url, set()) == set(e.tier.hashes())
