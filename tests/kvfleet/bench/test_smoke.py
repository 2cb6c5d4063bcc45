"""`kvfleet bench` end to end: through a kvfleet router in front of two fake engines (loadtest/fake_engine.py),
against failing engines, and against a real engine (SmolLM2), a few seconds each."""

from __future__ import annotations

import json

import pytest

from kvfleet.bench import cli
from kvfleet.bench.records import RequestRecord
from tests.router.conftest import fake_engine, free_port, module_procs, procs, router  # noqa: F401 (fixtures)


def run_bench(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = cli.main(["run", *args, "--out", str(out), "--no-progress", "--metrics-interval", "0.2"])
    return rc, json.loads(out.read_text())


def test_through_a_router_multi_turn_and_report(procs, tmp_path, capsys):  # noqa: F811
    engines = [fake_engine(procs, f"f{i}", "--kv-usage", "0.25").wait_ready() for i in range(2)]
    r = router(procs, [e.url for e in engines], policy="round-robin").wait_ready()
    rc, res = run_bench(tmp_path, "--target", r.url, "--name", "fleet", "--scenario", "multi-turn", "--scale",
                        "0.1", "--num", "3", "--concurrency", "2", "--slo-ttft-ms", "5000")
    assert rc == 0
    assert sorted(res["metrics_urls"]) == sorted(e.url for e in engines)  # found through the router's /metrics
    (run,) = res["runs"]
    s = run["summary"]
    assert s["requests"] == 12 and s["failed"] == 0 and s["good"] == 12  # 3 conversations x 4 turns
    recs = [RequestRecord.from_json(d) for d in run["records"]]
    assert sorted((r.session, r.turn) for r in recs) == sorted((f"multi-turn-0-{i}", k) for i in range(3)
                                                               for k in range(4))
    assert all(r.output_tokens == 6 and len(r.chunk_s) == 6 for r in recs)  # 64 x 0.1 tokens; fake: one per chunk
    assert run["fleet"]["kv_usage_max"] == 0.25
    # a second run and the side-by-side report with plots
    rc2, _ = run_bench(tmp_path / "b", "--target", engines[0].url, "--name", "one", "--scenario", "multi-turn",
                       "--scale", "0.1", "--num", "3", "--concurrency", "2")
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "result.json"), str(tmp_path / "b" / "result.json"), "--plots",
                     str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "| fleet | multi-turn | concurrency 2 | 12/12 |" in out and "| one | multi-turn | concurrency 2 | 12/12 |" in out
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "fleet_over_time.png").exists()


def test_open_loop_sweep_and_errors_by_type(procs, tmp_path):  # noqa: F811
    ok = fake_engine(procs, "ok").wait_ready()
    rc, res = run_bench(tmp_path, "--target", ok.url, "--scenario", "short-short", "--scale", "0.1", "--num", "4",
                        "--rates", "20", "40")
    assert rc == 0 and [run["load"] for run in res["runs"]] == ["rate 20/s", "rate 40/s"]
    bad = fake_engine(procs, "bad", "--fail-status", "429").wait_ready()
    rc, res = run_bench(tmp_path / "b", "--target", bad.url, "--scenario", "short-short", "--num", "3",
                        "--concurrency", "2")
    assert rc == 1 and res["runs"][0]["summary"]["errors"] == {"http_429": 3}


@pytest.mark.parametrize("args, flag", [
    (["--target", "localhost:8000"], "--target"),
    (["--target", "http://x", "--num", "0"], "--num"),
    (["--target", "http://x", "--replay-times"], "--replay-times"),
    (["--target", "http://x", "--trace", "/nonexistent.jsonl"], "--trace"),
    (["--target", "http://x", "--rate", "0"], "--rate"),
])
def test_bad_flags_name_themselves(args, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", *args, "--no-progress"])
    assert flag in str(e.value)


def test_report_rejects_non_results(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(SystemExit, match="not a kvfleet bench result"):
        cli.main(["report", str(p)])


@pytest.mark.model
@pytest.mark.slow  # the bench against a real engine (~20 s loaded); the same flow runs above against fake engines
def test_real_engine_multi_turn_resends_history(procs, tmp_path):  # noqa: F811
    port = free_port()
    engine = procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "2",
                    "--log-level", "warning"], f"http://127.0.0.1:{port}", "engine").wait_ready(timeout=300)
    rc, res = run_bench(tmp_path, "--target", engine.url, "--scenario", "multi-turn", "--scale", "0.1", "--num", "2",
                        "--concurrency", "2")
    assert rc == 0
    (run,) = res["runs"]
    recs = sorted((RequestRecord.from_json(d) for d in run["records"]), key=lambda r: (r.session, r.turn))
    assert all(r.output_tokens == 6 and r.ttft_s > 0 for r in recs)  # ignore_eos: exactly max_tokens
    for a, b in zip(recs, recs[1:], strict=False):
        if a.session == b.session:  # the next turn carries this turn's prompt, its reply and a new user message
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens
    assert run["fleet"]["prefix_hit_rate"] > 0  # later turns hit the blocks of earlier ones
