"""Fuzzing the HTTP API: zero 5xx responses, and the engine still serves afterwards.

Two generators: schemathesis over the server's own OpenAPI schema (valid and invalid bodies for
every operation), and hypothesis mutating one field of a valid request into arbitrary JSON. A
request that would run long is cut by the client timeout, which also exercises abort-on-disconnect.
Each run draws 30 fresh examples per generator (KVFLEET_FUZZ_EXAMPLES for more).
"""

from __future__ import annotations

import os

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

CLIENT_TIMEOUT = 3.0
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "stream", "stream_options", "seed", "logprobs", "top_logprobs", "logit_bias", "presence_penalty",
          "frequency_penalty", "user", "top_k", "min_p", "min_tokens", "ignore_eos", "cache_salt",
          "repetition_penalty", "stop_token_ids", "prompt", "echo"]
VALID_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
VALID_COMPLETION = {"model": "smollm2", "prompt": "hi", "max_tokens": 3}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


def call(url: str, method: str, path: str, **kw) -> int | None:
    """The status code, or None if the client gave up waiting (a long valid request)."""
    try:
        return httpx.request(method, url + path, timeout=CLIENT_TIMEOUT, **kw).status_code
    except httpx.TimeoutException:
        return None


def test_mutated_bodies_never_5xx(api_server):
    statuses: list[int | None] = []

    @settings(max_examples=int(os.environ.get("KVFLEET_FUZZ_EXAMPLES", "30")), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(chat=st.booleans(), field=st.sampled_from(FIELDS), value=json_values, drop=st.booleans())
    def check(chat, field, value, drop):
        body = dict(VALID_CHAT if chat else VALID_COMPLETION)
        if drop:
            body.pop(field, None)
        else:
            body[field] = value
        status = call(api_server.url, "POST", "/v1/chat/completions" if chat else "/v1/completions", json=body)
        statuses.append(status)
        assert status is None or status < 500, (body, status)

    check()
    assert 400 in statuses and 200 in statuses  # both rejections and real generations were exercised
    assert httpx.get(f"{api_server.url}/ready").status_code == 200


def test_schemathesis_openapi_never_5xx(api_server):
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    ops = [r.ok() for r in schema.get_all_operations()]
    labels = {op.label for op in ops}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= labels
    strategy = st.one_of([op.as_strategy() for op in ops if op.path != "/v1/kv/events"])  # endless stream
    seen: list[int | None] = []

    @settings(max_examples=int(os.environ.get("KVFLEET_FUZZ_EXAMPLES", "30")), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def check(case):
        try:
            status = case.call(base_url=api_server.url, timeout=CLIENT_TIMEOUT).status_code
        except Exception as e:  # requests' timeouts: the request ran long, the server aborts it
            assert "Timeout" in type(e).__name__, e
            status = None
        seen.append(status)
        assert status is None or status < 500, (case.method, case.path, case.body, status)

    check()
    assert any(s == 400 for s in seen)
    r = httpx.post(f"{api_server.url}/v1/chat/completions", json=VALID_CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
