"""Prefill/decode disaggregation in the simulator: a request's TTFT is its prefill, the KV's transfer and the
decode replica's first step, to the exact figure; and how `--disagg-prefill` splits a fleet."""

from __future__ import annotations

import pytest

from kvfleet.sim.cost import CostModel
from kvfleet.sim.disagg import Disagg, prefill_count
from kvfleet.sim.fleet import SimConfig, Simulator
from kvfleet.sim.link import PullLink
from kvfleet.sim.workload import Session, SimWorkload, Turn, multi_turn

COST = CostModel(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)
LINK = PullLink(bandwidth_bytes_s=1e6, latency_s=0.001, kv_bytes_per_token=100)  # 9 tokens: 1 + 0.9 ms
WL = SimWorkload((Session(None, 0.0, (Turn(9, 3, (1, 2), 2),)),), block_size=4)


def test_ttft_counts_prefill_transfer_and_the_first_decode_step():
    sim = Simulator(SimConfig(2, "kv", COST, 64, disagg=Disagg(1, LINK)), WL)
    out = sim.run()
    (r,) = sim.results
    assert (r.replica, r.decode_replica) == ("http://prefill-000", "http://decode-001")
    # prefill: one step of 9 tokens (19 ms); transfer 1.9 ms; decode: 3 steps of one sequence (12 ms each)
    assert r.ttft_s == pytest.approx(0.019 + 0.0019 + 0.012)
    assert r.tpot_s == pytest.approx(0.012)
    assert out["sim_seconds"] == round(0.019 + 0.0019 + 3 * 0.012, 3)
    assert (out["prefill_replicas"], out["completed"]) == (1, 1)
    prefill, decode = sim.engines.values()
    assert (prefill.busy_s, decode.busy_s) == (pytest.approx(0.019), pytest.approx(0.036))
    assert (prefill.prefill_tokens, decode.prefill_tokens) == (9, 0)
    assert set(prefill.pool.cached) == {1, 2} and not decode.pool.cached  # the decode side caches nothing


def test_colocated_the_same_request_makes_its_first_token_in_the_prefill_step():
    sim = Simulator(SimConfig(2, "kv", COST, 64), WL)
    sim.run()
    (r,) = sim.results
    assert (r.ttft_s, r.tpot_s, r.decode_replica) == (pytest.approx(0.019), pytest.approx(0.012), None)


def test_a_disaggregated_fleet_finishes_every_session():
    wl = multi_turn(8, seed=2, turns=2, mean_user_tokens=60, reply_tokens=20, output_tokens=5,
                    system_tokens=40, session_rate=4.0, think_s=0.1, block_size=16)
    out = Simulator(SimConfig(4, "kv", COST, 1 << 12, disagg=Disagg(3, LINK)), wl).run()
    assert (out["completed"], out["dropped"], out["prefill_replicas"]) == (16, 0, 3)
    assert out["block_hit_rate"] > 0  # follow-ups find their history on the prefill replicas


def test_prefill_count():
    assert [prefill_count(s, 16) for s in ("3:1", "1:3", "1:1", "7:1", "15:1", "12")] == [12, 4, 8, 14, 15, 12]
    assert prefill_count("1:100", 8) == 1 and prefill_count("100:1", 8) == 7  # one of each at least
    for bad in ("16", "0", "0:1", "a:b", "1:1:1"):
        with pytest.raises(ValueError):
            prefill_count(bad, 16)
    with pytest.raises(ValueError):
        SimConfig(2, "kv", COST, 64, disagg=Disagg(2))
