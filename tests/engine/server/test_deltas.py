"""Streams are deltas: their concatenation equals the whole response, for chat and completions alike.

Every case runs once streamed and once not, on the real engine (float32, seeded sampling, so both runs
draw the same tokens): text per choice, finish and stop reasons, logprobs (token, value and top list) and
token counts must agree, with n > 1, stop strings that span tokens, include_stop_str_in_output and echo.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

CHAT_MSGS = [{"role": "user", "content": "Write a few sentences about the sea and the ships that sail on it."}]
NO_EOS = {"2": -100}  # SmolLM2's <|im_end|>
_SALTS = itertools.count()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)


def _sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _stream(server, path: str, body: dict) -> tuple[dict[int, dict], dict]:
    """Per choice index: joined text, finish/stop reason, joined logprobs; and the final usage."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in _sse(_post(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}})):
        assert "error" not in chunk, chunk
        if chunk.get("usage") and not chunk["choices"]:
            usage = chunk["usage"]
        for ch in chunk["choices"]:
            c = choices.setdefault(ch["index"], {"text": "", "finish_reason": None, "stop_reason": None, "lp": []})
            piece = ch["delta"].get("content", "") if "delta" in ch else ch["text"]
            c["text"] += piece or ""
            if ch.get("finish_reason"):
                c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
            lp = ch.get("logprobs")
            if lp:
                c["lp"] += lp["content"] if "content" in lp else list(zip(lp["tokens"], lp["token_logprobs"],
                                                                          lp["top_logprobs"], lp["text_offset"], strict=True))
    return choices, usage


def _whole(server, path: str, body: dict) -> tuple[dict[int, dict], dict]:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    out = {}
    for ch in r.json()["choices"]:
        lp = ch.get("logprobs")
        lps = [] if not lp else lp["content"] if "content" in lp else list(
            zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True))
        text = ch["message"]["content"] if "message" in ch else ch["text"]
        out[ch["index"]] = {"text": text, "finish_reason": ch["finish_reason"], "stop_reason": ch["stop_reason"],
                            "lp": lps}
    return out, r.json()["usage"]


def _same(server, path: str, body: dict) -> dict[int, dict]:
    """Streamed and whole agree; each run has its own cache salt, so both compute from scratch."""
    streamed, s_usage = _stream(server, path, {**body, "cache_salt": f"s-{next(_SALTS)}"})
    whole, w_usage = _whole(server, path, {**body, "cache_salt": f"w-{next(_SALTS)}"})
    assert streamed == whole
    assert s_usage == w_usage
    return whole


CHAT = {"model": "smollm2", "messages": CHAT_MSGS, "max_tokens": 24}
COMP = {"model": "smollm2", "prompt": "The three largest cities of France are", "max_tokens": 24}
CASES = [
    ("chat", {**CHAT, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ("chat", {**CHAT, "n": 3, "temperature": 1.0, "seed": 11, "logit_bias": NO_EOS}),
    ("chat", {**CHAT, "n": 2, "temperature": 0.8, "seed": 5, "logprobs": True, "top_logprobs": 2}),
    ("completions", {**COMP, "temperature": 0, "logprobs": 2}),
    ("completions", {**COMP, "n": 3, "temperature": 1.0, "seed": 7, "logprobs": 1, "logit_bias": NO_EOS}),
    ("completions", {**COMP, "prompt": ["Once upon a time", "The capital of Italy is"], "n": 2, "temperature": 0.9,
                     "seed": 3}),
    ("completions", {**COMP, "echo": True, "temperature": 0}),
]


# chat-1 (n=3, seeded) is slow: completions-4 checks the same sampling in make test
@pytest.mark.parametrize("path,body", [pytest.param(p, b, id=f"{p}-{i}", marks=pytest.mark.slow if i == 1 else ())
                                       for i, (p, b) in enumerate(CASES)])
def test_stream_concatenation_equals_the_whole_response(api_server, path, body):
    whole = _same(api_server, "chat/completions" if path == "chat" else path, body)
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert sorted(whole) == list(range(body.get("n", 1) * prompts))
    assert all(c["text"] for c in whole.values())
    if body.get("logprobs"):
        assert all(c["lp"] for c in whole.values())


def test_stop_strings_across_tokens_with_and_without_the_stop_text(api_server):
    base = {**COMP, "temperature": 0, "max_tokens": 40, "logprobs": 1}
    free = _whole(api_server, "completions", base)[0][0]["text"]
    stop = free[5:9]  # four characters that most likely span two tokens
    assert len(stop) == 4 and stop in free
    cut = _same(api_server, "completions", {**base, "stop": [stop]})[0]
    assert cut["text"] == free[:free.index(stop)] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    kept = _same(api_server, "completions", {**base, "stop": [stop], "include_stop_str_in_output": True})[0]
    assert kept["text"] == free[:free.index(stop) + len(stop)] and kept["stop_reason"] == stop
    chat = _same(api_server, "chat/completions", {**CHAT, "temperature": 0, "stop": [" the", " a "],
                                                  "include_stop_str_in_output": True})[0]
    assert chat["finish_reason"] in ("stop", "length")


FIRST_CASES = [
    ("chat/completions", {**CHAT, "temperature": 0}),
    ("chat/completions", {**CHAT, "n": 2, "temperature": 1.0, "seed": 3, "logit_bias": NO_EOS}),
    ("completions", {**COMP, "temperature": 0}),
    ("completions", {**COMP, "n": 2, "temperature": 1.0, "seed": 3, "logit_bias": NO_EOS}),
    ("completions", {**COMP, "prompt": ["Once upon a time", "The capital of Italy is"], "temperature": 0}),
]


@pytest.mark.parametrize("path,body", FIRST_CASES, ids=[f"{p.split('/')[0]}-{i}" for i, (p, _) in enumerate(FIRST_CASES)])
def test_the_first_chunk_of_every_choice_carries_its_first_text(api_server, path, body):
    """No chunk goes out before a token: a chat choice's role comes with its first text, in one delta."""
    chunks = _sse(_post(api_server, path, {**body, "max_tokens": 6, "stream": True}))
    firsts: dict[int, dict] = {}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1, chunk
        ch = chunk["choices"][0]
        if ch["index"] in firsts:
            assert "role" not in ch.get("delta", {}), "the role comes once, in the first chunk"
        firsts.setdefault(ch["index"], ch)
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert sorted(firsts) == list(range(body.get("n", 1) * prompts))
    for ch in firsts.values():
        if path == "chat/completions":
            assert ch["delta"]["role"] == "assistant" and ch["delta"]["content"], ch
        else:
            assert ch["text"], ch


def test_a_chat_choice_that_ends_before_any_text_gets_its_role_in_its_finishing_chunk(api_server):
    first = _post(api_server, "chat/completions", {**CHAT, "temperature": 0, "max_tokens": 1}).json()
    stop = first["choices"][0]["message"]["content"]  # the first token's text: stopping on it leaves no text
    assert stop
    (chunk,) = _sse(_post(api_server, "chat/completions", {**CHAT, "temperature": 0, "stop": [stop], "stream": True}))
    (ch,) = chunk["choices"]
    assert ch["delta"] == {"role": "assistant", "content": ""}
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop


@pytest.mark.parametrize("path,body,param", [
    ("chat/completions", {**CHAT, "max_tokens": 4096}, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 4096}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("chat/completions", {**CHAT, "stop_token_ids": [999999]}, "stop_token_ids"),
    ("completions", {**COMP, "prompt": [5, 999999]}, "prompt"),
    ("completions", {**COMP, "prompt": [[5, 6], [5, 999999]]}, "prompt[1]"),
])
def test_a_refused_stream_gets_its_400_before_any_sse_byte(api_server, path, body, param):
    r = _post(api_server, path, {**body, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("path,field,value", [
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("chat/completions", "function_call", {"name": "f"}),
    ("completions", "tools", [{"type": "function", "function": {"name": "get_weather"}}]),
    ("completions", "tool_choice", "required"),
])
def test_unimplemented_fields_are_refused_naming_them(api_server, path, field, value):
    body = CHAT if path == "chat/completions" else {"model": CHAT.get("model"), "prompt": "Hi", "max_tokens": 2}
    for stream in (False, True):
        r = _post(api_server, path, {**body, field: value, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "not supported" in err["message"], err


def test_fields_that_ask_for_nothing_are_accepted(api_server):
    r = _post(api_server, "chat/completions", {**CHAT, "max_tokens": 2, "tools": [], "tool_choice": "none",
                                               "response_format": {"type": "text"}, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
