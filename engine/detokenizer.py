"""Incremental detokenization of one sequence: new text per new token, never broken UTF-8.

Interface (used by engine/stop.py's StopChecker and the engine loop):

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
    text = detok.add([token_id])   # the new text those tokens complete ("" while a character is split)
    text = detok.flush()           # at the end: whatever is still held back (a character cut off by the end)

`tokenizer` is anything with `decode(ids, skip_special_tokens=bool) -> str` (engine.tokenizer.Tokenizer or a
Hugging Face tokenizer). The concatenation of everything `add` and `flush` return equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers (Llama 3, SmolLM2,
Qwen2, GPT-2); for SentencePiece tokenizers the first token keeps the leading space the prompt context
gives it (like vLLM), where a standalone decode would strip it.

How: a window of token ids (a few prompt tokens for context, the last emitted tokens, then the tokens
not yet turned into text) is decoded, and the text beyond the decoded "already emitted" part is new.
Text ending in U+FFFD (a multi-byte character split over tokens) is held back until the next token
completes it. Work per token is O(window), independent of the sequence's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the first output token (vLLM uses the same)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 context_tokens: int = _CONTEXT_TOKENS):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        window = list(prompt_token_ids[max(0, len(prompt_token_ids) - context_tokens):])
        text = self._decode(window)
        if text.endswith(_REPLACEMENT):  # the prompt ends inside a character: start without context
            window, text = [], ""
        self._window = window  # token ids: [emitted context | unread]
        self._read = len(window)  # window[:_read] is decoded into _read_text and already accounted for
        self._read_text = text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new token ids; return the text they complete."""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            return ""  # an unfinished character: wait for the tokens that complete it
        if len(text) <= len(self._read_text):
            del self._window[self._read:]  # tokens that add no text (skipped special tokens): drop them
            return ""
        new = text[len(self._read_text):]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return new

    def flush(self) -> str:
        """The text held back at the end of the sequence (a split character decodes as U+FFFD)."""
        text = self._decode(self._window)
        new = text[len(self._read_text):] if len(text) > len(self._read_text) else ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
