"""Engine pools through a real router process in front of fake engines (loadtest/fake_engine.py): the canary
share over many sessions, stickiness, the long-context pool and the 400, max_tokens caps and their header,
weights reloaded from the file, automatic rollback of a slow canary, degradation on engine OOMs, shedding."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from tests.router.conftest import fake_engine, metric, router, wait_for

PROMPT = list(range(100, 140))  # 40 token ids: no tokenizer needed

POOLS = """
pools:
  stable:
    version: v1
    weight: {stable}
    replicas: [{s1}, {s2}]
    max_tokens_cap: 16
    default_max_tokens: 6
    max_context_tokens: 100
  canary:
    version: {canary_version}
    weight: {canary}
    canary: true
    replicas: [{c1}]
    max_context_tokens: 100
  long:
    version: v1-long
    weight: 1
    long_context: true
    replicas: [{l1}]
    max_context_tokens: 400
degradation:
  window_s: 3
  min_requests: 5
  interval_s: 0.2
  dwell_s: 1
  p99_ttft_s: {{trip: 0.4, clear: 0.2}}
"""


class Fleet:
    def __init__(self, procs, tmp_path, *router_args):
        self.fakes = {name: fake_engine(procs, name, "--chunks", "4") for name in ("s1", "s2", "c1", "l1")}
        for f in self.fakes.values():
            f.wait_ready()
        self.path = tmp_path / "pools.yaml"
        self.write(stable=80, canary=20)
        self.router = router(procs, None, "--pools", str(self.path), "--log-level", "info", *router_args,
                             policy="session").wait_ready()
        wait_for(lambda: httpx.get(self.router.url + "/ready").json()["ready_replicas"] == 4, what="4 replicas")

    def write(self, stable: int, canary: int, canary_version: str = "v2") -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(POOLS.format(stable=stable, canary=canary, canary_version=canary_version,
                                    **{k: f.url for k, f in self.fakes.items()}))
        tmp.replace(self.path)

    def post(self, session: str | None = None, prompt=PROMPT, stream: bool = False, **body) -> httpx.Response:
        headers = {"x-session-id": session} if session else {}
        return httpx.post(self.router.url + "/v1/completions", json={"prompt": prompt, "stream": stream, **body},
                          headers=headers, timeout=30)

    def metric(self, name: str, **labels) -> float:
        return metric(httpx.get(self.router.url + "/metrics").text, name, **labels)

    def fake(self, name: str, **settings) -> dict:
        if settings:
            httpx.post(self.fakes[name].url + "/fake/set?" + "&".join(f"{k}={v}" for k, v in settings.items()))
        return httpx.get(self.fakes[name].url + "/fake/stats").json()


@pytest.fixture
def fleet(procs, tmp_path):
    return Fleet(procs, tmp_path)


def test_canary_share_over_200_sessions_and_stickiness(fleet):
    first = {}
    for i in range(200):
        resp = fleet.post(f"user-{i}", max_tokens=4)
        assert resp.status_code == 200, resp.text
        first[i] = resp.headers["x-kvfleet-pool"]
    share = sum(p == "canary" for p in first.values()) / 200
    assert 0.15 <= share <= 0.25, share
    assert set(first.values()) == {"stable", "canary"}
    for i in range(0, 200, 4):  # every session keeps its pool, and its replica inside the pool
        again = fleet.post(f"user-{i}", max_tokens=4)
        assert again.headers["x-kvfleet-pool"] == first[i]
    n_canary = sum(p == "canary" for p in first.values())
    assert fleet.metric("kvfleet_router_pool_requests_total", pool="canary", version="v2", status="200") == \
        n_canary + sum(first[i] == "canary" for i in range(0, 200, 4))
    assert fleet.fake("c1")["requests"] == fleet.metric("kvfleet_router_pool_requests_total", pool="canary")
    assert fleet.metric("kvfleet_router_pool_weight", pool="canary", kind="effective") == 20


def test_long_requests_go_to_the_long_context_pool_and_too_long_ones_get_400(fleet):
    before = fleet.fake("l1")["requests"]
    resp = fleet.post("s", prompt=list(range(95)), max_tokens=10)  # 105 > 100: no regular pool fits
    assert resp.status_code == 200 and resp.headers["x-kvfleet-pool"] == "long"
    assert fleet.fake("l1")["requests"] == before + 1
    short = fleet.post("s", prompt=list(range(80)), max_tokens=10)
    assert short.headers["x-kvfleet-pool"] in ("stable", "canary")
    over = fleet.post("s", prompt=list(range(395)), max_tokens=10)
    assert over.status_code == 400
    err = over.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "largest pool context limit of 400 tokens" in err["message"]
    assert fleet.fake("l1")["requests"] == before + 1  # the 400 reached no engine


def test_caps_lower_max_tokens_and_say_so(fleet):
    session = next(s for s in (f"u{i}" for i in range(100))
                   if fleet.post(s, max_tokens=1).headers["x-kvfleet-pool"] == "stable")
    resp = fleet.post(session, max_tokens=500)
    assert resp.status_code == 200 and resp.headers["x-kvfleet-max-tokens-lowered"] == "16"
    served = [n for n in ("s1", "s2") if fleet.fake(n)["last_max_tokens"] == 16]
    assert served
    resp = fleet.post(session)  # no max_tokens: the pool's default, and no header (nothing was lowered)
    assert "x-kvfleet-max-tokens-lowered" not in resp.headers
    assert fleet.fake(served[0])["last_max_tokens"] == 6
    assert fleet.metric("kvfleet_router_pool_max_tokens_lowered_total", pool="stable", version="v1") == 1


def test_weight_zero_in_the_file_drains_the_canary_without_a_restart(fleet):
    canary_sessions = [s for s in (f"u{i}" for i in range(60))
                       if fleet.post(s, max_tokens=1).headers["x-kvfleet-pool"] == "canary"]
    assert canary_sessions
    fleet.write(stable=80, canary=0)
    wait_for(lambda: fleet.metric("kvfleet_router_pool_weight", pool="canary", kind="configured") == 0,
             timeout=5, what="reload")
    before = fleet.fake("c1")["requests"]
    for s in canary_sessions:
        assert fleet.post(s, max_tokens=1).headers["x-kvfleet-pool"] == "stable"
    assert fleet.fake("c1")["requests"] == before
    assert fleet.metric("kvfleet_router_pools_reloads_total", result="ok") == 1
    fleet.write(stable=80, canary=-3)  # a bad file: logged, the pools in force stay
    wait_for(lambda: fleet.metric("kvfleet_router_pools_reloads_total", result="failed") == 1, timeout=5,
             what="failed reload")
    assert re.search(r"pools file not reloaded.*pools\.yaml:12: pools\.canary\.weight", fleet.router.tail(20000))


def _stream_load(fleet, sessions, seconds: float) -> list[tuple[str, int, str]]:
    """Streamed requests from `sessions`, 8 at a time, for `seconds`: (pool, status, body tail) each."""
    deadline = time.monotonic() + seconds

    def one(s):
        out = []
        while time.monotonic() < deadline:
            r = fleet.post(s, stream=True, max_tokens=4)
            out.append((r.headers.get("x-kvfleet-pool", "-"), r.status_code, r.text[-40:]))
        return out

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return [x for chunk in pool.map(one, sessions) for x in chunk]


def test_a_slow_canary_is_rolled_back_with_no_failed_request_and_stays_back(fleet):
    sessions = [s for s in (f"u{i}" for i in range(200)) if fleet.post(s, max_tokens=1).headers[
        "x-kvfleet-pool"] == "canary"][:4] + [s for s in (f"u{i}" for i in range(20)) if fleet.post(
            s, max_tokens=1).headers["x-kvfleet-pool"] == "stable"][:4]
    fleet.fake("c1", delay_ms=600)
    results = _stream_load(fleet, sessions, 6.0)
    assert all(status == 200 and text.endswith("data: [DONE]\n\n") for _, status, text in results), results
    rolled_back = fleet.metric("kvfleet_router_pool_weight", pool="canary", kind="effective") == 0
    assert rolled_back
    assert fleet.metric("kvfleet_router_pool_degradation_changes_total", pool="canary", to="canary_rollback",
                        **{"from": "normal"}) == 1
    log = fleet.router.tail(50000)
    m = re.search(r"pool canary \(v2\): canary rolled back: weight 20 -> 0", log)
    assert m, log[-3000:]
    # after the rollback every session is served by stable; the canary stays back while it is healthy again
    fleet.fake("c1", delay_ms=0)
    time.sleep(2.5)
    assert fleet.metric("kvfleet_router_pool_degradation_level", pool="canary") == 1
    assert all(fleet.post(s, max_tokens=1).headers["x-kvfleet-pool"] == "stable" for s in sessions)
    assert fleet.metric("kvfleet_router_pool_weight", pool="canary", kind="effective") == 0
    # a new version in the file starts it afresh
    fleet.write(stable=80, canary=20, canary_version="v3")
    wait_for(lambda: fleet.metric("kvfleet_router_pool_weight", pool="canary", version="v3", kind="effective")
             == 20, timeout=5, what="canary v3 back")
    assert fleet.post(sessions[0], max_tokens=1).headers["x-kvfleet-pool"] == "canary"


def test_engine_ooms_lower_max_tokens_then_shed_then_recover(procs, tmp_path):
    fleet = Fleet(procs, tmp_path, "--shed-min-cost-tokens", "60")
    session = next(s for s in (f"u{i}" for i in range(100))
                   if fleet.post(s, max_tokens=1).headers["x-kvfleet-pool"] == "stable")
    for n in ("s1", "s2"):
        fleet.fake(n, oom_events=1)
    wait_for(lambda: fleet.metric("kvfleet_router_pool_degradation_level", pool="stable") == 2, timeout=5,
             what="lower_max_tokens")
    assert fleet.post(session, max_tokens=500).headers["x-kvfleet-max-tokens-lowered"] == "8"  # 16 x 0.5
    for n in ("s1", "s2"):
        fleet.fake(n, oom_events=2)
    wait_for(lambda: fleet.metric("kvfleet_router_pool_degradation_level", pool="stable") == 3, timeout=5,
             what="shed")
    shed = fleet.post(session, prompt=list(range(60)), max_tokens=4)  # costs 64 >= 60
    assert shed.status_code == 503 and shed.headers["retry-after"] == "2"
    assert shed.json()["error"]["code"] == "overloaded"
    assert fleet.post(session, prompt=list(range(20)), max_tokens=4).status_code == 200  # small ones pass
    # no new OOMs: after the window (3 s) and two dwell periods it is back to normal
    wait_for(lambda: fleet.metric("kvfleet_router_pool_degradation_level", pool="stable") == 0, timeout=12,
             what="recovery")
    assert fleet.post(session, max_tokens=500).headers["x-kvfleet-max-tokens-lowered"] == "16"


def test_bad_pools_file_and_conflicting_flags_stop_start_up(procs, tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text("pools:\n  a:\n    version: v1\n    weight: -1\n    replicas: [http://127.0.0.1:1]\n")
    r = router(procs, None, "--pools", str(path))
    assert r.popen.wait(timeout=30) == 2
    assert f"kvfleet router: error: {path}:4: pools.a.weight: must be an integer >= 0, got -1" in r.tail()
    r = router(procs, ["http://127.0.0.1:1"], "--pools", str(path))
    assert r.popen.wait(timeout=30) == 2
    assert "kvfleet router: error: --pools: --pools lists each pool's replicas" in r.tail()
