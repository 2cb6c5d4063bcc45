"""POST /v1/chat/completions: chat template → engine → OpenAI chat response or SSE chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contract.messages import chat_messages
from engine.outputs import RequestOutput
from engine.server import serving
from engine.server.errors import APIError, bad_request
from engine.server.generation import engine_error, prime, run
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import ServerState
from engine.server.streaming import SSE_DONE, ClientGone, sse, sse_response, watch_disconnect
from engine.tokenizer import TokenizerError


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    engine = state.engine_or_503()
    tok = engine.tokenizer
    messages = chat_messages([m.model_dump() for m in req.messages])
    try:
        prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except TokenizerError as e:
        raise bad_request(str(e), "messages") from None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.max_tokens_for(req.requested_max_tokens(), len(prompt_ids), engine.max_model_len,
                                        serving.kv_capacity(engine), param, "messages")
    params = serving.build_params(req, max_tokens, req.requested_logprobs(), tok.vocab_size)
    state.admit(engine)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = run(engine, prompt_ids, params, rid, req.cache_salt, request.app.state.metrics, state.inflight,
              arrival)
    if req.stream:
        try:
            gen = await prime(gen)
        except Exception as e:
            raise engine_error(e) from None
        return sse_response(_stream(state, req, gen, rid, model, created), {"X-Request-Id": rid})

    async def collect() -> RequestOutput | None:
        last = None
        async with aclosing(gen) as g:
            async for out in g:
                last = out
        return last

    try:
        final = await watch_disconnect(request, collect())
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # the engine refused it (RequestTooLongError, SamplingParamsError) or is gone
        raise engine_error(e) from None
    if not serving.completed(final):
        raise APIError(503, "the request was aborted before it finished (server shutting down)", None, "aborted")
    choices = []
    for o in sorted(final.outputs, key=lambda c: c.index):
        lp = None
        if params.logprobs is not None:
            lp = {"content": serving.chat_logprobs(state, o.logprobs or [])}
        choices.append({"index": o.index, "message": {"role": "assistant", "content": o.text},
                        "logprobs": lp, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": serving.usage([final]), "system_fingerprint": None}
    return JSONResponse(body, headers={"X-Request-Id": rid})


async def _stream(state: ServerState, req: ChatCompletionRequest, gen: AsyncIterator[RequestOutput], rid: str,
                  model: str, created: int) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    include_usage = req.include_usage()
    continuous = include_usage and req.stream_options.continuous_usage_stats
    want_lp = req.logprobs
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    finished: set[int] = set()
    last: RequestOutput | None = None
    try:
        async with aclosing(gen) as g:
            for i in range(req.n):  # the role comes first, before any token (OpenAI does the same)
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            async for out in g:
                last = out
                for o in out.outputs:
                    if o.index in finished:
                        continue
                    start = sent_text.get(o.index, 0)
                    delta = o.text[start:] if len(o.text) >= start else ""
                    sent_text[o.index] = max(start, len(o.text))
                    lp = None
                    if want_lp and o.logprobs:
                        lp = {"content": serving.chat_logprobs(state, o.logprobs[sent_lp.get(o.index, 0):])}
                        sent_lp[o.index] = len(o.logprobs)
                    if o.finish_reason is not None:
                        finished.add(o.index)
                    if not delta and lp is None and o.finish_reason is None:
                        continue
                    chunk = {**base, "choices": [{"index": o.index, "delta": {"content": delta} if delta else {},
                                                  "logprobs": lp, "finish_reason": o.finish_reason,
                                                  "stop_reason": o.stop_reason}]}
                    if continuous:
                        chunk["usage"] = serving.usage([out])
                    yield sse(chunk)
    except Exception as e:
        yield serving.stream_error(e)
    else:
        if (end := serving.stream_end(base, [last], include_usage)) is not None:
            yield end
    yield SSE_DONE
