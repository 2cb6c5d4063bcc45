"""Incremental detokenization on the real SmolLM2 tokenizer: equals the full decode, never splits a character."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽.",
    "中文测试：你好，世界！日本語のテキストも。한국어도 있습니다.",
    "Combining marks: e\u0301 a\u0308 n\u0303 Z\u0351\u0327a\u0310lg\u0334o and Devanagari नमस्ते.",
    "Math ∀x∈ℝ: x² ≥ 0, arrows ⟶ ⇒, box drawing ┌─┐, and a zero-width joiner a\u200db.",
    "  leading spaces,\ttabs,\nnewlines\n\n and trailing spaces   ",
    "Mixed: Ελληνικά, кириллица, עברית, العربية, ไทย, 🧪 test ✔️.",
    "",
]


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import load_tokenizer
    return load_tokenizer("smollm2")


def stream(tok, prompt_ids, output_ids, skip=True, chunk=1):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.add(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Answer:", "Say something in 中文 🎉"])
def test_incremental_equals_full_decode_and_never_breaks_a_character(tok, text, prompt):
    prompt_ids, out = tok.encode(prompt), tok.encode(text)
    pieces, tail = stream(tok, prompt_ids, out)
    assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=True) == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)


def test_a_character_split_over_tokens_is_held_until_complete(tok):
    out = tok.encode(" 🎉 ok")
    singles = [tok.decode([t]) for t in out]
    assert sum("\ufffd" in s for s in singles) >= 2  # the emoji's bytes really are spread over tokens
    pieces, _ = stream(tok, [], out)
    emitted_at = [i for i, p in enumerate(pieces) if "🎉" in p]
    assert len(emitted_at) == 1 and all(p == "" for p in pieces[1:emitted_at[0]])


def test_chunks_of_several_tokens(tok):
    out = tok.encode(TEXTS[1] + TEXTS[2])
    for chunk in (2, 3, 7):
        pieces, tail = stream(tok, tok.encode("Hi"), out, chunk=chunk)
        assert "".join(pieces) + tail == TEXTS[1] + TEXTS[2]


def test_output_cut_inside_a_character_is_flushed_at_the_end(tok):
    out = tok.encode("ab 🎉")
    cut = out[:-1]  # the last byte of the emoji is missing
    pieces, tail = stream(tok, [], cut)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + tail == tok.decode(cut)
    assert tail.endswith("\ufffd")


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("x 🎉 done")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    pieces, tail = stream(tok, ids[:split], ids[split:])
    assert "".join(pieces) + tail == tok.decode(ids[split:])


def test_special_tokens_skipped_or_kept(tok):
    chat = tok.encode("<|im_start|>assistant\nHi 世界<|im_end|>\n<|im_end|>")
    assert tok.eos_token_id in chat
    for skip in (True, False):
        pieces, tail = stream(tok, [], chat, skip=skip)
        assert "".join(pieces) + tail == tok.decode(chat, skip_special_tokens=skip)
    assert "<|im_end|>" not in "".join(stream(tok, [], chat, skip=True)[0])


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.longest, self.calls = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_length(tok):
    counting = CountingTokenizer(tok)
    out = tok.encode(" ".join(TEXTS) * 20)
    out += [tok.eos_token_id] * 300  # ignore_eos runs: skipped special tokens must not pile up either
    out += tok.encode(" the end")
    assert len(out) > 2000
    pieces, tail = stream(counting, tok.encode("Prompt " * 100), out)
    assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=True)
    assert counting.longest <= 16
    assert counting.calls <= 2 * len(out) + 3


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_streams_match_the_full_decode(tok, data):
    """Any token ids at all (split bytes, stray continuation bytes, special tokens) in any chunking."""
    vocab = tok.vocab_size
    ids = st.integers(0, vocab - 1)
    prompt = data.draw(st.lists(ids, max_size=8))
    out = data.draw(st.lists(st.one_of(ids, st.integers(0, 2), st.integers(216, 300)), max_size=40))
    skip = data.draw(st.booleans())
    chunk = data.draw(st.integers(1, 4))
    pieces, tail = stream(tok, prompt, out, skip=skip, chunk=chunk)
    full = tok.decode(out, skip_special_tokens=skip)
    assert "".join(pieces) + tail == full
    shown = ""
    for p in pieces:  # nothing is ever shown that the full decode does not keep (no premature U+FFFD)
        shown += p
        assert full.startswith(shown)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), prompt=st.text(max_size=20))
def test_random_text_round_trips_without_replacement_characters(tok, text, prompt):
    out = tok.encode(text)
    pieces, tail = stream(tok, tok.encode(prompt), out)
    assert "".join(pieces) + tail == tok.decode(out)
    if "\ufffd" not in text and tok.decode(out) == text:
        assert not any("\ufffd" in p for p in pieces) and tail == ""


def sentencepiece_tokenizer():
    """A Llama-style SentencePiece tokenizer (▁ for spaces, byte fallback, leading space stripped)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "▁Hello", "▁world", "!", "▁again", "lo", "▁世"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return hf, vocab


def test_sentencepiece_leading_space_comes_from_the_prompt_context():
    hf, vocab = sentencepiece_tokenizer()
    ids = lambda *ps: [vocab[p] for p in ps]  # noqa: E731
    prompt = ids("<s>", "▁Hello")
    out = ids("▁world", "!", "<0xE4>", "<0xB8>", "<0x96>", "lo", "▁again", "</s>", "▁", "▁世")
    pieces, tail = stream(hf, prompt, out)
    full = hf.decode(prompt + out, skip_special_tokens=True)
    assert "".join(pieces) + tail == full[len(hf.decode(prompt, skip_special_tokens=True)):]
    assert "".join(pieces) == " world!世lo again  世"  # a standalone decode would drop the first space
    # byte-fallback pieces are decoded as one run (all-or-nothing UTF-8): held until the run ends
    assert pieces[2:6] == ["", "", "", "世lo"]
    assert not any("\ufffd" in p for p in pieces) and tail == ""
    # without a prompt there is no context: the first token's space is stripped, like a plain decode
    pieces, tail = stream(hf, [], out)
    assert "".join(pieces) + tail == hf.decode(out, skip_special_tokens=True)


def test_invalid_bytes_from_the_model_are_emitted_and_do_not_pile_up(tok):
    """A run of stray UTF-8 continuation bytes never becomes a character: it must not stall the stream."""
    stray = tok.hf.convert_tokens_to_ids("©")  # byte-level BPE's token for the byte 0xA9: a continuation byte
    assert tok.decode([stray, stray]) == "\ufffd\ufffd"
    assert tok.decode(tok.encode("é")[:1] + [stray]) == "é\ufffd"
    out = tok.encode("a") + [stray] * 200 + tok.encode(" 🎉 ok")
    counting = CountingTokenizer(tok)
    pieces, tail = stream(counting, tok.encode("x"), out)
    assert "".join(pieces) + tail == tok.decode(out)
    assert counting.longest <= 16
    assert "\ufffd" in "".join(pieces[:100])  # the stray bytes went out while the run was still going
    assert not any(p.endswith("\ufffd") and "🎉" in p for p in pieces)
    assert "🎉" in "".join(pieces)


def test_sentencepiece_invalid_byte_run_is_never_shown_early():
    """Byte fallback turns a whole run of <0xNN> pieces into U+FFFDs when any byte of it is invalid,
    even an ASCII byte that alone would decode: nothing of the run may be shown before it ends."""
    hf, vocab = sentencepiece_tokenizer()
    ids = lambda *ps: [vocab[p] for p in ps]  # noqa: E731
    out = ids("▁world", "<0x69>", "<0xB8>", "</s>", "<0x41>", "▁again")
    for skip in (True, False):
        full = hf.decode(out, skip_special_tokens=skip)
        assert full.startswith("world\ufffd\ufffd")  # the "i" byte is part of an invalid run
        pieces, tail = stream(hf, [], out, skip=skip)
        shown = ""
        for p in pieces:
            shown += p
            assert full.startswith(shown)
        assert shown + tail == full


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sentencepiece_random_token_streams(data):
    hf, vocab = sentencepiece_tokenizer()
    pieces_st = st.one_of(st.integers(0, len(vocab) - 1), st.sampled_from(
        [vocab[p] for p in ["<s>", "</s>", "▁", "▁Hello", "lo", "▁世", "<0xE4>", "<0xB8>", "<0x96>", "<0x41>", "<0x80>"]]))
    prompt = data.draw(st.lists(pieces_st, max_size=6))
    out = data.draw(st.lists(pieces_st, max_size=25))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(hf, prompt, skip_special_tokens=skip)
    ctx = detok._window[:]  # the prompt context it chose (none when the prompt ends inside a character)
    dec = lambda ids: hf.decode(ids, skip_special_tokens=skip) if ids else ""  # noqa: E731
    full = dec(ctx + out)[len(dec(ctx)):]
    shown = ""
    for t in out:
        shown += detok.add([t])
        assert full.startswith(shown)
    assert shown + detok.flush() == full
