"""Whether a request can ever run on this engine: every check, in one place, before anything is queued.

    limits = EngineLimits(vocab_size, max_model_len, max_num_seqs, block_size, num_blocks)
    prompt, params = admit(prompt_token_ids, params, limits)

`admit` raises InvalidRequestError (param names the field: "prompt", "max_tokens", "n", "logit_bias",
"stop_token_ids") or RequestTooLongError, and returns the prompt as a list of ints and the params with
`max_tokens=None` resolved to everything that is left of the context and of the KV cache. Nothing after it
(scheduler, sampler) checks again. Pure: no I/O, no engine state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.errors import InvalidRequestError, RequestTooLongError
from engine.sampling_params import SamplingParams, SamplingParamsError


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What bounds a single request on this engine."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    pinned_blocks: int = 0  # of them, the most cache_control pins may keep (engine/kv/pins.py)

    @property
    def kv_tokens(self) -> int:
        """Token slots of the KV cache that pins can never take (no request can hold more)."""
        return self.block_size * (self.num_blocks - self.pinned_blocks)


def admit(prompt_token_ids: Sequence[int], params: SamplingParams,
          limits: EngineLimits) -> tuple[list[int], SamplingParams]:
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise InvalidRequestError("prompt", "the prompt must contain at least one token")
    bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt", f"prompt token id {bad} is outside the vocabulary "
                                            f"[0, {limits.vocab_size})")
    for tok, _ in params.logit_bias:
        if tok >= limits.vocab_size:
            raise SamplingParamsError("logit_bias", f"logit_bias token id {tok} is outside the vocabulary "
                                                    f"[0, {limits.vocab_size})")
    for tok in params.stop_token_ids:
        if not 0 <= tok < limits.vocab_size:
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids entry {tok} is outside the vocabulary "
                                                        f"[0, {limits.vocab_size})")
    if params.n > limits.max_num_seqs:
        raise SamplingParamsError("n", f"n ({params.n}) exceeds max_num_seqs ({limits.max_num_seqs})")
    max_tokens = _max_tokens(len(prompt), params.max_tokens, limits)
    if max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    return prompt, params


def _max_tokens(prompt_len: int, requested: int | None, limits: EngineLimits) -> int:
    """The output budget: the requested one, or all that is left of the context and of the KV cache."""
    left = limits.max_model_len - prompt_len
    if left < 1:
        raise RequestTooLongError("prompt", f"This model's maximum context length is {limits.max_model_len} "
                                            f"tokens, but the prompt has {prompt_len} tokens (no room for "
                                            f"output). Shorten the prompt.")
    if requested is not None and requested > left:
        raise RequestTooLongError("max_tokens", f"This model's maximum context length is {limits.max_model_len} "
                                                f"tokens. However, you requested {prompt_len + requested} tokens "
                                                f"({prompt_len} in the prompt, {requested} for the completion). "
                                                f"Reduce the prompt or max_tokens.")
    kv_left = limits.kv_tokens + 1 - prompt_len  # the last sampled token never needs a KV slot
    budget = min(left, kv_left) if requested is None else requested
    if budget > kv_left or budget < 1:
        pinned = f", {limits.pinned_blocks} of them kept for cache_control pins" if limits.pinned_blocks else ""
        slots = prompt_len + max(budget, 1) - 1
        raise RequestTooLongError("max_tokens" if requested is not None else "prompt",
                                  f"the request needs up to {slots} KV slots ({-(-slots // limits.block_size)} "
                                  f"blocks of {limits.block_size}) but the KV cache holds only "
                                  f"{limits.num_blocks} blocks{pinned} ({limits.kv_tokens} tokens); reduce the prompt "
                                  f"or max_tokens")
    return budget
