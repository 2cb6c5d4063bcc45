"""--sse-keepalive on real `kvfleet engine` processes whose every step takes several keep-alive intervals
(--debug-step-delay-ms 700 against --sse-keepalive 0.2, so the prefill alone does): `: keep-alive` comments come while the prefill runs
and between tokens, the status line with the first of them; the official `openai` client and httpx-sse parse
such streams into the text of the non-streamed answer. With --sse-keepalive 0 no comment is sent and the
status line waits for the first token; a client that leaves before then still aborts its request."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest
from httpx_sse import connect_sse

from contract.errors import ConfigError
from engine.server.serving import ServerConfig
from tests.engine.server.conftest import API_FLAGS, start_engine

STEP_MS = 700
KEEPALIVE = 0.2
MSGS = [{"role": "user", "content": "Name a harbour in France."}]
CHAT = {"model": "smollm2", "messages": MSGS, "max_tokens": 3, "temperature": 0}
COMP = {"model": "smollm2", "prompt": "The harbour of Marseille is", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("keepalive")), *API_FLAGS, "--debug-step-delay-ms", str(STEP_MS),
                          "--sse-keepalive", str(KEEPALIVE))
    yield server
    server.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("quiet")), *API_FLAGS, "--debug-step-delay-ms", str(STEP_MS),
                          "--sse-keepalive", "0")
    yield server
    server.stop(signal.SIGTERM)


def raw_stream(url: str, path: str, body: dict) -> tuple[float, list[tuple[float, str]]]:
    """(seconds to the status line, [(seconds, line)] for every non-empty line) of one streamed request."""
    t0 = time.monotonic()
    lines = []
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        headers_at = time.monotonic() - t0
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic() - t0, line))
    return headers_at, lines


@pytest.mark.parametrize("path,body", [("chat/completions", CHAT), ("completions", COMP)])
def test_keepalive_comments_during_the_prefill_and_between_tokens(slow_server, path, body):
    headers_at, lines = raw_stream(slow_server.url, path, body)
    kinds = ["ka" if line == ": keep-alive" else "data" for _, line in lines]
    assert set(line for _, line in lines if not line.startswith("data: ")) == {": keep-alive"}
    first = kinds.index("data")
    assert first >= 2, kinds  # the prefill step takes STEP_MS, keep-alives every KEEPALIVE s
    assert headers_at < STEP_MS / 1000, "the first keep-alive sent the status line, before any token"
    assert "ka" in kinds[first:], kinds  # between tokens too (each step takes STEP_MS)
    assert lines[-1][1] == "data: [DONE]"
    for (t_prev, _), (t, _) in zip(lines, lines[1:], strict=False):
        assert t - t_prev < KEEPALIVE + 0.5, "no silence much longer than the keep-alive interval"


def test_openai_client_streams_through_keepalives(slow_server):
    with openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        whole = client.chat.completions.create(**CHAT)
        text, roles = "", []
        for chunk in client.chat.completions.create(**CHAT, stream=True):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                roles.append(ch.delta.role)
        assert whole.choices[0].message.content and text == whole.choices[0].message.content
        assert roles[0] == "assistant" and set(roles[1:]) <= {None}
        streamed = "".join(c.choices[0].text for c in client.completions.create(**COMP, stream=True) if c.choices)
        assert streamed == client.completions.create(**COMP).choices[0].text


def test_httpx_sse_parses_a_stream_with_keepalives(slow_server):
    with httpx.Client(timeout=60) as client:
        whole = client.post(f"{slow_server.url}/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        with connect_sse(client, "POST", f"{slow_server.url}/v1/chat/completions", json={**CHAT, "stream": True}) as es:
            events = [sse.data for sse in es.iter_sse()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["content"]


def test_keepalive_zero_sends_none_and_the_status_line_waits_for_the_first_token(quiet_server):
    headers_at, lines = raw_stream(quiet_server.url, "chat/completions", CHAT)
    assert all(line.startswith("data: ") for _, line in lines), lines
    assert headers_at >= STEP_MS / 1000 - 0.05, "the prefill step sleeps STEP_MS before its token is out"
    first = json.loads(lines[0][1][6:])["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]


def test_a_client_that_leaves_before_any_byte_aborts_its_request(quiet_server):
    aborted = quiet_server.metric("kvfleet:aborted_requests_total")
    with pytest.raises(httpx.ReadTimeout):  # no status line within 0.4 s: the prefill step takes STEP_MS
        httpx.post(f"{quiet_server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": True},
                   timeout=httpx.Timeout(10, read=0.4))
    deadline = time.monotonic() + 10
    while (quiet_server.metric("kvfleet:aborted_requests_total") == aborted
           or quiet_server.metric("vllm:num_requests_running") > 0):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    assert quiet_server.metric("kvfleet:aborted_requests_total") - aborted == 1
    assert quiet_server.metric("vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_the_keepalive_interval_is_validated_naming_the_flag(value):
    with pytest.raises(ConfigError, match="--sse-keepalive") as e:
        ServerConfig(served_model_names=("m",), sse_keepalive=value)
    assert e.value.field == "--sse-keepalive"
