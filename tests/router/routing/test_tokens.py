"""The router's prompt tokens equal the engine tokenizer's, with the piece cache on (SmolLM2 tokenizer)."""

from __future__ import annotations

import os
import random

import pytest

from router.routing.prepare import prepare_request
from router.routing.tokens import PromptTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.model

_ALPHABET = ["hello", "world", " ", "  ", "\n", "\n\n", "é", "🙂", "<|im_end|>", "<|im_start|>", "<b>", "x1",
             "don't", "’", "\t", "<|endoftext|>", "im_end", "|>", "<|", "123", "4567", "?!", "中文"]


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 30)))


def test_piecewise_chat_encoding_is_exact_and_reuses_history(tok):
    pt = PromptTokenizer(tok)
    assert pt.piecewise
    rng = random.Random(7)
    system = {"role": "system", "content": "You answer questions about trains. " * 20}
    for conv in range(25):
        msgs = [system] if conv % 2 else []
        for _turn in range(4):
            msgs.append({"role": "user", "content": _text(rng)})
            assert pt.chat(msgs) == tok.apply_chat_template(msgs)
            assert pt.chat(msgs, add_generation_prompt=False) == tok.apply_chat_template(msgs, False)
            msgs.append({"role": "assistant", "content": _text(rng)})
    assert pt.hits > pt.misses  # follow-up turns re-encode only their new pieces
    for _ in range(50):
        text = _text(rng)
        assert pt.encode_text(text) == tok.encode(text)
    assert pt.completion("The sky is") == tok.encode("The sky is", add_special_tokens=True)


def test_piece_cache_is_bounded(tok):
    pt = PromptTokenizer(tok, max_cached_chars=2000)
    for i in range(200):
        pt.encode_text(f"<|im_start|>user\nmessage number {i} " * 3)
    assert pt._cached_chars <= 2000


def test_prepare_request(tok):
    pt = PromptTokenizer(tok)
    msgs = [{"role": "user", "content": "hi"}]
    prep = prepare_request("/v1/chat/completions", {"messages": msgs, "cache_salt": "t1", "user": "u", "stream": True},
                           {}, pt, True)
    assert prep.token_ids == tok.apply_chat_template(msgs)
    assert (prep.cache_salt, prep.session_key, prep.stream) == ("t1", "u", True)
    prep = prepare_request("/v1/completions", {"prompt": [5, 6, 7]}, {"x-session-id": "s"}, None, True)
    assert (prep.token_ids, prep.session_key, prep.stream) == ([5, 6, 7], "s", False)
    # OpenAI's prompt_cache_key keeps requests sharing a prefix together: after x-session-id, before user
    both = {"prompt": [5], "prompt_cache_key": "docs-v2", "user": "u"}
    assert prepare_request("/v1/completions", both, {}, None, False).session_key == "docs-v2"
    assert prepare_request("/v1/completions", both, {"x-session-id": "s"}, None, False).session_key == "s"
    # a body the template cannot render is routed without a cache signal; the engine reports the error
    prep = prepare_request("/v1/chat/completions", {"messages": [{"role": 3}]}, {}, pt, True)
    assert prep.token_ids is None and prep.block_hashes(16, 0) == []
    assert prepare_request("/v1/chat/completions", {"messages": msgs}, {}, pt, False).token_ids is None


def test_piece_cache_costs_about_two_bytes_per_cached_character(tok):
    """The router's biggest cache: token ids kept as 4-byte arrays, not tuples of Python ints (about 8 bytes
    per character), so its 64 Mi-character bound is about 130 MB of router memory."""
    import tracemalloc

    from kvfleet.workload import words

    rng = random.Random(3)
    texts = [f"<|im_start|>user\n{words(rng, rng.randint(20, 200))}<|im_end|>" for _ in range(400)]
    pt = PromptTokenizer(tok)
    tracemalloc.start()
    try:
        for text in texts:
            pt.encode_text(text)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pt._cached_chars > 200_000
    assert used / pt._cached_chars < 3.0, f"{used / pt._cached_chars:.2f} bytes per cached character"
