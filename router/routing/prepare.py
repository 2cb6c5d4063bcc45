"""What the router needs to know about one request before routing it: its prompt tokens (the engines' own
tokenizer and chat template), its chained block hashes, its cache salt and its session key.

Tokenizing is best-effort: a body the tokenizer cannot render is still routed (without a cache signal) and
the engine answers with its own, precise error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from contract.messages import chat_messages
from router.routing.prefix_index import request_block_hashes
from router.routing.tokens import PromptTokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(slots=True)
class PreparedRequest:
    token_ids: list[int] | None
    cache_salt: str | None
    session_key: str | None
    stream: bool
    adapter: str | None = None  # the LoRA adapter the request names (its model), None for a base model
    ttft_target_s: float | None = None  # the request's time-to-first-token target (contract/slo.py), if any
    tpot_target_s: float | None = None  # its time-per-output-token target, if any
    best_effort: bool = False  # no replica was predicted to meet its targets, and its pool serves it anyway
    _hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def block_hashes(self, block_size: int, hash_seed: int) -> list[int]:
        """Chained hashes of the blocks a prefix hit could cover, computed once per (block size, seed)."""
        if self.token_ids is None:
            return []
        key = (block_size, hash_seed)
        hashes = self._hashes.get(key)
        if hashes is None:
            hashes = self._hashes[key] = request_block_hashes(self.token_ids, block_size, hash_seed,
                                                              self.cache_salt, self.adapter)
        return hashes


def prompt_token_ids(path: str, body: Mapping, tokenizer: PromptTokenizer | None) -> list[int] | None:
    """The prompt's token ids exactly as the engine will see them, or None when unknown."""
    try:
        if path == CHAT_PATH:
            if tokenizer is None:
                return None
            messages = chat_messages(body.get("messages"))
            add_generation_prompt = body.get("add_generation_prompt", True)
            tools = body.get("tools")
            return tokenizer.chat(messages, add_generation_prompt is not False,
                                  tools if isinstance(tools, list) and tools else None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)  # token ids need no tokenizer
        if isinstance(prompt, str) and tokenizer is not None:
            return tokenizer.completion(prompt)
    except (ValueError, TypeError, KeyError):  # MessageError and TokenizerError are ValueErrors
        return None
    return None


def prompt_token_counts(path: str, body: Mapping, tokenizer: PromptTokenizer | None,
                        prep: PreparedRequest) -> list[int]:
    """The token count of every prompt of the request (a completions request may carry several), for its
    token reservation; 0 for a prompt that cannot be counted (the engine will refuse it)."""
    prompt = body.get("prompt") if path == COMPLETIONS_PATH else None
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        counts = []
        for p in prompt:
            ids = prompt_token_ids(path, {"prompt": p}, tokenizer)
            counts.append(len(ids) if ids is not None else 0)
        return counts
    return [prep.num_prompt_tokens]


def positive_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def max_tokens_field(path: str, body: Mapping) -> str:
    """The body field that holds the request's max_tokens (a chat request may use max_completion_tokens)."""
    return "max_completion_tokens" if path == CHAT_PATH and "max_completion_tokens" in body else "max_tokens"


def session_key(body: Mapping, headers: Mapping[str, str]) -> str | None:
    """The key that keeps a request with the others that share it (the hash ring, bounded by load): the client's
    `x-session-id` header, else OpenAI's `prompt_cache_key` (a routing hint for requests that share a long
    prefix), else its `user`."""
    key = headers.get("x-session-id")
    if key:
        return key
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def prepare_request(path: str, body: Mapping, headers: Mapping[str, str], tokenizer: PromptTokenizer | None,
                    need_tokens: bool) -> PreparedRequest:
    salt = body.get("cache_salt")
    return PreparedRequest(
        token_ids=prompt_token_ids(path, body, tokenizer) if need_tokens else None,
        cache_salt=salt if isinstance(salt, str) and salt else None,
        session_key=session_key(body, headers),
        stream=body.get("stream") is True,
    )
