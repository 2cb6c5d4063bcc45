"""POST /v1/chat/completions: chat template → engine → OpenAI chat response or SSE chunks."""

from __future__ import annotations

import dataclasses
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from contract.messages import chat_messages
from engine.server import serving
from engine.server.errors import bad_request
from engine.server.formatter import ChatFormat
from engine.server.prompt_cache import cache_pin
from engine.server.protocol import ChatCompletionRequest
from engine.server.serving import ServerState
from engine.server.structured import compile_guide, structured_plan
from engine.tokenizer import TokenizerError


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    engine = state.engine_or_503()
    plan = structured_plan(req)
    messages = chat_messages([m.model_dump(exclude_none=True) for m in req.messages])
    try:
        prompt_ids = engine.tokenizer.apply_chat_template(messages, req.add_generation_prompt, plan.prompt_tools)
    except TokenizerError as e:
        raise bad_request(str(e), "messages") from None
    params = serving.build_params(req, req.requested_max_tokens(), req.requested_logprobs())
    pin = cache_pin(engine.tokenizer, req, messages, plan.prompt_tools, prompt_ids)
    if pin is not None:  # cache_control: the engine pins the marked prefix's blocks (engine/kv/pins.py)
        params = dataclasses.replace(params, cache_pin=pin)
    if plan.guide is not None:
        await compile_guide(engine.grammars, plan)  # waits on the grammar worker, never on the engine loop
        params = dataclasses.replace(params, guide=plan.guide)
    wire = {"prompt": "messages", "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None
            else "max_tokens"}
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await serving.respond(state, request, req, ChatFormat(state.token_text, plan.tools), model, rid, [prompt_ids], [params],
                                 wire, arrival)
