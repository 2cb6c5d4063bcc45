"""One OpenAI formatter for chat and completions: request deltas → SSE chunks, or one response body.

    fmt = ChatFormat(token_text)  |  CompletionFormat(token_text)
    reply = Reply(fmt, request_id, model, created, n, want_logprobs, echo, prompt_ids, cache_control)
    body_iter = reply.stream(outs, num_prompts, include_usage, continuous_usage)   # SSE bytes, ends with [DONE]
    body = await reply.collect(outs, num_prompts)                                     # or APIError 503 if aborted

`outs` yields (prompt index k, RequestDelta); choice k * n + i is completion i of prompt k. Each delta's
new text and logprobs are sent as they are (streaming) or appended to the choice (whole response): no
output is copied per step. The two formats differ only in the shape of a choice and of its logprobs.
With `prompt_ids` (the request asked for `return_token_ids`) every chunk carries its tokens' ids, a chunk goes
out for every token even while its text is held back, and the prompt's ids come along (contract/token_ids.py).

A stream sends nothing before a choice has its first token: a chat choice's first chunk carries the role
and the first text in one delta, or the role and the finish reason for a choice that ends without text.
A failure (or an abort) before the stream's first chunk is raised as an APIError, so that the response
can still answer it with an HTTP status (engine/server/streaming.py); after it, it is an SSE error event
followed by `data: [DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.token_ids import PROMPT_TOKEN_IDS, TOKEN_IDS
from contract.usage_lookup import TIERS
from engine.outputs import RequestDelta, TokenLogprob
from engine.server.errors import APIError, engine_error
from engine.server.streaming import SSE_DONE, sse, sse_error
from engine.structured.tool_parser import ToolCallStream

if TYPE_CHECKING:
    from engine.server.structured import ToolPlan

TokenText = Callable[[int], str]


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenText, tools: ToolPlan | None = None):
        self.token_text = token_text
        self.tools = tools

    def tool_stream(self) -> ToolCallStream | None:
        """A choice's reader of tool calls (engine/structured/tool_parser.py), for requests with tools."""
        t = self.tools
        return None if t is None else ToolCallStream(t.mode, t.names, t.name, lambda: f"call_{uuid.uuid4().hex[:24]}",
                                                     t.parallel)

    def logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict:
        out = []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            out.append({"token": tok, "logprob": _finite(lp.logprob), "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": (t := self.token_text(i)), "logprob": _finite(v),
                                          "bytes": list(t.encode())} for i, v in lp.top]})
        return {"content": out}

    def chunk_choice(self, index: int, text: str, lp: dict | None, finish: str | None, stop, first: bool,
                     calls: list[dict] | None = None) -> dict:
        """first: the choice's first chunk, which carries the role too; calls: tool_calls deltas."""
        if first:
            delta = {"role": "assistant", "content": text if text or not calls else None}
        else:
            delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}

    def full_choice(self, index: int, text: str, lp: dict | None, finish: str | None, stop) -> dict:
        message: dict = {"role": "assistant", "content": text}
        reader = self.tool_stream()
        if reader is not None:
            content, calls = reader.feed(text, True)
            if reader.calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenText):
        self.token_text = token_text

    def logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            tokens.append(tok)
            token_lps.append(_finite(lp.logprob))
            tops.append({self.token_text(i): _finite(v) for i, v in lp.top} or {tok: _finite(lp.logprob)})
            offsets.append(text_offset)
            text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chunk_choice(self, index: int, text: str, lp: dict | None, finish: str | None, stop, first: bool,
                     calls: list[dict] | None = None) -> dict:
        return self.full_choice(index, text, lp, finish, stop)

    def full_choice(self, index: int, text: str, lp: dict | None, finish: str | None, stop) -> dict:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}


Format = ChatFormat | CompletionFormat


@dataclass
class _Choice:
    prefix: str = ""  # echoed prompt text, sent before the first generated text
    pieces: list[str] = field(default_factory=list)  # whole responses only
    logprobs: list[TokenLogprob] = field(default_factory=list)  # whole responses only
    token_ids: list[int] = field(default_factory=list)  # whole responses with return_token_ids only
    offset: int = 0  # text_offset of the next token: the prefix and the tokens' texts so far (completions)
    opened: bool = False  # its first chunk (the echoed prefix, the chat role) went out
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tools: ToolCallStream | None = None  # chat requests with tools, streaming


class _Usage:
    """Token counts per prompt, from the deltas. OpenAI's fields always; cached tokens by the tier their blocks
    came from when there are any (`cached_tokens_by_tier`: device, lower_tier, peer); Anthropic's
    `cache_creation_input_tokens` (tokens of the cache_control prefix the request computed and pinned) and
    `cache_read_input_tokens` (prompt tokens read from the cache) when the request had breakpoints."""

    def __init__(self, num_prompts: int, cache_control: bool = False):
        self.cache_control = cache_control
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.created = [0] * num_prompts
        self.tiers = [(0, 0, 0)] * num_prompts
        self.completion = [0] * num_prompts
        self.finished = [False] * num_prompts

    def add(self, k: int, d: RequestDelta) -> None:
        self.prompt[k] = d.num_prompt_tokens
        self.cached[k] = d.num_cached_tokens
        self.created[k] = d.cache_creation_tokens
        self.tiers[k] = d.cached_tokens_by_tier
        self.completion[k] += sum(len(o.token_ids) for o in d.outputs)
        self.finished[k] = d.finished

    def body(self, ks: range | list[int]) -> dict:
        prompt, completion = sum(self.prompt[k] for k in ks), sum(self.completion[k] for k in ks)
        cached = sum(self.cached[k] for k in ks)
        details: dict = {"cached_tokens": cached}
        if cached:
            details["cached_tokens_by_tier"] = {
                tier: sum(self.tiers[k][i] for k in ks) for i, tier in enumerate(TIERS)}
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": details}
        if self.cache_control:
            out["cache_creation_input_tokens"] = sum(self.created[k] for k in ks)
            out["cache_read_input_tokens"] = cached
        return out


class Reply:
    def __init__(self, fmt: Format, request_id: str, model: str, created: int, n: int, want_logprobs: bool,
                 echo: list[str] | None = None, prompt_ids: list[list[int]] | None = None, cache_control: bool = False):
        self.fmt = fmt
        self.cache_control = cache_control  # the request had cache_control breakpoints: Anthropic's usage fields
        self.prompt_ids = prompt_ids  # per prompt, when the request asked for return_token_ids
        self.id = request_id
        self.model = model
        self.created = created
        self.n = n
        self.want_logprobs = want_logprobs
        self.echo = echo
        self.choices: dict[int, _Choice] = {}

    def _choice(self, k: int, i: int) -> _Choice:
        c = self.choices.get(k * self.n + i)
        if c is None:
            prefix = self.echo[k] if self.echo else ""
            c = self.choices[k * self.n + i] = _Choice(prefix=prefix, offset=len(prefix))
        return c

    def _completed(self, usage: _Usage) -> bool:
        """Every request finished on its own (stop/length), none aborted by a drain deadline or shutdown."""
        return all(usage.finished) and all(c.finish_reason != "abort" for c in self.choices.values())

    async def stream(self, outs: AsyncIterator[tuple[int, RequestDelta]], num_prompts: int, include_usage: bool,
                     continuous_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks, then `data: [DONE]`; APIError if it fails or is aborted before its first chunk."""
        base = {"id": self.id, "object": self.fmt.chunk_object, "created": self.created, "model": self.model}
        usage = _Usage(num_prompts, self.cache_control)
        sent = False
        try:
            async with aclosing(outs) as g:
                async for k, d in g:
                    usage.add(k, d)
                    for o in d.outputs:
                        idx = k * self.n + o.index
                        c = self._choice(k, o.index)
                        text = o.text if c.opened else c.prefix + o.text
                        lp = None
                        if self.want_logprobs and o.logprobs:
                            lp = self.fmt.logprobs(o.logprobs, c.offset)
                            c.offset += sum(len(self.fmt.token_text(t.token_id)) for t in o.logprobs)
                        if o.finish_reason is not None:
                            c.finish_reason = o.finish_reason
                        finish, calls = o.finish_reason, None
                        if isinstance(self.fmt, ChatFormat) and self.fmt.tools is not None:
                            c.tools = c.tools or self.fmt.tool_stream()
                            text, calls = c.tools.feed(text, finish is not None)
                            if finish == "stop" and c.tools.calls:
                                finish = "tool_calls"
                        ids = self.prompt_ids
                        if not text and not calls and lp is None and not (ids and o.token_ids) and (
                                o.finish_reason is None or o.finish_reason == "abort" and not sent):
                            continue  # nothing to say yet; an abort before any chunk is the 503 below
                        choice = self.fmt.chunk_choice(idx, text, lp, finish, o.stop_reason, not c.opened, calls)
                        chunk = {**base, "choices": [choice]}
                        if ids is not None:
                            choice[TOKEN_IDS] = o.token_ids
                            if isinstance(self.fmt, CompletionFormat) and not c.opened:
                                choice[PROMPT_TOKEN_IDS] = ids[k]
                            elif isinstance(self.fmt, ChatFormat) and not sent:
                                chunk[PROMPT_TOKEN_IDS] = ids[k]
                        c.opened = True
                        if continuous_usage:
                            chunk["usage"] = usage.body([k])
                        sent = True
                        yield sse(chunk)
        except Exception as e:
            err = e if isinstance(e, APIError) else engine_error(e)
            if not sent:
                raise err from None
            yield sse_error(err)
        else:
            if not self._completed(usage):
                if not sent:
                    raise _aborted()
                yield sse_error(_aborted())
            elif include_usage:
                yield sse({**base, "choices": [], "usage": usage.body(range(num_prompts))})
        yield SSE_DONE

    async def collect(self, outs: AsyncIterator[tuple[int, RequestDelta]], num_prompts: int) -> dict:
        """The whole response body; APIError if the engine failed or a request was aborted."""
        usage = _Usage(num_prompts, self.cache_control)
        async with aclosing(outs) as g:
            async for k, d in g:
                usage.add(k, d)
                for o in d.outputs:
                    c = self._choice(k, o.index)
                    c.pieces.append(o.text)
                    if self.prompt_ids is not None:
                        c.token_ids.extend(o.token_ids)
                    if o.logprobs:
                        c.logprobs.extend(o.logprobs)
                    if o.finish_reason is not None:
                        c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        if not self._completed(usage):
            raise _aborted()
        choices = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            lp = self.fmt.logprobs(c.logprobs, len(c.prefix)) if self.want_logprobs else None
            choice = self.fmt.full_choice(idx, c.prefix + "".join(c.pieces), lp, c.finish_reason, c.stop_reason)
            if self.prompt_ids is not None:
                choice[TOKEN_IDS] = c.token_ids
                if isinstance(self.fmt, CompletionFormat):
                    choice[PROMPT_TOKEN_IDS] = self.prompt_ids[idx // self.n]
            choices.append(choice)
        body = {"id": self.id, "object": self.fmt.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage.body(range(num_prompts)), "system_fingerprint": None}
        if self.prompt_ids is not None and isinstance(self.fmt, ChatFormat):
            body[PROMPT_TOKEN_IDS] = self.prompt_ids[0]
        return body


def _aborted() -> APIError:
    return APIError(503, "the request was aborted before it finished (server shutting down)", None, "aborted")


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(float(x), -9999.0)
