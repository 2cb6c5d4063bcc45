"""Tenants in front of a real SmolLM2 engine that takes requests from routers only (`--require-internal-token`):
401s never reach it, keys appear in no log or metrics, isolated tenants share no prefix cache, and (slow) two
routers sharing one Redis hold one tenant's budget under a 30-second burst while another tenant is served."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import free_port, metric, router

pytestmark = pytest.mark.model

TOKEN = "it-secret-7Hq2"
KEYS = {"iso1": "sk-iso-one-4Fv8Qa", "iso2": "sk-iso-two-9Kd3Wm", "plain": "sk-plain-2Xc5Rt",
        "burst": "sk-burst-6Nh1Ys", "calm": "sk-calm-8Pj4Ue"}
TENANTS = "tenants:\n" + "".join(
    f"  {name}:\n    api_key_sha256: [\"{key_sha256(key)}\"]\n    tokens_per_minute: {tpm}\n"
    f"    max_tokens: {cap}\n    isolate_cache: {str(iso).lower()}\n"
    for name, key, tpm, cap, iso in (
        ("iso1", KEYS["iso1"], 100000, 8, True), ("iso2", KEYS["iso2"], 100000, 8, True),
        ("plain", KEYS["plain"], 100000, 8, False), ("burst", KEYS["burst"], 1200, 24, False),
        ("calm", KEYS["calm"], 100000, 8, False)))
SYSTEM = ("You are the reference desk of a public library. Answer questions about loans, renewals, the reading "
          "room, printing, interlibrary requests and the opening hours (nine to eight on weekdays, ten to four "
          "on Saturdays, closed on Sundays). Keep every answer to one sentence.")


def ask(key: str, question: str, system: str = SYSTEM) -> dict:
    return {"headers": {"authorization": f"Bearer {key}"},
            "json": {"model": "smollm2", "temperature": 0, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]}}


@pytest.fixture(scope="module")
def engine(module_procs):
    port = free_port()
    e = module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--instance-id", "e1",
                      "--num-threads", "2", "--num-blocks", "1024", "--max-num-seqs", "8", "--log-level", "info",
                      "--internal-token", TOKEN, "--require-internal-token"], f"http://127.0.0.1:{port}", "engine")
    return e.wait_ready(timeout=300)


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return str(path)


def limited_router(procs, engine, tenants_file, *extra):
    return router(procs, [engine.url], "--tenants", tenants_file, "--internal-token", TOKEN, "--access-log",
                  "--log-level", "info", *extra, policy="kv", model="smollm2").wait_ready(timeout=120)


def engine_requests(engine) -> float:
    m = httpx.get(engine.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text
    return metric(m, "vllm:request_success_total") + metric(m, "kvfleet:rejected_requests_total")


def test_engine_answers_only_routers(engine):
    assert httpx.get(engine.url + "/health").status_code == 200
    resp = httpx.post(engine.url + "/v1/chat/completions", json=ask("x", "hi")["json"])
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_internal_token"


def test_unauthorized_requests_never_reach_the_engine_and_keys_are_never_logged(procs, engine, tenants_file):
    r = limited_router(procs, engine, tenants_file)
    before = engine_requests(engine)
    for headers in ({}, {"authorization": "Bearer sk-wrong-key-31337"}):
        resp = httpx.post(r.url + "/v1/chat/completions", timeout=60, **{**ask("", "hi"), "headers": headers})
        assert resp.status_code == 401
    assert engine_requests(engine) == before
    ok = httpx.post(r.url + "/v1/chat/completions", timeout=120, **ask(KEYS["plain"], "When do you open?"))
    assert ok.status_code == 200, ok.text
    assert engine_requests(engine) == before + 1
    seen = (r.tail(10**7) + engine.tail(10**7) + httpx.get(r.url + "/metrics").text
            + httpx.get(engine.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text)
    for key in [*KEYS.values(), "sk-wrong-key-31337"]:
        assert key not in seen


def test_isolated_tenants_share_no_prefix_cache(procs, engine, tenants_file):
    r = limited_router(procs, engine, tenants_file)

    system = "This desk's isolation check. " + SYSTEM  # a prompt no earlier test sent

    def cached(key: str, question: str) -> int:
        resp = httpx.post(r.url + "/v1/chat/completions", timeout=120, **ask(key, question, system))
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = cached(KEYS["iso1"], "Can I renew a loan online?")
    again = cached(KEYS["iso1"], "Can I renew a loan online?")
    other = cached(KEYS["iso2"], "Can I renew a loan online?")
    plain = cached(KEYS["plain"], "Can I renew a loan online?")
    assert first == 0 and again >= 48  # the shared system prompt and question, from iso1's own cache
    assert other == 0  # iso2 never reads iso1's blocks
    assert plain == 0  # nor does a tenant without isolation


@pytest.mark.slow
def test_two_routers_one_redis_hold_a_burst_to_its_budget(procs, engine, tenants_file, redis_server):
    """`burst` (1,200 tokens/min, max_tokens 24) sends through both routers for 30 s, six requests at a time;
    `calm` meanwhile sends one request at a time and is always served."""
    common = ("--redis-url", redis_server.url)
    routers = [limited_router(procs, engine, tenants_file, *common) for _ in range(2)]
    duration, spec_tpm = 30.0, 1200
    questions = ["When do you open on Saturday?", "Can I print in colour?", "How long is a loan?",
                 "Is the reading room quiet?", "Do you take interlibrary requests?", "Are you open on Sunday?"]

    async def main():
        used = admitted = rejected = 0
        calm_latency: list[float] = []
        calm_status: list[int] = []
        reservation = 0
        deadline = time.monotonic() + duration
        async with httpx.AsyncClient(timeout=120) as c:
            async def burst(i):
                nonlocal used, admitted, rejected, reservation
                k = 0
                while time.monotonic() < deadline:
                    req = ask(KEYS["burst"], questions[(i + k) % len(questions)])
                    resp = await c.post(routers[(i + k) % 2].url + "/v1/chat/completions", **req)
                    k += 1
                    if resp.status_code == 200:
                        u = resp.json()["usage"]
                        used += u["total_tokens"]
                        admitted += 1
                        reservation = max(reservation, u["prompt_tokens"] + 24)
                    else:
                        assert resp.status_code == 429, resp.text
                        rejected += 1
                        await asyncio.sleep(0.05)

            async def calm():
                k = 0
                while time.monotonic() < deadline:
                    t = time.monotonic()
                    resp = await c.post(routers[k % 2].url + "/v1/chat/completions",
                                        **ask(KEYS["calm"], questions[k % len(questions)]))
                    calm_latency.append(time.monotonic() - t)
                    calm_status.append(resp.status_code)
                    k += 1

            start = time.monotonic()
            await asyncio.gather(*(burst(i) for i in range(6)), calm())
            elapsed = time.monotonic() - start
        return used, admitted, rejected, reservation, calm_latency, calm_status, elapsed

    used, admitted, rejected, reservation, lat, status, elapsed = asyncio.run(main())
    allowed = spec_tpm + spec_tpm / 60 * elapsed + reservation
    print(f"\nburst: {admitted} admitted, {rejected} rejected (429), {used} tokens used over {elapsed:.1f} s; "
          f"allowed {allowed:.0f} (capacity {spec_tpm} + refill {spec_tpm / 60 * elapsed:.0f} + one reservation "
          f"{reservation}); calm: {len(status)} requests, all 200: {set(status) == {200}}, latency p50 "
          f"{statistics.median(lat) * 1e3:.0f} ms, max {max(lat) * 1e3:.0f} ms")
    assert rejected > 0 and used <= allowed
    assert status and set(status) == {200}
