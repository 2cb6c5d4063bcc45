"""Small ASGI response helpers (JSON error bodies come from contract/errors.py)."""

from __future__ import annotations

import json


async def send_json(send, status: int, obj, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj).encode()
    await send_bytes(send, status, body, b"application/json", headers)


async def send_bytes(send, status: int, body: bytes, content_type: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": body})
