"""The router benchmarks run end to end at tiny sizes (fake engines; figures are not asserted as targets,
only that they are produced and sane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.router.conftest import ROOT

pytestmark = pytest.mark.model  # the kv router and the bench load the SmolLM2 tokenizer


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "loadtest.router_bench", *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_overhead_bench_smoke(tmp_path):
    r = run_bench(tmp_path, "overhead", "--requests", "50", "--duration", "1", "--concurrency", "4",
                  "--client-procs", "1", "--policy", "kv")
    assert r["router_streamed_rps"] > 0 and r["router_stream_errors"] == 0 and r["direct_streamed_rps"] > 0
    assert r["stream_router_p50_ms"] > 0 and r["json_router_cpu_ms_per_request"] > 0
    assert 0 < r["decision_mean_us"] < 1e5


@pytest.mark.slow  # benchmark-like (15 s): the router's policies are tested without it
def test_policies_bench_smoke_with_fake_engines(tmp_path):
    r = run_bench(tmp_path, "policies", "--engine-module", "loadtest.fake_engine", "--api", "tokens",
                  "--policies", "kv,round-robin", "--sessions", "5", "--turns", "3", "--concurrency", "1",
                  "--system-tokens", "64")
    res = r["results"]
    assert set(res) == {"kv", "round-robin", "single-replica-whole-cache"}
    assert all(x["requests"] == 15 and x["errors"] == 0 for x in res.values())
    assert res["kv"]["follow_ups_home"] == 1.0 and res["round-robin"]["follow_ups_home"] == 0.0
    assert res["kv"]["hit_rate"] > res["round-robin"]["hit_rate"]
    assert res["kv"]["hit_rate"] == res["kv"]["usage_hit_rate"]  # engines' counters = per-request usage
    assert 0.5 < r["summary"]["kv_hit_rate_vs_single_whole_cache"] <= 1.0


@pytest.mark.slow  # benchmark-like (15 s)
def test_models_overhead_bench_smoke(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "loadtest.models_overhead", "--requests", "50", "--duration", "1",
                           "--concurrency", "4", "--client-procs", "1", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert min(r["one_model_streamed_rps"], r["one_model_one_pool_streamed_rps"], r["two_models_streamed_rps"]) > 0
    assert r["stream_two_models_added_p50_ms"] > 0 and "json_models_cost_p50_ms" in r
