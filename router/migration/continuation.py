"""Whether a request's stream can move to another replica, and the request that continues one of its choices.

A choice continues as a streamed `/v1/completions` request (kvfleet's engines and vLLM take token-id prompts):
its prompt is the original prompt's token ids (as the engine tokenized it, chat template applied) followed by
the ids of every token the choice generated, so nothing is re-tokenized; `max_tokens` (and `min_tokens`) lose
what was generated; every sampling field goes along unchanged; `n` is 1 (each choice goes on alone); chat
logprobs are asked as completions logprobs (relay.py turns them back). `return_token_ids` is asked again, so
the continuation can move too.

What cannot move (its stream ends with an error event, as before): constrained decoding (tools, response_format,
guided_*, structured_outputs: the grammar's state is the dead replica's), `echo`, a batch of prompts, and
prompt logprobs.
"""

from __future__ import annotations

from typing import Any

from contract.request import Endpoint, OpenAIRequest
from contract.token_ids import RETURN_TOKEN_IDS

# fields that do not go on: the chat's prompt and its shape, what is set anew below
_DROPPED = frozenset({
    "messages", "prompt", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "functions", "function_call",
    "max_completion_tokens", "max_tokens", "min_tokens", "logprobs", "top_logprobs", "n", "best_of", "stream",
    "stream_options", "echo", "suffix", "response_format", RETURN_TOKEN_IDS, "modalities", "audio",
})
_CONSTRAINED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def why_not(req: OpenAIRequest) -> str | None:
    """Why this request's stream cannot move to another replica; None if it can."""
    if not req.stream:
        return "not streamed"  # a whole response is retried from the start (router/http/proxy.py)
    if req.get("tools"):
        return "tools"
    fmt = req.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    if any(req.get(name) is not None for name in _CONSTRAINED):
        return "constrained decoding"
    if req.endpoint is Endpoint.COMPLETIONS:
        if req.get("echo"):
            return "echo"
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
            return "a batch of prompts"
    if req.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    return None


def top_logprobs(req: OpenAIRequest) -> int | None:
    """How many top logprobs each token gets (None: no logprobs), in either endpoint's terms."""
    if req.endpoint is Endpoint.CHAT:
        if req.get("logprobs") is not True:
            return None
        k = req.get("top_logprobs")
        return k if isinstance(k, int) else 0
    k = req.get("logprobs")
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def remaining(req: OpenAIRequest, generated: int) -> int | None:
    """Tokens the choice may still generate (None: no limit but a stop or the context)."""
    return None if req.limit is None else req.limit - generated


def continuation_body(req: OpenAIRequest, prompt_ids: list[int], generated: list[int]) -> dict[str, Any]:
    """The /v1/completions body that continues one choice of `req` (as it went upstream) after `generated`."""
    body = {k: v for k, v in _fields(req).items() if k not in _DROPPED}
    body["prompt"] = list(prompt_ids) + list(generated)
    body["max_tokens"] = remaining(req, len(generated))  # null: until a stop or the context
    min_tokens = req.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens - len(generated) > 0:
        body["min_tokens"] = min_tokens - len(generated)
    k = top_logprobs(req)
    if k is not None:
        body["logprobs"] = k
    body["n"] = 1
    body["stream"] = True
    body[RETURN_TOKEN_IDS] = True
    return body


def _fields(req: OpenAIRequest) -> dict[str, Any]:
    names = set(req.body) | set(req.changes)
    return {k: v for k in names if (v := req.get(k, _ABSENT)) is not _ABSENT}


_ABSENT = object()
