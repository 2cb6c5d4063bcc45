"""The internal token: the bearer token routers send to engines (`--internal-token`).

Without `--require-internal-token` only `/v1/kv/events` needs it (engine/server/kv_events.py). With it,
`InternalTokenGuard` answers 401 (OpenAI error body, `WWW-Authenticate: Bearer`) to every request without
it, before any route, body or model is looked at, so that in a cluster only routers reach the engine.
`/health` and `/ready` stay open: kubelet liveness and readiness probes cannot send a secret header, and
they tell nothing but up or down.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ready"})
TOKEN_CODE = "invalid_internal_token"


def token_matches(authorization: str | bytes | None, token: str) -> bool:
    """Whether an Authorization header value is `Bearer <token>` (constant-time comparison)."""
    if authorization is None:
        return False
    value = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, given = value.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())


class InternalTokenGuard:
    """ASGI middleware: 401 for every HTTP request outside OPEN_PATHS without `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, token: str):
        if not token:
            raise ValueError("InternalTokenGuard needs a token")
        self.app = app
        self.token = token
        self.refusal = error_response(401, "this server needs `Authorization: Bearer <internal token>`; only "
                                      "kvfleet routers call it", None, TOKEN_CODE, {"WWW-Authenticate": "Bearer"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
            if not token_matches(auth, self.token):
                await self.refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)
