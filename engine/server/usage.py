"""POST /v1/kvfleet/usage/lookup (contract/usage_lookup.py): what requests used on this engine, by the router's
request id, from the server's usage book (engine/usage_book.py). Internal: the internal token where one is set."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse

from contract.usage_lookup import MAX_IDS
from engine.server.errors import bad_request
from engine.server.kv_events import check_internal_token
from engine.server.serving import ServerState


async def usage_lookup(state: ServerState, request: Request) -> JSONResponse:
    check_internal_token(state, request)
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise bad_request("the body must be JSON: {\"request_ids\": [...]}", "request_ids") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise bad_request("request_ids must be a list of strings", "request_ids")
    if len(ids) > MAX_IDS:
        raise bad_request(f"at most {MAX_IDS} request_ids per lookup, got {len(ids)}", "request_ids")
    found = state.usage.lookup(ids)
    return JSONResponse({"object": "kvfleet.usage_lookup",
                         "data": {k: v if isinstance(v, str) else v.to_dict() for k, v in found.items()}})
