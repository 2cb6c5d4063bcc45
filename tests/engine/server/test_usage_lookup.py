"""POST /v1/kvfleet/usage/lookup on a real engine: what each request used, by the router's x-request-id, its
client gone or not, summing to the engine's own token counters."""

from __future__ import annotations

import asyncio
import json

import httpx

from contract.usage_lookup import PATH
from tests.engine.server.test_cancellation import body, wait_idle


async def drive(url: str) -> None:
    """6 streams under router ids: 2 read to the end, 2 dropped after 3 chunks, 2 dropped at once."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> None:
            headers = {"x-request-id": f"req_lookup_{i}"}
            if i >= 4:  # the request sent, the connection dropped before it could start streaming
                try:
                    await client.post(f"{url}/v1/chat/completions", json=body(i, max_tokens=64), headers=headers,
                                      timeout=0.05)
                except httpx.TimeoutException:
                    pass
                return
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body(i, max_tokens=64),
                                     headers=headers) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        chunks += 1
                    if i >= 2 and chunks >= 3:
                        break

        await asyncio.gather(*(one(i) for i in range(6)))


def test_lookup_answers_each_request_and_sums_to_the_engine_counters(api_server):
    wait_idle(api_server)
    prompt0 = api_server.metric("vllm:prompt_tokens_total")
    gen0 = api_server.metric("vllm:generation_tokens_total")
    asyncio.run(drive(api_server.url))
    wait_idle(api_server)
    ids = [f"req_lookup_{i}" for i in range(6)] + ["req_never_seen"]
    r = httpx.post(api_server.url + PATH, json={"request_ids": ids}, timeout=10)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert data["req_never_seen"] == "unknown"
    for i in range(2):
        assert data[f"req_lookup_{i}"]["outcome"] == "length"
        assert data[f"req_lookup_{i}"]["completion_tokens"] == 64
    for i in range(2, 6):
        assert data[f"req_lookup_{i}"]["outcome"] == "aborted", data
    for i in range(2, 4):  # dropped mid-stream: what the core sampled, at least the 3 chunks read
        assert 3 <= data[f"req_lookup_{i}"]["completion_tokens"] < 64
    found = [data[i] for i in ids[:-1]]
    assert sum(u["prompt_tokens"] for u in found) == api_server.metric("vllm:prompt_tokens_total") - prompt0
    assert sum(u["completion_tokens"] for u in found) == api_server.metric("vllm:generation_tokens_total") - gen0
    assert all(u["cached_tokens"] <= u["prompt_tokens"] for u in found)


def test_lookup_refuses_a_bad_body(api_server):
    for bad in ({"request_ids": "req_1"}, {"request_ids": [1]}, {}, {"request_ids": ["x"] * 10_001}):
        r = httpx.post(api_server.url + PATH, json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_ids", r.text
    r = httpx.post(api_server.url + PATH, content=b"not json", timeout=10)
    assert r.status_code == 400
