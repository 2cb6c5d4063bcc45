"""Fuzzed request bodies for the hostile-clients scenario, drawn by hypothesis: OpenAI chat and completion
bodies whose every field may be missing, of the wrong type or out of range, plus bodies that are not JSON.
`max_tokens` is always present and small or invalid when bodies go straight at an engine (no tenant cap
there), so that a fuzzed body cannot start a generation of thousands of tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

_scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=30))
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                     max_leaves=8)
_small_max_tokens = st.integers(-3, 8) | st.sampled_from([0, 10**30, "8", 1.5, -1, [], {}])
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"]) | _json,
     "content": st.text(max_size=200) | _json},
    optional={"name": _json, "tool_calls": _json, "tool_call_id": _json})
_common = {"model": st.just("smollm2") | _json, "temperature": st.floats(-1, 3) | _json,
           "top_p": st.floats(-1, 2) | _json, "n": st.integers(-1, 3) | _json, "stream": st.booleans() | _json,
           "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | _json,
           "seed": st.integers(-2**65, 2**65) | _json, "logprobs": st.booleans() | _json,
           "top_logprobs": st.integers(-2, 30) | _json, "presence_penalty": st.floats(-3, 3) | _json,
           "stream_options": _json, "user": _json, "cache_salt": _json, "logit_bias": _json}
_chat = st.fixed_dictionaries({"max_tokens": _small_max_tokens},
                              optional={**_common, "messages": st.lists(_message, max_size=4) | _json,
                                        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])
                                        | _json, "tools": _json, "tool_choice": _json})
_completion = st.fixed_dictionaries({"max_tokens": _small_max_tokens},
                                    optional={**_common, "prompt": st.text(max_size=200)
                                              | st.lists(st.integers(-5, 200_000), max_size=20)
                                              | st.lists(st.text(max_size=20), max_size=3) | _json,
                                              "echo": _json, "suffix": _json})
_text = st.text(max_size=120)
_valid_common = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 2),
                 "stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
                 "seed": st.integers(0, 2**31), "presence_penalty": st.floats(-2, 2), "user": _text,
                 "cache_salt": _text}
_valid_chat = st.fixed_dictionaries(
    {"model": st.just("smollm2"), "max_tokens": st.integers(1, 8),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": _text}), min_size=1, max_size=3)},
    optional={**_valid_common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "response_format": st.just({"type": "json_object"})})
_valid_completion = st.fixed_dictionaries(
    {"model": st.just("smollm2"), "max_tokens": st.integers(1, 8),
     "prompt": _text | st.lists(st.integers(0, 49151), min_size=1, max_size=20)},
    optional={**_valid_common, "echo": st.booleans(), "logprobs": st.integers(0, 5)})
_raw = st.binary(max_size=300) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": [', b"\xff\xfe"])
BODIES = st.one_of(st.tuples(st.just(CHAT), _valid_chat), st.tuples(st.just(COMPLETIONS), _valid_completion),
                   st.tuples(st.just(CHAT), _chat), st.tuples(st.just(COMPLETIONS), _completion),
                   st.tuples(st.sampled_from([CHAT, COMPLETIONS]), _raw))


def draw(n: int, seed: int = 0) -> list[tuple[str, object]]:
    """n (path, body) pairs: body is a JSON-able object, or bytes sent as they are."""
    out: list[tuple[str, object]] = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=False, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(BODIES)
    def collect(item):
        out.append(item)

    import random
    random.seed(seed)
    collect()
    return out[:n]
