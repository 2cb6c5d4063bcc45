"""SLO attainment and goodput (DistServe's definitions) on hand-made latencies, and the goodput table's run."""

from __future__ import annotations

import pytest

from kvfleet.sim.goodput import at_rate, main, request_rate
from kvfleet.sim.slo import SLO, Latency, attainment, goodput, percentile
from kvfleet.sim.workload import Session, SimWorkload


def test_attainment_needs_both_targets():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    lat = [Latency(0.5, 0.05), Latency(1.0, 0.1),  # met (the targets are inclusive)
           Latency(1.5, 0.05), Latency(0.5, 0.2),  # TTFT missed, TPOT missed
           Latency(None, None),  # dropped: missed
           Latency(0.9, None)]  # one output token: judged on TTFT alone
    assert attainment(lat, slo) == pytest.approx(3 / 6)
    assert attainment([], slo) == 0.0
    assert slo.scaled(4.0) == SLO(0.25, 0.025)


def test_goodput_is_the_highest_rate_before_the_first_shortfall():
    points = [(4.0, 0.91), (1.0, 0.95), (3.0, 0.85), (2.0, 0.90)]
    assert goodput(points, 0.9) == 2.0  # 4.0 meets the goal again, past a shortfall: not counted
    assert goodput([(1.0, 0.5)], 0.9) == 0.0
    assert goodput([(1.0, 1.0), (2.0, 0.99)], 0.9) == 2.0


def test_percentile_is_nearest_rank():
    xs = [float(i) for i in range(1, 11)]
    assert (percentile(xs, 0.5), percentile(xs, 0.9), percentile(xs, 0.99), percentile([], 0.9)) == (5.0, 9.0, 10.0, 0.0)


def test_slo_rejects_bad_targets():
    for args in ((0.0, 0.1), (1.0, -1.0), (1.0, 0.1, 0.0)):
        with pytest.raises(ValueError):
            SLO(*args)


def test_at_rate_divides_arrival_times():
    wl = SimWorkload((Session(None, 0.0, ()), Session(None, 10.0, ())), block_size=4)
    fast = at_rate(wl, 2.0)
    assert [s.start_s for s in fast.sessions] == [0.0, 5.0]
    assert request_rate(wl) == 0.0 and fast.block_size == 4


def test_goodput_table(capsys):
    assert main(["--format", "sessions", "--sessions", "6", "--session-rate", "2", "--output-tokens", "4",
                 "--replicas", "4", "--splits", "colocated,1:1", "--rates", "0.5,1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert [row.split(" | ")[1] for row in rows] == ["colocated", "1:1 (2P + 2D)"]


def test_the_simulated_router_fits_its_ttft_model_and_places_by_the_target():
    from kvfleet.sim.cost import CostModel
    from kvfleet.sim.fleet import SimConfig, Simulator
    from kvfleet.sim.workload import multi_turn

    wl = multi_turn(24, seed=3, turns=3, mean_user_tokens=80, reply_tokens=20, output_tokens=8,
                    system_tokens=64, concurrency=6, think_s=0.05, block_size=16)
    cost = CostModel(base_s=0.01, prefill_token_s=0.0005, decode_seq_s=0.002)
    sim = Simulator(SimConfig(3, "kv", cost, 16 * 400, ttft_target_s=0.2, slo_unattainable="best_effort"), wl)
    out = sim.run()
    model = sim.router.placement.ttft
    assert out["completed"] == 72 and model.ready and len(model.samples) == 72  # every first token observed


@pytest.mark.parametrize("target_s, refused", [(100.0, False), (0.002, True)])
def test_the_simulated_router_refuses_what_no_replica_is_predicted_to_meet_as_the_http_router_does(target_s, refused):
    """A 2 ms TTFT target no replica can meet: once the router's TTFT model is fitted, every request is refused (429
    slo_unattainable in the HTTP router): no latency, a miss, and its session goes on; a loose one refuses none."""
    from kvfleet.sim.cost import CostModel
    from kvfleet.sim.fleet import SimConfig, Simulator
    from kvfleet.sim.slo import SLO, attainment
    from kvfleet.sim.workload import multi_turn

    wl = multi_turn(24, seed=3, turns=3, mean_user_tokens=80, reply_tokens=20, output_tokens=8,
                    system_tokens=64, concurrency=6, think_s=0.05, block_size=16)
    cost = CostModel(base_s=0.01, prefill_token_s=0.0005, decode_seq_s=0.002)
    sim = Simulator(SimConfig(3, "kv", cost, 16 * 400, ttft_target_s=target_s), wl)
    out = sim.run()
    model = sim.router.placement.ttft
    assert len(sim.results) == 72 and out["completed"] + out["refused"] == 72  # every turn of every session came
    no_latency = [r for r in sim.results if r.ttft_s is None]
    assert len(no_latency) == out["refused"] and all(r.replica == "" for r in no_latency)
    if refused:  # served until the model was fitted (no prediction: no refusal), refused after
        assert out["completed"] == len(model.samples) and out["refused"] == 72 - len(model.samples) > 0
        assert attainment(sim.latencies(), SLO(target_s, 1.0)) == 0.0
    else:
        assert out["refused"] == 0


def test_a_run_stops_once_more_requests_missed_than_allowed():
    from kvfleet.sim.cost import CostModel
    from kvfleet.sim.fleet import SimConfig, Simulator
    from kvfleet.sim.workload import multi_turn

    wl = multi_turn(24, seed=3, turns=3, mean_user_tokens=80, reply_tokens=20, output_tokens=8,
                    system_tokens=64, concurrency=6, think_s=0.05, block_size=16)
    cost = CostModel(base_s=0.01, prefill_token_s=0.0005, decode_seq_s=0.002)
    whole = Simulator(SimConfig(3, "kv", cost, 16 * 400, ttft_target_s=0.002), wl)
    whole.run()
    assert not whole.stopped and whole.misses == 72  # every first token takes a step of at least 10 ms
    cut = Simulator(SimConfig(3, "kv", cost, 16 * 400, ttft_target_s=0.002, stop_after_misses=20), wl)
    cut.run()
    assert cut.stopped and cut.misses == 21 and cut.now < whole.now
