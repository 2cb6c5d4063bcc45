"""A real Prometheus (`kvfleet up --prometheus`) scraping a real local fleet: every PromQL expression of the
dashboards and rules parses and evaluates there, and - with the bundled model's engines under load - returns
data, except the series listed below by name; the HPA algorithm replayed on the KV-usage and waiting series
recorded in that run scales up under load and back down after; every panel renders to PNG.

The fast test runs the fake engines (loadtest/fake_engine.py: the HTTP surface without a model, and only a
few engine metrics), so it checks parsing, scraping and rule health; the slow one runs two engines of the
bundled model for about two minutes."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from dashboards import GRAFANA_DIR
from dashboards.expressions import alert_operands, all_expressions, dashboard_expressions, panels, substitute
from dashboards.promapi import PrometheusAPI
from dashboards.render import main as render_main
from dashboards.render import render_dashboard
from deploy.hpa import DEFAULT_SCALE_UP, HPASpec, MetricTarget, ScalingRules, replay
from deploy.prometheus import require_binaries
from tests.dashboards.fleet_load import MixedLoad, tenants_yaml
from tests.deploy.test_local import alive, descendants, read_until, start_up

require_binaries()  # `make test` unpacks Debian's prometheus package; without it these tests fail loudly

# Series an expression may lack data for here, by name (an expression naming one is still sent and must
# parse and evaluate): why each cannot have data in a local CPU fleet.
NO_DATA_HERE = {
    "kube_": "kube-state-metrics: only in a Kubernetes cluster",
    "kvfleet:gpu_memory_used_bytes": "exported only by engines on CUDA",
    "kvfleet_router_upstream_failures_total": "only after a failed upstream attempt",
    "kvfleet_router_retries_total": "only after a retried request",
    "kvfleet_router_pool_degradation_changes_total": "only after a pool changed its degradation level",
    "kvfleet_router_pool_max_tokens_lowered_total": "only when a pool's cap lowered a request (no caps here)",
    "kvfleet_router_disagg_prefills_total": "only in a disaggregated pool (this fleet is colocated)",
    "kvfleet_router_migration": "only after a stream moved off a failing replica (none fails here)",
    "kvfleet_router_queued_requests": "only while a request waits for room at the router (engines have room here)",
    "kvfleet_router_queue_": "only after a request waited for room at the router",
    "kvfleet_router_slo_": "only for requests with latency targets (this load sends none)",
    "kvfleet_router_pool_no_ready_replica_total": "only after a pool had no ready replica",
}
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
NOT_YET: dict[str, str] = {}  # series that do not exist yet: must parse, data not checked
RECORDED = Path(__file__).parent / "data" / "recorded_load.json"


def excepted(expr: str) -> str | None:
    for name, why in {**NO_DATA_HERE, **NOT_YET}.items():
        if name in expr:
            return f"{name}: {why}"
    return None


def prometheus_url(banner: str) -> str:
    m = re.search(r"Prometheus \(kvfleet's recording rules and alerts\): (http://\S+)", banner)
    assert m, banner
    return m.group(1)


def wait_until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def check_scraping(api: PrometheusAPI, n_engines: int) -> None:
    def all_up():
        ts = api.targets()
        return len(ts) == n_engines + 1 and all(t["health"] == "up" for t in ts)
    wait_until(all_up, 30, f"{n_engines} engines and a router up in Prometheus")
    jobs = {(t["labels"]["job"], t["labels"].get("pool")) for t in api.targets()}
    assert jobs == {("kvfleet-engine", "default"), ("kvfleet-router", None)}


def check_rules_healthy(api: PrometheusAPI) -> None:
    def evaluated():
        groups = api.rules()
        return groups and all(r.get("lastEvaluation", "").startswith("20") for g in groups for r in g["rules"])
    wait_until(evaluated, 30, "every rule evaluated once")
    rules = [r for g in api.rules() for r in g["rules"]]
    assert len(rules) == len([e for e in all_expressions() if e.kind != "panel"])
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad


def check_every_expression_parses(api: PrometheusAPI) -> None:
    for e in all_expressions():
        api.query(substitute(e.expr))  # raises PromQLError on a parse or evaluation error


def test_fake_fleet_prometheus_scrapes_and_every_expression_parses(tmp_path):
    proc, port = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "2", "--prometheus",
                          "--prometheus-interval", "1", "--", "--kv-usage", "0.4", "--waiting", "1")
    try:
        banner = read_until(proc, "Ctrl-C to stop", 60)
        kids = descendants(proc.pid)
        with PrometheusAPI(prometheus_url(banner)) as api:
            check_scraping(api, 2)
            check_rules_healthy(api)
            check_every_expression_parses(api)
            usage = wait_until(lambda: api.query("pool:vllm_kv_cache_usage_perc:avg"), 15, "a recorded KV usage")
            assert usage[0]["metric"] == {"__name__": "pool:vllm_kv_cache_usage_perc:avg", "pool": "default"}
            assert float(usage[0]["value"][1]) == pytest.approx(0.4)
            url = api.url
        out = tmp_path / "png"
        assert render_main(["--prometheus", url, "--out", str(out), "--minutes", "1"]) == 0
        pngs = sorted(p.name for p in out.rglob("*.png"))
        assert len(pngs) == 2 + sum(len(panels(GRAFANA_DIR / f"{d}.json")) for d in ("kvfleet-fleet", "kvfleet-replica"))
        assert "01-kv-cache-usage.png" in pngs and "kvfleet-fleet.png" in pngs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        assert not [p for p in kids if alive(p)]  # Prometheus stopped with the fleet
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _series(api: PrometheusAPI, expr: str, start: float, end: float) -> list[tuple[float, float]]:
    result = api.query_range(expr, start, end, 1)
    assert len(result) == 1, (expr, result)
    return [(float(t), float(v)) for t, v in result[0]["values"]]


HPA_SPEC = HPASpec(min_replicas=1, max_replicas=8,
                   metrics=(MetricTarget("kv_cache_usage", 0.5), MetricTarget("waiting", 2.0)),
                   scale_up=DEFAULT_SCALE_UP, scale_down=ScalingRules(10, DEFAULT_SCALE_UP.policies[:1]))


def hpa_replay(recorded: dict) -> list[int]:
    times = [t for t, _ in recorded["kv_cache_usage"]]
    series = {name: [v for _, v in points] for name, points in recorded.items()}
    return [d.desired for d in replay(HPA_SPEC, times, series, start_replicas=2)]


def test_hpa_on_the_recorded_run_scales_up_under_load_and_back_down():
    """The series recorded by the slow test below (committed): 2 engines, idle, ~40 s of load, idle."""
    assert_up_then_down(hpa_replay(json.loads(RECORDED.read_text())))


def assert_up_then_down(desired: list[int]) -> None:
    """Idle at first (down to min 1), above the 2 running replicas under load, back to 1 after."""
    assert desired[0] == 1
    up = next(i for i, d in enumerate(desired) if d > 2)
    down = next(i for i in range(up, len(desired)) if desired[i] == 1)
    assert max(desired) >= 3 and all(d == 1 for d in desired[down:]) and len(desired) - down >= 5


@pytest.mark.slow
@pytest.mark.model
def test_real_fleet_every_expression_has_data_and_the_hpa_follows_the_load(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    proc, port = start_up(tmp_path, "--replicas", "2", "--prometheus", "--prometheus-interval", "1",
                          "--tenants", str(tenants), "--", "--max-num-seqs", "4", "--num-blocks", "40",
                          "--speculative-config", SPEC)  # so the speculative decoding row has data
    try:
        banner = read_until(proc, "Ctrl-C to stop", 600)
        with PrometheusAPI(prometheus_url(banner)) as api:
            check_scraping(api, 2)
            t0 = time.time()
            time.sleep(5)
            counts = MixedLoad(f"http://127.0.0.1:{port}", threads=16, seconds=40).run()
            print("load:", counts)
            assert counts.get("stream-200", 0) > 20 and counts.get("cancelled", 0) > 0
            assert counts.get("400", 0) > 0 and counts.get("tiny-429", 0) > 0
            time.sleep(20)  # idle: KV usage and queues back to 0
            t1 = time.time()
            check_rules_healthy(api)
            missing, skipped = [], []
            for e in all_expressions():
                exprs = alert_operands(e.expr) if e.kind == "alert" else [e.expr]
                for expr in exprs:
                    expr = substitute(expr, "30s")
                    result = api.query_range(expr, t0, t1, 2)  # parses and evaluates, or raises
                    why = excepted(expr)
                    if why:
                        skipped.append((e.source, expr, why))
                    elif not result:
                        missing.append((e.source, expr))
            print("excepted from the data check:\n" + "\n".join(f"  {s}: {x}  ({w})" for s, x, w in skipped))
            assert not missing, "no data:\n" + "\n".join(f"{s}: {x}" for s, x in missing)

            recorded = {"kv_cache_usage": _series(api, "sum(vllm:kv_cache_usage_perc)", t0, t1),
                        "waiting": _series(api, "sum(vllm:num_requests_waiting)", t0, t1)}
            if os.environ.get("KVFLEET_RECORD_LOAD"):  # refresh the committed recording
                RECORDED.parent.mkdir(exist_ok=True)
                RECORDED.write_text(json.dumps(recorded) + "\n")
            desired = hpa_replay(recorded)
            print("HPA desired replicas, one per second:", desired)
            assert_up_then_down(desired)

            out = Path(os.environ.get("KVFLEET_RENDER_DIR", tmp_path / "png"))
            for path in sorted({Path(e.source.split(":")[0]) for e in dashboard_expressions()}):
                rendered = render_dashboard(api, GRAFANA_DIR / path, out, minutes=(time.time() - t0) / 60 + 0.5,
                                            step=2, rate_interval="30s")
                assert all(r.path.stat().st_size > 5000 and not r.errors for r in rendered)
                with_data = [r.title for r in rendered if r.lines]
                print(f"{path}: {len(rendered)} panels, {len(with_data)} with data")
                assert (out / f"{path.stem}.png").stat().st_size > 50_000
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
