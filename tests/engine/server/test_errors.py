"""Bad input gets an OpenAI-style error naming the field, never a 5xx, and the engine keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
LONG = "ships " * 2100  # ~2100 tokens: over max_model_len (2048)

CASES = [
    # (path, body, status, param)
    ("chat", {**CHAT, "model": "gpt-7"}, 404, "model"),
    ("completions", {**COMP, "model": "gpt-7"}, 404, "model"),
    ("chat", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("chat", {**CHAT, "temperature": -0.5}, 400, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMP, "top_p": 5e-324}, 400, "top_p"),  # found by fuzzing
    ("chat", {**CHAT, "n": 0}, 400, "n"),
    ("chat", {**CHAT, "n": 1000}, 400, "n"),
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {**CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("chat", {**CHAT, "stop": ["x"] * 20}, 400, "stop"),
    ("chat", {**CHAT, "stop": [""]}, 400, "stop"),
    ("chat", {**CHAT, "seed": 1.5}, 400, "seed"),
    ("chat", {**CHAT, "priority": "high"}, 400, "priority"),
    ("completions", {**COMP, "priority": 2**31}, 400, "priority"),
    ("chat", {**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("chat", {**CHAT, "repetition_penalty": 2.2250738585072014e-308}, 400, "repetition_penalty"),  # found by fuzzing
    ("chat", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {**CHAT, "min_tokens": 5}, 400, "min_tokens"),
    ("chat", {**CHAT, "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    ("chat", {**CHAT, "messages": []}, 400, "messages"),
    ("chat", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat", {k: v for k, v in CHAT.items() if k != "messages"}, 400, "messages"),
    ("completions", {**COMP, "prompt": LONG}, 400, "prompt"),
    ("completions", {**COMP, "prompt": []}, 400, "prompt"),
    ("completions", {**COMP, "prompt": [1, -2]}, 400, "prompt"),
    ("completions", {**COMP, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {**COMP, "prompt": 7}, 400, "prompt"),
    ("completions", {**COMP, "logprobs": 21}, 400, "logprobs"),
    ("completions", {**COMP, "echo": True, "logprobs": 1}, 400, "echo"),
    ("completions", {**COMP, "best_of": 3}, 400, "best_of"),
    ("completions", {**COMP, "suffix": "tail"}, 400, "suffix"),
    ("completions", {**COMP, "max_tokens": 2048}, 400, "max_tokens"),
]


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else path}", timeout=60, **kw,
                      **({"json": body} if not isinstance(body, bytes) else {"content": body}))


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_request_names_the_field(api_server, path, body, status, param):
    assert_error(post(api_server, path, body), status, param)


def test_context_length_message(api_server):
    err = assert_error(post(api_server, "chat", {**CHAT, "messages": [{"role": "user", "content": LONG}]}),
                       400, "messages")
    assert "maximum context length is 2048" in err["message"] and err["code"] == "context_length_exceeded"


def test_malformed_bodies(api_server):
    headers = {"content-type": "application/json"}
    for raw in (b"{", b"[]", b"null", b'"x"', b"{\"messages\": NaN}", b"\xff\xfe", b""):
        r = post(api_server, "chat", raw, headers=headers)
        assert r.status_code == 400, (raw, r.text)
        assert "error" in r.json()


def test_body_over_limit_is_413(api_server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    r = post(api_server, "chat", json.dumps(big).encode(), headers={"content-type": "application/json"})
    assert_error(r, 413, None)

    def chunks():  # no Content-Length: counted while reading
        yield b'{"model":"smollm2","messages":[{"role":"user","content":"'
        for _ in range(80):
            yield b"y" * 65536
        yield b'"}]}'

    r = httpx.post(f"{api_server.url}/v1/chat/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413, None)


def test_unknown_route_and_method(api_server):
    assert_error(httpx.get(f"{api_server.url}/v1/nope"), 404, None)
    assert_error(httpx.get(f"{api_server.url}/v1/chat/completions"), 405, None)


def test_still_serving_after_bad_input(api_server):
    r = post(api_server, "chat", CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
