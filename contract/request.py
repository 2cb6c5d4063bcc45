"""The OpenAI request as both engine and router read it: parsed once, one rule per field.

`parse_request(endpoint, raw)` turns a client's body into a frozen `OpenAIRequest`, or raises `RequestError`
(400, naming the field) for what no engine could serve:
- a body that is not JSON, not an object, or nested deeper than Python's JSON reader can follow;
- a string holding a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but no UTF-8 text, so no tokenizer
  can read it), named by its path (`messages[0].content`);
- a field the router reads with the wrong type or range: `model`, `messages` / `prompt`, `max_tokens`,
  `max_completion_tokens`, `n`, `stream`, `stream_options`, `cache_salt`, `user`, `prompt_cache_key`,
  `prompt_cache_retention` (the engine's own strict rules: no "5" for an integer, no true for a number);
- a chat `cache_control` (on a message, a content part or a tool) breaking contract/cache_control.py's rule.
Other fields go upstream untouched; the engine validates them (and the router hands its 400 on).

The max_tokens rule (OpenAI's, and the engine's): `max_completion_tokens` when it is not null, else
`max_tokens` (chat; completions know only `max_tokens`); null means absent. `/v1/completions` without one
generates OpenAI's default of 16 tokens; a chat request without one generates until a stop or the context.

The request is never changed in place: `with_max_tokens` and `with_fields` return a new request, and
`upstream_body()` writes the body once, at the end (the client's own bytes when nothing changed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Any

from contract.cache_control import CacheControlError, breakpoints

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128
MAX_CACHE_KEY = 1024
CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")  # OpenAI's values (in-memory: its earlier spelling)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only such a body can hold a lone surrogate
_DELETE = object()  # a field to drop from the upstream body


class Endpoint(str, Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"

    @property
    def prompt_field(self) -> str:
        return "messages" if self is Endpoint.CHAT else "prompt"


class RequestError(ValueError):
    """A body no engine could serve: the 400 to answer, naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def max_tokens_of(max_completion_tokens: int | None, max_tokens: int | None) -> int | None:
    """The one max_tokens rule: max_completion_tokens when not null, else max_tokens (None: absent)."""
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `value` holding a lone surrogate, or None.
    Iterative (a body nested as deep as a JSON reader allows costs no Python recursion), and paths are only
    written once a bad string is known to be there."""
    if not _has_lone_surrogate(value):
        return None
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            children = []
            for k, v in item.items():
                children.append((k, where))
                children.append((v, f"{where}.{k}" if where else str(k)))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def _int(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {json.dumps(v)[:40]}", name)
    if v < low or (high is not None and v > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name} must be {bound}, got {v}", name)
    return v


def _typed(body: Mapping, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is not None and (not isinstance(v, kind) or isinstance(v, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))):
        raise RequestError(f"{name} must be {what}, got {json.dumps(v)[:40]}", name)
    return v


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One chat or completions request, as parsed from the client's body (read-only)."""

    endpoint: Endpoint
    body: Mapping[str, Any]  # the client's fields, read-only
    raw: bytes  # the client's bytes, sent upstream as they are while nothing changed
    model: str | None
    max_tokens: int | None  # by the rule above; None: the client named no limit
    n: int
    stream: bool
    cache_salt: str | None
    user: str | None
    changes: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    prompt_cache_key: str | None = None  # OpenAI's routing hint: requests sharing it share a long prefix

    @property
    def max_tokens_field(self) -> str | None:
        """The field that holds max_tokens (after changes), None when the client named none."""
        for name in ("max_completion_tokens", "max_tokens"):
            v = self.get(name)
            if v is not None:
                return name
        return None

    @property
    def limit(self) -> int | None:
        """The most tokens this request can generate as sent: max_tokens, else 16 on /v1/completions, else
        None (until a stop or the model's context)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.endpoint is Endpoint.COMPLETIONS else None

    def get(self, name: str, default: Any = None) -> Any:
        """A field as it goes upstream (the client's value, or the router's change)."""
        if name in self.changes:
            v = self.changes[name]
            return default if v is _DELETE else v
        return self.body.get(name, default)

    def with_fields(self, **fields: Any) -> OpenAIRequest:
        """A new request with these fields set upstream (None: the field is sent as null)."""
        changes = {**self.changes, **fields}
        salt = changes.get("cache_salt", self.cache_salt)
        model = changes.get("model", self.model)
        return replace(self, changes=MappingProxyType(changes), cache_salt=salt if isinstance(salt, str) and salt else None,
                       model=model if isinstance(model, str) else None)

    def with_max_tokens(self, value: int) -> OpenAIRequest:
        """A new request limited to `value` tokens, in exactly one field upstream: the one the client used
        (max_tokens if none), the other one dropped, so no engine's rule can read an uncapped value."""
        used = self.max_tokens_field or "max_tokens"
        other = "max_tokens" if used == "max_completion_tokens" else "max_completion_tokens"
        changes = {**self.changes, used: value}
        if self.get(other) is not None or other in self.body:
            changes[other] = _DELETE
        return replace(self, changes=MappingProxyType(changes), max_tokens=value)

    def upstream_body(self) -> bytes:
        """The body sent to the engine: the client's bytes when nothing changed, else written once."""
        if not self.changes:
            return self.raw
        out = dict(self.body)
        for k, v in self.changes.items():
            if v is _DELETE:
                out.pop(k, None)
            else:
                out[k] = v
        return json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or RequestError."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise RequestError("request body is nested too deeply", None) from None
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object", None)
    return obj


def check_text(obj: Mapping, raw: bytes | None = None) -> None:
    """RequestError naming the first string that holds a lone surrogate (cheap unless `raw` has an escape)."""
    if raw is not None and not _SURROGATE_ESCAPE.search(raw):
        return
    path = lone_surrogate_path(obj)
    if path is not None:
        raise RequestError(f"{path} holds a lone UTF-16 surrogate (not valid Unicode text)", path)


def parse_request(endpoint: Endpoint, raw: bytes) -> OpenAIRequest:
    """The typed request of a client's body, or RequestError (the module docstring says what is checked)."""
    obj = parse_body(raw)
    check_text(obj, raw)
    return request_from(endpoint, obj, raw)


def request_from(endpoint: Endpoint, obj: dict, raw: bytes) -> OpenAIRequest:
    """The typed request of an already parsed body (`raw` its bytes); the request keeps `obj` as it is, so the
    caller hands it over and changes it no more."""
    prompt = endpoint.prompt_field
    value = obj.get(prompt)
    if value is None:
        raise RequestError(f"'{prompt}' is required", prompt, "missing_required_parameter")
    if endpoint is Endpoint.CHAT and (not isinstance(value, list) or not value):
        raise RequestError("messages must be a non-empty array of messages", prompt)
    if endpoint is Endpoint.CHAT:
        try:
            breakpoints(value, obj.get("tools"))
        except CacheControlError as e:
            raise RequestError(str(e), e.path) from None
    if endpoint is Endpoint.COMPLETIONS and not isinstance(value, (str, list)):
        raise RequestError("prompt must be a string, an array of strings or an array of token ids", prompt)
    max_completion = _int(obj, "max_completion_tokens", 1) if endpoint is Endpoint.CHAT else None
    stream = _typed(obj, "stream", bool, "a boolean")
    _typed(obj, "stream_options", dict, "an object")
    salt = _typed(obj, "cache_salt", str, "a string")
    if salt is not None and not 1 <= len(salt) <= 256:
        raise RequestError("cache_salt must be 1 to 256 characters long", "cache_salt")
    cache_key = _typed(obj, "prompt_cache_key", str, "a string")
    if cache_key is not None and not 1 <= len(cache_key) <= MAX_CACHE_KEY:
        raise RequestError(f"prompt_cache_key must be 1 to {MAX_CACHE_KEY} characters long", "prompt_cache_key")
    retention = obj.get("prompt_cache_retention")
    if retention is not None and retention not in CACHE_RETENTIONS:
        raise RequestError(f"prompt_cache_retention must be 'in_memory' or '24h', got {json.dumps(retention)[:40]}",
                           "prompt_cache_retention")
    return OpenAIRequest(
        endpoint=endpoint, body=MappingProxyType(obj), raw=raw,  # a read-only view, no copy
        model=_typed(obj, "model", str, "a string"),
        max_tokens=max_tokens_of(max_completion, _int(obj, "max_tokens", 1)),
        n=_int(obj, "n", 1, MAX_N) or 1, stream=stream is True, cache_salt=salt,
        user=_typed(obj, "user", str, "a string"), prompt_cache_key=cache_key)
