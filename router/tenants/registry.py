"""Tenants and their API keys: who is calling, read from the request's headers.

A client presents its key as `Authorization: Bearer KEY` or as an `api-key: KEY` header. The router knows
only the sha256 of each key (the tenants file, router/tenants/file.py): `TenantRegistry.identify` hashes
the presented key and looks the digest up; the plain key is never stored, logged or echoed. A request
without a key gets the `anonymous` tenant when the file names one; otherwise, and for an unknown key,
`AuthError` (401 with OpenAI's `invalid_api_key` body).

The router forwards none of the client's credentials upstream (`strip_client_credentials`); it speaks to
the engines with its own internal token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

from contract.errors import ConfigError, error_body
from router.tenants.pricing import Prices

# A cache salt an isolated tenant's requests carry; no other request may carry one with this prefix.
TENANT_SALT_PREFIX = "kvfleet-tenant-"
_SALT_DOMAIN = b"kvfleet tenant cache salt\0"
_CREDENTIAL_HEADERS = frozenset({b"authorization", b"api-key"})
_ONE = Fraction(1)


def key_sha256(key: str | bytes) -> str:
    """The lowercase hex sha256 of an API key, as the tenants file lists it (`kvfleet keys hash`)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key_sha256: frozenset[str]  # lowercase hex digests of the tenant's keys
    tokens_per_minute: int  # budget units per minute: tokens, or micro-dollars where `cost_budget`
    max_concurrent_requests: int | None = None  # None: no limit
    max_tokens: int | None = None  # cap, and the default for requests that omit max_tokens; None: no cap
    max_context_tokens: int | None = None  # prompt + max_tokens; None: no limit of the tenant's own
    priority: int = 0  # higher is shed last
    isolate_cache: bool = False
    models: frozenset[str] | None = None  # the models it may use (others: 404 as if unknown); None: all
    weight: float = 1.0  # its share of a full pool against other tenants' (the fair queue, router/admission/gate.py)
    slo_ttft_s: float | None = None  # the TTFT target of its requests that carry none (contract/slo.py)
    slo_tpot_s: float | None = None  # the TPOT target of its requests that carry none
    cost_budget: bool = False  # its budget is in money (dollars_per_minute), counted in micro-dollars

    def cache_salt(self) -> str | None:
        """The `cache_salt` forced into every request of an isolated tenant (None for the others): the same
        on every router replica and across reloads, derived from the name alone."""
        if not self.isolate_cache:
            return None
        return TENANT_SALT_PREFIX + hashlib.sha256(_SALT_DOMAIN + self.name.encode()).hexdigest()

    def request_cache_salt(self, client_salt: str | None) -> str | None:
        """The `cache_salt` to send upstream for a request that asked for `client_salt`. An isolated tenant
        gets its own salt whatever the client sent. Another tenant keeps the client's salt, except one in
        the tenants' reserved namespace (it could reach an isolated tenant's cache): that is replaced by a
        hash of itself, so requests that send it still share a cache with each other and with no tenant."""
        own = self.cache_salt()
        if own is not None:
            return own
        if client_salt is not None and client_salt.startswith(TENANT_SALT_PREFIX):
            return "kvfleet-client-" + hashlib.sha256(client_salt.encode()).hexdigest()
        return client_salt


class AuthError(Exception):
    """No usable API key: answer 401 with `body()` and `headers`, and send nothing upstream.
    `reason` (missing_key, unknown_key, malformed) is for metrics and logs; it never holds the key."""

    status = 401
    headers: tuple[tuple[bytes, bytes], ...] = ((b"www-authenticate", b"Bearer"),)

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message

    def body(self) -> dict:
        return error_body(self.message, "invalid_request_error", None, "invalid_api_key")


# (reason, message); a new AuthError per request: a shared instance would keep each raise's traceback
MISSING_KEY = ("missing_key", "You didn't provide an API key. Send it as `Authorization: Bearer KEY` or in an "
                              "`api-key` header.")
UNKNOWN_KEY = ("unknown_key", "Incorrect API key provided. Check the key sent in `Authorization: Bearer KEY` "
                              "or in the `api-key` header.")
MALFORMED = ("malformed", "The Authorization header must read `Bearer KEY`.")


def _as_bytes(s: str | bytes) -> bytes:
    return s.encode("latin-1") if isinstance(s, str) else s


def presented_key(headers: Iterable[tuple[bytes | str, bytes | str]]) -> bytes | None:
    """The API key a request carries (None: none), from `Authorization: Bearer KEY` or else `api-key: KEY`.
    An empty key counts as none. Raises AuthError (malformed) for an Authorization header of another scheme when no
    `api-key` header is given either."""
    auth = api_key = None
    for name, value in headers:
        lname = _as_bytes(name).lower()
        if lname == b"authorization":
            auth = _as_bytes(value) if auth is None else auth
        elif lname == b"api-key":
            api_key = _as_bytes(value) if api_key is None else api_key
    if auth is not None:
        scheme, _, key = auth.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            if key.strip():
                return key.strip()
        elif api_key is None or not api_key.strip():
            raise AuthError(*MALFORMED)
    if api_key is not None and api_key.strip():
        return api_key.strip()
    return None


def api_key_id(headers: Iterable[tuple[bytes | str, bytes | str]]) -> str | None:
    """The id of the key a request presents, as usage records and the usage API name it: `key_` and the first 16
    hex digits of its sha256 (the key itself is never kept); None without a key (or a malformed header)."""
    try:
        key = presented_key(headers)
    except AuthError:
        return None
    return None if key is None else "key_" + hashlib.sha256(key).hexdigest()[:16]


def strip_client_credentials(headers: Iterable[tuple[bytes | str, bytes | str]]) -> list:
    """The headers without the client's `Authorization` and `api-key` (the router's own credentials go
    upstream instead). Keeps the pairs' type (bytes or str) and order."""
    return [(k, v) for k, v in headers if _as_bytes(k).lower() not in _CREDENTIAL_HEADERS]


class TenantRegistry:
    """Tenants by name and by key digest; immutable once built (a reload builds a new one)."""

    def __init__(self, tenants: Iterable[Tenant], anonymous: str | None = None,
                 model_token_weights: Mapping[str, Fraction] | None = None,
                 model_prices: Mapping[str, Prices] | None = None,
                 tenant_prices: Mapping[str, Mapping[str, Prices]] | None = None):
        by_name: dict[str, Tenant] = {}
        by_digest: dict[bytes, Tenant] = {}
        for t in tenants:
            if t.name in by_name:
                raise ConfigError(f"tenants.{t.name}", f"tenant {t.name!r} is defined twice")
            by_name[t.name] = t
            for h in t.api_key_sha256:
                other = by_digest.setdefault(bytes.fromhex(h), t)
                if other is not t:
                    raise ConfigError(f"tenants.{t.name}.api_key_sha256",
                                      f"key hash {h} is already a key of tenant {other.name!r}")
        if anonymous is not None and anonymous not in by_name:
            raise ConfigError("anonymous", f"names no tenant defined under `tenants`: {anonymous!r}")
        self.tenants: Mapping[str, Tenant] = MappingProxyType(by_name)
        self.anonymous: Tenant | None = by_name[anonymous] if anonymous is not None else None
        self._by_digest = by_digest
        self.model_token_weights: Mapping[str, Fraction] = MappingProxyType(dict(model_token_weights or {}))
        self.model_prices: Mapping[str, Prices] = MappingProxyType(dict(model_prices or {}))
        self._tenant_prices = {name: dict(table) for name, table in (tenant_prices or {}).items() if table}
        prios = [t.priority for t in by_name.values()] or [0]
        self._priorities = (min(prios), max(prios))

    def token_weight(self, model: str | None) -> Fraction:
        """What one token of `model` costs in a tenant's budget (tenants file `model_token_weights`; default 1)."""
        return self.model_token_weights.get(model, _ONE) if model is not None else _ONE

    def prices(self, tenant: str, model: str | None) -> Prices | None:
        """What `model` costs `tenant` (its own prices, else the file's `model_prices`); None: no prices."""
        if model is None:
            return None
        own = self._tenant_prices.get(tenant)
        return (own or {}).get(model) or self.model_prices.get(model)

    def priorities(self) -> tuple[int, int]:
        """The lowest and highest priority among the tenants (load shedding starts at the lowest)."""
        return self._priorities

    def __len__(self) -> int:
        return len(self.tenants)

    def get(self, name: str) -> Tenant | None:
        return self.tenants.get(name)

    def identify(self, headers: Iterable[tuple[bytes | str, bytes | str]]) -> Tenant:
        """The tenant of a request with these headers (ASGI's list of (name, value) byte pairs, or str
        pairs). Raises AuthError for a missing key (without an anonymous tenant), an unknown key or a
        malformed Authorization header."""
        key = presented_key(headers)
        if key is None:
            if self.anonymous is None:
                raise AuthError(*MISSING_KEY)
            return self.anonymous
        tenant = self._by_digest.get(hashlib.sha256(key).digest())
        if tenant is None:
            raise AuthError(*UNKNOWN_KEY)
        return tenant
