"""The official `openai` client against a real `kvfleet engine` process running SmolLM2."""

from __future__ import annotations

import math
import time

import httpx

MODEL = "smollm2"
MSGS = [{"role": "user", "content": "Write a few sentences about the sea and the ships that sail on it."}]
NO_EOS = {"logit_bias": {"2": -100}}  # SmolLM2's <|im_end|>: outputs run to max_tokens


def stream_chat(client, **kw):
    """(text per choice index, finish reasons, usage) from a streamed chat completion."""
    texts, finish, usage = {}, {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return texts, finish, usage


def test_health_ready_models(api_server, openai_client):
    assert httpx.get(f"{api_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{api_server.url}/ready").json() == {"ready": True}
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming_usage(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                              extra_body=NO_EOS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > len(MSGS[0]["content"].split())
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_text_equals_non_streamed_greedy_chat(openai_client):
    kw = dict(messages=MSGS, max_tokens=24, temperature=0)
    full = openai_client.chat.completions.create(model=MODEL, **kw)
    texts, finish, usage = stream_chat(openai_client, stream_options={"include_usage": True}, **kw)
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: full.choices[0].finish_reason}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_text_equals_non_streamed_greedy_completions(openai_client):
    kw = dict(model=MODEL, prompt="The three largest cities of France are", max_tokens=20, temperature=0)
    full = openai_client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].text
    streamed, usage = "", None
    for chunk in openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        streamed += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert streamed == full.choices[0].text
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stream_without_include_usage_has_no_usage_chunk(openai_client):
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_n2_chat_and_completions(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, n=2, temperature=1.0,
                                              seed=7, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16
    texts, finish, usage = stream_chat(openai_client, messages=MSGS, max_tokens=8, n=2, temperature=1.0, seed=7,
                                       stream_options={"include_usage": True}, extra_body=NO_EOS)
    assert sorted(texts) == [0, 1] and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 16
    c = openai_client.completions.create(model=MODEL, prompt=["Once upon a time", "The sea"], max_tokens=5, n=2,
                                         temperature=0, extra_body=NO_EOS)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    assert c.usage.completion_tokens == 20
    by_index = {ch.index: ch.text for ch in c.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree


def test_stop_string_cuts_output(openai_client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=40, temperature=0)
    text = openai_client.chat.completions.create(**kw).choices[0].message.content
    words = text.split()
    assert len(words) > 4, text
    stop = words[3]
    cut = text[:text.index(stop)]
    r = openai_client.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_chat(openai_client, stop=stop, **{k: v for k, v in kw.items() if k != "model"})
    assert texts == {0: cut} and finish == {0: "stop"}


def test_stop_strings_end_each_of_n_choices_at_its_own_string_and_free_their_blocks(api_server, openai_client):
    """The server finds stop strings in the text and stops each completion in the engine core: a choice that
    meets one ends there while the others run on, and nothing stays running or holds KV blocks after."""
    kw = dict(messages=MSGS, max_tokens=30, temperature=1.0, n=3, seed=11, extra_body=NO_EOS)
    free = {c.index: c.message.content for c in openai_client.chat.completions.create(model=MODEL, **kw).choices}
    # (seed 11: only choice 1 holds its string; 0 and 2 run to max_tokens)
    stop = free[1][6:10]
    texts, finish, usage = stream_chat(openai_client, stop=[stop], stream_options={"include_usage": True}, **kw)
    for i, text in free.items():
        if stop in text:
            assert texts[i] == text[:text.index(stop)] and finish[i] == "stop"
        else:
            assert texts[i] == text and finish[i] == "length"
    assert usage.completion_tokens < 90
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{api_server.url}/metrics").text
        idle = [line for line in metrics.splitlines()
                if line.startswith(("vllm:num_requests_running{", "vllm:kv_cache_usage_perc{"))]
        if all(float(line.rsplit(" ", 1)[1]) == 0 for line in idle) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(idle) == 2 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in idle), idle


def test_chat_logprobs(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-4)  # greedy picks the best
        assert t.bytes == list(t.token.encode())
    streamed = []
    for chunk in openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0,
                                                       logprobs=True, stream=True, extra_body=NO_EOS):
        for ch in chunk.choices:
            streamed += [t.token for t in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == [t.token for t in content]


def test_completions_logprobs(openai_client):
    r = openai_client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=5, temperature=0,
                                         logprobs=2, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_seed_reproducible(openai_client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=8, temperature=1.0, top_p=0.95, extra_body=NO_EOS)
    a = openai_client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = openai_client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {openai_client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2)}
    assert others - {a}, "different seeds should not all give the seed-1234 text"


def test_max_completion_tokens_and_extras(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=3,
                                              extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                                          "repetition_penalty": 1.1, "min_tokens": 2},
                                              presence_penalty=0.5, frequency_penalty=0.5, user="tenant-a")
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_cached_tokens_on_repeated_prompt(openai_client):
    long_msgs = [{"role": "system", "content": "You answer questions about ships. " * 12}, *MSGS]
    first = openai_client.chat.completions.create(model=MODEL, messages=long_msgs, max_tokens=2)
    second = openai_client.chat.completions.create(model=MODEL, messages=long_msgs, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_isolates_prefix(openai_client):
    msgs = [{"role": "system", "content": "Salted prefix about lighthouses and harbours. " * 8}, *MSGS]
    openai_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body={"cache_salt": "a"})
    same = openai_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                                 extra_body={"cache_salt": "a"})
    other = openai_client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                                  extra_body={"cache_salt": "b"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
