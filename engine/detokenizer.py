"""Incremental detokenization of one sequence: new text per new token, never broken UTF-8.

Interface (used by engine/stop.py's StopChecker and the engine loop):

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
    text = detok.add([token_id])   # the new text those tokens complete ("" while a character is split)
    text = detok.flush()           # at the end: whatever is still held back (a character cut off by the end)

`tokenizer` is anything with `decode(ids, skip_special_tokens=bool) -> str` (engine.tokenizer.Tokenizer or a
Hugging Face tokenizer). The concatenation of everything `add` and `flush` return equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers (Llama 3, SmolLM2,
Qwen2, GPT-2), and every prefix of the stream is a prefix of that decode (nothing shown is retracted).
SentencePiece tokenizers (Llama 2, Mistral): the first token keeps the leading space the prompt context
gives it (like vLLM), where a standalone decode would strip it; if the tokenizer also has
`convert_ids_to_tokens`, runs of byte-fallback pieces (<0xE4>) are held until they end, because the
full decode turns a whole run into U+FFFDs when any byte of it is invalid.

How: a window of token ids (a few prompt tokens for context, the last emitted tokens, then the tokens
not yet turned into text) is decoded, and the text beyond the decoded "already emitted" part is new.
Text ending in U+FFFD (a multi-byte character split over tokens) is held back until the next token
completes it; U+FFFD reaches the stream only for bytes that can no longer become a character (invalid
UTF-8 the model produced, or a character cut off by the end). Work per token is O(window), independent
of the sequence's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the first output token (vLLM uses the same)
_MAX_SPLIT = 3  # an unfinished UTF-8 character is at most 3 bytes, so it spans at most 3 tokens


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
        self._convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._skipped: dict[int, bool] = {}  # token id -> removed by skip_special_tokens
        self._byte_pieces: dict[int, bool] = {}  # token id -> is a <0xNN> byte-fallback piece

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new token ids; return the text they complete."""
        if self._skip:  # a skipped special token adds nothing anywhere: keep it out of the window
            token_ids = [t for t in token_ids if not self._is_skipped(t)]
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        if self._is_byte_piece(self._window[-1]):
            return ""  # SentencePiece byte fallback decodes a run of <0xNN> pieces as a whole: wait for its end
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):  # an unfinished character: wait for the rest of it
            return self._release_final_bytes(text)
        if len(text) <= len(self._read_text):
            return ""
        return self._advance(len(self._window), text)

    def flush(self) -> str:
        """The text held back at the end of the sequence (a split character decodes as U+FFFD)."""
        text = self._decode(self._window)
        if len(text) <= len(self._read_text):
            return ""
        return self._advance(len(self._window), text)

    def _advance(self, upto: int, text: str) -> str:
        """Emit the text of window[_read:upto] (`text` = decode(window[:upto])); it becomes the context."""
        new = text[len(self._read_text):]
        self._window = self._window[self._read:]
        upto -= self._read
        self._read = upto
        self._read_text = self._decode(self._window[:upto])
        return new

    def _release_final_bytes(self, text: str) -> str:
        """An unfinished UTF-8 character has at most _MAX_SPLIT bytes, so it started within the last
        _MAX_SPLIT unread tokens that decode to something (a token that decodes to "" alone adds no bytes).
        Bytes before those are final even while the text ends in U+FFFD (invalid bytes the model made):
        emitting them keeps the stream moving and the window short."""
        if len(self._window) - self._read <= _MAX_SPLIT:
            return ""
        with_bytes = 0
        upto = len(self._window)
        while upto > self._read and with_bytes < _MAX_SPLIT:
            upto -= 1
            with_bytes += bool(self._decode([self._window[upto]]))
        if with_bytes < _MAX_SPLIT or upto <= self._read:
            return ""
        head = self._decode(self._window[:upto])
        if len(head) <= len(self._read_text) or not text.startswith(head):
            return ""
        return self._advance(upto, head)

    def _is_skipped(self, token_id: int) -> bool:
        """True for a token that skip_special_tokens removes (decodes to "" only when skipping)."""
        skipped = self._skipped.get(token_id)
        if skipped is None:
            skipped = self._skipped[token_id] = (
                self._decode([token_id]) == "" and self._tokenizer.decode([token_id], skip_special_tokens=False) != "")
        return skipped

    def _is_byte_piece(self, token_id: int) -> bool:
        """True for a SentencePiece byte-fallback piece such as <0xE4>."""
        if self._convert is None:
            return False
        byte = self._byte_pieces.get(token_id)
        if byte is None:
            piece = self._convert([token_id])[0]
            byte = self._byte_pieces[token_id] = (isinstance(piece, str) and len(piece) == 6
                                                  and piece.startswith("<0x") and piece.endswith(">"))
        return byte

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
