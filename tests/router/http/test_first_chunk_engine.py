"""Through the router, in front of a real engine whose steps take 600 ms: the engine's `: keep-alive` comments
pass through while the prefill runs, the first `data:` chunk carries the role and generated content together
(chat) or text (completions), the router's TTFT counts from that chunk, and the official openai client reads
the stream into the non-streamed answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.router.conftest import free_port, metric, wait_for

pytestmark = pytest.mark.model

MSGS = [{"role": "user", "content": "Name a harbour in France."}]


@pytest.fixture(scope="module")
def fleet(module_procs):
    port = free_port()
    engine = module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "2",
                           "--debug-step-delay-ms", "600", "--sse-keepalive", "0.2"], f"http://127.0.0.1:{port}",
                          "engine").wait_ready(timeout=300)
    rport = free_port()
    r = module_procs(["-m", "router.main", "--port", str(rport), "--replicas", engine.url, "--model", "",
                      "--policy", "round-robin", "--health-interval", "0.2", "--log-level", "warning"],
                     f"http://127.0.0.1:{rport}", "router").wait_ready()
    return r


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "max_tokens": 3, "temperature": 0}),
    ("/v1/completions", {"model": "smollm2", "prompt": "The harbour of Marseille is", "max_tokens": 3,
                         "temperature": 0}),
])
def test_keep_alives_then_the_first_chunk_carries_content(fleet, path, body):
    with httpx.stream("POST", fleet.url + path, json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert first_data >= 1 and all(ln == ": keep-alive" for ln in lines[:first_data])  # during the prefill
    choice = json.loads(lines[first_data][6:])["choices"][0]
    if path == "/v1/chat/completions":
        assert choice["delta"]["role"] == "assistant" and choice["delta"]["content"]
    else:
        assert choice["text"]
    assert lines[-1] == "data: [DONE]"


def test_openai_client_and_router_ttft(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused")
    whole = client.chat.completions.create(model="smollm2", messages=MSGS, max_tokens=3, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", messages=MSGS, max_tokens=3, temperature=0, stream=True) if ch.choices)
    assert streamed == whole.choices[0].message.content and streamed
    # the stream is observed after its last byte, when the router settles it
    wait_for(lambda: metric(httpx.get(fleet.url + "/metrics").text, "kvfleet_router_pool_ttft_seconds_count") >= 1,
             what="the stream's TTFT observed")
    text = httpx.get(fleet.url + "/metrics").text
    # every streamed request's TTFT waited for its prefill step (600 ms), not for the first keep-alive (200 ms)
    assert metric(text, "kvfleet_router_pool_ttft_seconds_count") >= 1
    assert metric(text, "kvfleet_router_pool_ttft_seconds_bucket", le="0.5") == 0
