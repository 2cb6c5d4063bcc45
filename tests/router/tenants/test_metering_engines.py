"""Metering against real engines (issue 47): three tenants sharing system prompts over two real SmolLM2 engines
behind one router with Redis, one tenant isolated (its own cache_salt). For every request the ledger's prompt and
cached tokens equal what the engine reported for it, and the run's totals equal the engines' own counters."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import free_port, metric, router

pytestmark = pytest.mark.model

KEYS = {"north": "sk-north-5Tg7Yh", "south": "sk-south-8Uj2Ik", "island": "sk-isle-3Ol9Pm"}
TENANTS = "tenants:\n" + "".join(
    f"  {name}:\n    api_key_sha256: [\"{key_sha256(key)}\"]\n    tokens_per_minute: 1000000\n"
    f"    isolate_cache: {'true' if name == 'island' else 'false'}\n" for name, key in KEYS.items())
SYSTEMS = [f"You are assistant {i} of the harbour office. Answer about ferries, tides and the market in one short "
           f"sentence. Office {i} opens at {7 + i} and closes at {17 + i}." for i in range(2)]


def engine_counters(urls: list[str]) -> tuple[float, float]:
    prompt = hits = 0.0
    for u in urls:
        text = httpx.get(u + "/metrics").text
        prompt += metric(text, "vllm:prompt_tokens_total")
        hits += metric(text, "vllm:prefix_cache_hits_total")
    return prompt, hits


def test_the_ledger_equals_what_the_engines_report(module_procs, tmp_path, redis_server):
    engines = []
    for i in range(2):
        port = free_port()
        engines.append(module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port),
                                     "--num-threads", "1", "--instance-id", f"m{i}", "--log-level", "warning"],
                                    f"http://127.0.0.1:{port}", f"engine-{i}"))
    for e in engines:
        e.wait_ready(timeout=300)
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    rt = router(module_procs, [e.url for e in engines], "--tenants", str(path), "--redis-url", redis_server.url,
                policy="kv", model="smollm2").wait_ready(timeout=120)
    before = engine_counters([e.url for e in engines])
    reported = {}
    with httpx.Client(timeout=120) as c:
        for i in range(18):
            tenant = list(KEYS)[i % 3]
            body = {"model": "smollm2", "max_tokens": 3, "temperature": 0, "messages": [
                {"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": f"Question {i}?"}]}
            r = c.post(rt.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"})
            assert r.status_code == 200, r.text
            reported[r.headers["x-request-id"]] = (tenant, r.json()["usage"])
    after = engine_counters([e.url for e in engines])
    out = subprocess.run([sys.executable, "-m", "kvfleet", "usage", "export", "--redis-url", redis_server.url,
                          "--tenants", str(path)], capture_output=True, text=True, check=True).stdout
    rows = {r["request_id"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == set(reported)
    for rid, (tenant, u) in reported.items():
        row = rows[rid]
        assert (row["tenant"], row["prompt_tokens"], row["cached_tokens"], row["output_tokens"]) == (
            tenant, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
    assert sum(r["prompt_tokens"] for r in rows.values()) == after[0] - before[0]  # vllm:prompt_tokens
    assert sum(r["cached_tokens"] for r in rows.values()) == after[1] - before[1]  # vllm:prefix_cache_hits
    assert sum(r["cached_tokens"] for r in rows.values() if r["tenant"] != "island") > 0  # shared prompts hit
    text = httpx.get(rt.url + "/metrics").text
    for tenant in KEYS:
        assert metric(text, "kvfleet_router_tenant_tokens_total", tenant=tenant, kind="cached") == sum(
            r["cached_tokens"] for r in rows.values() if r["tenant"] == tenant)
