"""POST /v1/completions: text or token prompts (one or a batch) → engine → OpenAI completion or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput
from engine.server import serving
from engine.server.errors import APIError, bad_request
from engine.server.generation import engine_error, merge, prime, run
from engine.server.protocol import CompletionRequest
from engine.server.serving import ServerState
from engine.server.streaming import SSE_DONE, ClientGone, sse, sse_response, watch_disconnect
from engine.tokenizer import TokenizerError


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    engine = state.engine_or_503()
    tok = engine.tokenizer
    prompts: list[list[int]] = []
    texts: list[str] = []
    for i, p in enumerate(req.prompts()):
        param = "prompt" if len(req.prompts()) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            try:
                ids = tok.encode(p, add_special_tokens=True)
            except TokenizerError as e:
                raise bad_request(str(e), param) from None
            texts.append(p)
        else:
            serving.check_token_ids(p, tok.vocab_size, param)
            ids = p
            texts.append(tok.decode(p) if req.echo else "")
        if not ids:
            raise bad_request("the prompt is empty", param)
        prompts.append(ids)
    params = []
    kv_tokens = serving.kv_capacity(engine)
    for i, ids in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = serving.max_tokens_for(req.max_tokens, len(ids), engine.max_model_len, kv_tokens, "max_tokens",
                                            param)
        params.append(serving.build_params(req, max_tokens, req.logprobs, tok.vocab_size))
    state.admit(engine, len(prompts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    metrics = request.app.state.metrics
    gens = [run(engine, ids, p, rid if len(prompts) == 1 else f"{rid}-{k}", req.cache_salt, metrics, state.inflight,
                arrival) for k, (ids, p) in enumerate(zip(prompts, params, strict=True))]
    echo = texts if req.echo else None
    if req.stream:
        primed = []
        try:
            for g in gens:
                primed.append(await prime(g))
        except Exception as e:
            for g in primed:
                await g.aclose()
            raise engine_error(e) from None
        return sse_response(_stream(state, req, merge(primed), len(prompts), rid, model, created, echo),
                            {"X-Request-Id": rid})

    async def collect() -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(merge(gens)) as g:
            async for k, out in g:
                finals[k] = out
        return finals

    try:
        finals = await watch_disconnect(request, collect())
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:
        raise engine_error(e) from None
    if not all(serving.completed(f) for f in finals):
        raise APIError(503, "the request was aborted before it finished (server shutting down)", None, "aborted")
    choices = []
    for k, final in enumerate(finals):
        for o in sorted(final.outputs, key=lambda c: c.index):
            prefix = echo[k] if echo else ""
            lp = None
            if req.logprobs is not None:
                lp = serving.completion_logprobs(state, o.logprobs or [], len(prefix))
            choices.append({"index": k * req.n + o.index, "text": prefix + o.text, "logprobs": lp,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": serving.usage(finals), "system_fingerprint": None}
    return JSONResponse(body, headers={"X-Request-Id": rid})


async def _stream(state: ServerState, req: CompletionRequest, outs: AsyncIterator[tuple[int, RequestOutput]],
                  num_prompts: int, rid: str, model: str, created: int,
                  echo: list[str] | None) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    include_usage = req.include_usage()
    continuous = include_usage and req.stream_options.continuous_usage_stats
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    finished: set[int] = set()
    last: dict[int, RequestOutput] = {}
    try:
        async with aclosing(outs) as g:
            async for k, out in g:
                last[k] = out
                for o in out.outputs:
                    idx = k * req.n + o.index
                    if idx in finished:
                        continue
                    start = sent_text.get(idx, 0)
                    delta = o.text[start:] if len(o.text) >= start else ""
                    if echo and idx not in sent_text:
                        delta = echo[k] + delta
                    sent_text[idx] = max(start, len(o.text))
                    lp = None
                    if req.logprobs is not None and o.logprobs:
                        new = o.logprobs[sent_lp.get(idx, 0):]
                        lp = serving.completion_logprobs(state, new, start)
                        sent_lp[idx] = len(o.logprobs)
                    if o.finish_reason is not None:
                        finished.add(idx)
                    if not delta and lp is None and o.finish_reason is None:
                        continue
                    chunk = {**base, "choices": [{"index": idx, "text": delta, "logprobs": lp,
                                                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]}
                    if continuous:
                        chunk["usage"] = serving.usage([out])
                    yield sse(chunk)
    except Exception as e:
        yield serving.stream_error(e)
    else:
        if (end := serving.stream_end(base, [last.get(k) for k in range(num_prompts)], include_usage)) is not None:
            yield end
    yield SSE_DONE
