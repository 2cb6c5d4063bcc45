"""The router's view of prompt tokens: exactly the engine's (same tokenizer, chat template and message
normalisation, contract/messages.py), computed cheaply for long conversations.

Hugging Face fast tokenizers cut the text at added tokens (`<|im_start|>`, `<|im_end|>`, ...) before
anything else and encode the pieces between them independently. A chat-templated conversation is therefore
a sequence of pieces that repeat from turn to turn (the system prompt, every earlier message), and the
router caches piece → token ids (LRU, bounded in characters): each follow-up turn only encodes its new
message instead of the whole history. The ids are kept as 4-byte arrays, so a cached character costs about
2 bytes (the text and its share of the ids; a tuple of Python ints cost about 8): the default bound of 64 Mi
characters holds the recent history of thousands of conversations in about 130 MB. The cache is used only for tokenizers where that cutting rule
holds (no added token with lstrip/rstrip/single_word), and it checks itself against the plain encoding at
start-up; otherwise every prompt is encoded in full.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

log = logging.getLogger("kvfleet.router.tokens")

_SELF_CHECK = [
    [{"role": "system", "content": "You are helpful.  Answer briefly!"},
     {"role": "user", "content": "Hi there,\n how are you?"}, {"role": "assistant", "content": "Fine. And you?"},
     {"role": "user", "content": "  spaces  and émojis 🙂 and <b>tags</b>\n\n"}],
    [{"role": "user", "content": ""}],
]


class PromptTokenizer:
    def __init__(self, tokenizer, max_cached_chars: int = 64 * 1024 * 1024):
        self.tok = tokenizer
        self.max_cached_chars = max_cached_chars
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_chars = 0
        self._special: dict[str, int] = {}
        self._split: re.Pattern | None = None
        self.hits = self.misses = 0
        added = getattr(tokenizer, "added_tokens", None)
        if not added:
            return
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            log.info("tokenizer has added tokens with strip rules: encoding prompts in full")
            return
        self._special = {t.content: i for i, t in added.items()}
        self._split = re.compile("|".join(re.escape(c) for c in sorted(self._special, key=len, reverse=True)))
        for msgs in _SELF_CHECK:
            if self.chat(msgs) != tokenizer.apply_chat_template(msgs):
                log.warning("piecewise encoding differs from the tokenizer's: encoding prompts in full")
                self._split = None
                break
        self._cache.clear()
        self._cached_chars = 0

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text with special-token strings recognised (add_special_tokens=False)."""
        if self._split is None:
            return self.tok.encode(text)
        out: list[int] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                out.extend(self._piece(text[pos:m.start()]))
            out.append(self._special[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self._piece(text[pos:]))
        return out

    def _piece(self, piece: str) -> array:
        cache = self._cache
        ids = cache.get(piece)
        if ids is not None:
            self.hits += 1
            cache.move_to_end(piece)
            return ids
        self.misses += 1
        ids = array("i", self.tok.encode(piece))
        if len(piece) <= self.max_cached_chars // 4:
            cache[piece] = ids
            self._cached_chars += len(piece)
            while self._cached_chars > self.max_cached_chars:
                old, _ = cache.popitem(last=False)
                self._cached_chars -= len(old)
        return ids

    def chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
             tools: Sequence[Mapping] | None = None) -> list[int]:
        """= tokenizer.apply_chat_template(messages, add_generation_prompt, tools)."""
        return self.encode_text(self.tok.render_chat(messages, add_generation_prompt, tools))

    def completion(self, prompt: str) -> list[int]:
        """= the engine's completion prompt encoding (special tokens added, as engine/server/completions.py)."""
        return self.tok.encode(prompt, add_special_tokens=True)
