"""OpenAI-style JSON error bodies and small ASGI response helpers."""

from __future__ import annotations

import json

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 503: "service_unavailable"}


def json_error(message: str, err_type: str | None = None, code: int = 400, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or _TYPES.get(code, "server_error"), "param": param,
                      "code": code}}


async def send_json(send, status: int, obj, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj).encode()
    await send_bytes(send, status, body, b"application/json", headers)


async def send_bytes(send, status: int, body: bytes, content_type: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": body})
