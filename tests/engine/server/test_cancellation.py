"""Clients that disconnect abort their requests and free their blocks; the others are unaffected."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

MAX_TOKENS = 16


def body(i: int, stream: bool = True, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "smollm2", "stream": stream, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}: tell me a story about boat number {i}."}],
            **({"stream_options": {"include_usage": True}} if stream else {})}


def wait_idle(server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("engine still busy")


def kv_snapshot(server) -> set[str]:
    with httpx.stream("GET", f"{server.url}/v1/kv/events", timeout=10) as r:
        first = json.loads(next(r.iter_lines()))
    assert first["type"] == "snapshot"
    return set(first["block_hashes"])


async def hang_up_early(url: str, payload: dict) -> None:
    """Write the whole request on a raw connection, wait 50 ms, close. (A client timeout around an httpx call
    could fire before the request left, on a loaded machine: the server would never see it to abort it.)"""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    await writer.wait_closed()


async def run_streams(url: str) -> dict[int, dict]:
    """20 streams: 5 dropped at once (most likely before their first token), 10 mid-stream, 5 read to the end."""
    results: dict[int, dict] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> None:
            mode = "early" if i < 5 else ("mid" if i < 15 else "full")
            text, finish, usage, chunks = "", None, None, 0
            if mode == "early":  # the whole request sent, then a hang-up 50 ms later, most likely before a token
                await hang_up_early(url, body(i))
                results[i] = {"mode": mode}
                return
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body(i)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    usage = msg.get("usage") or usage
                    for ch in msg["choices"]:
                        if ch["delta"].get("content"):
                            text += ch["delta"]["content"]
                            chunks += 1
                        finish = ch.get("finish_reason") or finish
                    if mode == "mid" and chunks >= 3:
                        break  # leaving the block closes the connection mid-stream
            results[i] = {"mode": mode, "text": text, "finish": finish, "usage": usage}

        await asyncio.gather(*(one(i) for i in range(20)))
    return results


def test_disconnects_abort_and_free_blocks(api_server):
    wait_idle(api_server)
    expected = {}
    for i in range(15, 20):  # what the survivors must produce (greedy), computed alone beforehand
        r = httpx.post(f"{api_server.url}/v1/chat/completions", json=body(i, stream=False), timeout=120).json()
        expected[i] = r["choices"][0]["message"]["content"]
    aborted_before = api_server.metric("kvfleet:aborted_requests_total")

    results = asyncio.run(run_streams(api_server.url))

    for i in range(15, 20):
        r = results[i]
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS, r
        assert r["text"] == expected[i]
    assert {results[i]["mode"] for i in range(5)} == {"early"}
    wait_idle(api_server)
    # every dropped request was aborted, and no block is held by a request any more
    assert api_server.metric("kvfleet:aborted_requests_total") - aborted_before == 15
    assert api_server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert kv_snapshot(api_server), "finished prompts stay in the prefix cache (free, reusable)"
    r = httpx.post(f"{api_server.url}/v1/chat/completions", json=body(99, stream=False), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_non_streaming_disconnect_aborts(api_server):
    wait_idle(api_server)
    aborted_before = api_server.metric("kvfleet:aborted_requests_total")
    try:
        httpx.post(f"{api_server.url}/v1/chat/completions", json=body(7, stream=False, max_tokens=1500), timeout=1.0)
        raise AssertionError("a 1500-token request should outlast a 1 s client timeout")
    except httpx.TimeoutException:
        pass
    t0 = time.monotonic()
    wait_idle(api_server, timeout=10)
    assert time.monotonic() - t0 < 5, "the abort should take effect within a step or two"
    assert api_server.metric("kvfleet:aborted_requests_total") - aborted_before == 1
    assert api_server.metric("vllm:kv_cache_usage_perc") == 0.0
