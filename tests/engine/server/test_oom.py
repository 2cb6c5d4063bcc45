"""The fault-injection flags on real `kvfleet engine` processes.

A replica whose every other model step runs out of memory and that sleeps after each step
(--debug-oom-every 2 --debug-step-delay-ms 100) answers with the greedy text of a healthy one, counts the
failures in kvfleet:oom_events_total, and its tokens come at least 100 ms apart. A replica whose every
step runs out of memory (--debug-oom-every 1) gives each request up after a few failed steps and
answers a 500, a streamed one too (it failed before its first token, so no stream started); no KV block
stays held and it stays up.
More cases on the engine itself: tests/engine/test_engine_oom.py.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from engine.oom_backoff import GIVE_UP_AFTER
from tests.engine.server.conftest import API_FLAGS, start_engine

BODY = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Name three harbours."}]}


@pytest.fixture(scope="module")
def flaky_server(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("flaky")), *API_FLAGS, "--debug-oom-every", "2",
                          "--debug-step-delay-ms", "100")
    yield server
    server.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def oom_server(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("oom")), *API_FLAGS, "--debug-oom-every", "1")
    yield server
    server.stop(signal.SIGTERM)


def test_a_request_that_keeps_running_out_of_memory_gets_a_500(oom_server):
    r = httpx.post(f"{oom_server.url}/v1/chat/completions", json=BODY, timeout=60)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "out_of_memory" and err["type"] == "internal_error" and "out of memory" in err["message"]


@pytest.mark.parametrize("path,body", [("chat/completions", BODY),
                                       ("completions", {"model": "smollm2", "prompt": "Tide", "max_tokens": 4})])
def test_a_streamed_request_that_fails_before_its_first_token_gets_a_500_not_a_stream(oom_server, path, body):
    r = httpx.post(f"{oom_server.url}/v1/{path}", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.headers["x-request-id"].startswith(("chatcmpl-", "cmpl-"))
    err = r.json()["error"]
    assert err["code"] == "out_of_memory" and err["type"] == "internal_error" and "out of memory" in err["message"]


def test_failures_are_counted_and_free_their_blocks(oom_server):
    before = oom_server.metric("kvfleet:oom_events_total")
    r = httpx.post(f"{oom_server.url}/v1/completions", json={"model": "smollm2", "prompt": "Tide", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 500
    assert oom_server.metric("kvfleet:oom_events_total") - before == GIVE_UP_AFTER
    assert oom_server.metric("vllm:kv_cache_usage_perc") == 0
    assert oom_server.metric("vllm:num_requests_running") == 0
    assert httpx.get(f"{oom_server.url}/ready", timeout=10).status_code == 200  # the replica stays up


def _greedy_texts(url: str) -> list[str]:
    prompts = ["The harbour master said", "Low tide uncovers", "Three ships entered the port at dawn and"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(p):
                body = {"model": "smollm2", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*[one(p) for p in prompts])

    return asyncio.run(run())


def test_failing_steps_give_the_text_of_a_healthy_replica_and_slow_steps_space_the_tokens(api_server, flaky_server):
    m = flaky_server.metric
    assert m("kvfleet:oom_events_total") == 0
    assert _greedy_texts(flaky_server.url) == _greedy_texts(api_server.url)
    assert m("kvfleet:oom_events_total") >= 3
    assert m("vllm:kv_cache_usage_perc") == 0
    assert m("vllm:inter_token_latency_seconds_count") >= 3 * 5
    assert m("vllm:inter_token_latency_seconds_bucket", le="0.075") == 0  # every gap spans a 100 ms step
