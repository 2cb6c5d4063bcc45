"""GET /v1/kv/events: the prefix cache's content as NDJSON, for routers to mirror.

The lines are encoded by contract/kv_wire.py: a snapshot of every cached hash as of `seq`, then the
events seq+1, seq+2, ..., and a heartbeat with the newest seq sent every 2 s. A subscriber that sees a
gap reconnects for a new snapshot. When an internal token is configured the endpoint needs
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from contract.kv_events import Heartbeat, Snapshot
from contract.kv_wire import encode_line
from engine.server.auth import TOKEN_CODE, token_matches
from engine.server.errors import APIError
from engine.server.serving import ServerState
from engine.server.streaming import DisconnectAwareStreamingResponse

HEARTBEAT_S = 2.0


def check_internal_token(state: ServerState, request: Request) -> None:
    token = state.config.internal_token
    if not token:
        return
    if not token_matches(request.headers.get("authorization"), token):
        raise APIError(401, "this endpoint needs `Authorization: Bearer <internal token>`", None, TOKEN_CODE,
                       {"WWW-Authenticate": "Bearer"})


async def kv_events(state: ServerState, request: Request) -> StreamingResponse:
    check_internal_token(state, request)
    engine = state.engine_or_503()
    snapshot, last_seq, queue = engine.subscribe_kv_events()
    tiers = engine.tier_snapshot()
    return DisconnectAwareStreamingResponse(_stream(state, engine, snapshot, tiers, last_seq, queue),
                                            media_type="application/x-ndjson",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(state: ServerState, engine, snapshot, tiers, last_seq: int, queue: asyncio.Queue
                  ) -> AsyncIterator[bytes]:
    iid = state.config.instance_id
    getter: asyncio.Future | None = None  # one pending queue.get(), never cancelled mid-item
    try:
        yield encode_line(iid, Snapshot(last_seq, engine.limits.block_size, engine.hash_seed, tuple(snapshot), tiers))
        sent = last_seq
        next_beat = time.monotonic() + HEARTBEAT_S
        while not state.closing:
            timeout = next_beat - time.monotonic()
            if timeout <= 0:
                yield encode_line(iid, Heartbeat(sent))
                next_beat = time.monotonic() + HEARTBEAT_S
                continue
            if getter is None:
                getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter}, timeout=min(timeout, 0.5))
            if not getter.done():
                continue
            events = [getter.result()]
            getter = None
            while not queue.empty() and len(events) < 256:  # batch what is already queued
                events.append(queue.get_nowait())
            lines = []
            for ev in events:
                if ev.seq > sent:  # older ones are part of the snapshot
                    sent = ev.seq
                    lines.append(encode_line(iid, ev))
            if lines:
                yield b"".join(lines)
    finally:
        if getter is not None:
            getter.cancel()
        engine.unsubscribe_kv_events(queue)
