"""POST /v1/completions: text or token prompts (one or a batch) → engine → OpenAI completion or SSE."""

from __future__ import annotations

import dataclasses
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.server import serving
from engine.server.errors import bad_request
from engine.server.formatter import CompletionFormat
from engine.server.protocol import CompletionRequest
from engine.server.serving import ServerState
from engine.server.structured import compile_guide, structured_plan
from engine.tokenizer import TokenizerError


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    engine = state.engine_or_503()
    tok = engine.tokenizer
    raw = req.prompts()
    prompts: list[list[int]] = []
    for i, p in enumerate(raw):
        if not isinstance(p, str):
            prompts.append(p)
            continue
        try:
            prompts.append(tok.encode(p, add_special_tokens=True))
        except TokenizerError as e:
            raise bad_request(str(e), "prompt" if len(raw) == 1 else f"prompt[{i}]") from None

    def echo() -> list[str]:
        return [p if isinstance(p, str) else tok.decode(p) for p in raw]

    params = serving.build_params(req, req.max_tokens, req.logprobs)
    plan = structured_plan(req)
    if plan.guide is not None:
        await compile_guide(engine.grammars, plan)
        params = dataclasses.replace(params, guide=plan.guide)
    rid = f"cmpl-{uuid.uuid4().hex}"
    return await serving.respond(state, request, req, CompletionFormat(state.token_text), model, rid, prompts,
                                 [params] * len(prompts), {}, arrival, echo if req.echo else None)
