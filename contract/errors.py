"""The OpenAI error body the engine and the router both answer with:

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

`code` is a short string naming the error (`"invalid_value"`, `"draining"`, ...) or null, as OpenAI and vLLM
send it; the HTTP status goes in the status line, never in the body. `error_type` maps a status to `type`.

`ConfigError` is the one error for a bad setting, in every process (engine, server, router): `field` names
the setting (a dataclass field or a command-line flag), so a CLI can point at it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

ERROR_TYPES: Mapping[int, str] = MappingProxyType({
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 502: "upstream_error", 503: "service_unavailable",
})


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickles whole (the engine core reports a bad setting from its own process)
        return type(self), (self.field, str(self))


def error_type(status: int) -> str:
    """The error `type` of an HTTP status (any other 5xx: server_error; any other 4xx: invalid_request_error)."""
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    if code is not None and not isinstance(code, str):
        raise TypeError(f"an error code is a string or None, got {code!r}")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
