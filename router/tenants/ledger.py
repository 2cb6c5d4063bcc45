"""The usage ledger: one record per settled request, and the usage a tenant reads back in OpenAI's shape. Pure: no
I/O (router/tenants/store.py and redis_store.py keep the records; the settle that charges a budget writes the
request's record in the same call, so a request is charged and recorded together or not at all).

A record holds who (tenant, API key id: the first 16 hex digits of the key's sha256, never the key), what (model,
pool, replica), how much (prompt tokens computed and read from the cache as the engine reported them, output
tokens, the budget tokens charged, the cost in US dollars at the tenants file's prices), how it ended and when;
then, where the engine reported them, the prompt tokens written to cache_control breakpoints and the cached tokens
by the tier they came from. Fields added later have defaults, so records stored before them still load.

`usage_page` answers `GET /v1/organization/usage/completions` from a tenant's records: buckets of `bucket_width`
(1m, 1h or 1d) from `start_time` to `end_time` (Unix seconds), each with one result, or one per model or API key
id (`group_by`), carrying `input_tokens`, `input_cached_tokens`, `output_tokens` and `num_model_requests`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from fractions import Fraction

from router.tenants.pricing import TIERS, Prices, Usage, cost_usd

USAGE_PATH = "/v1/organization/usage/completions"
BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
GROUP_BY = ("model", "api_key_id")
MAX_BUCKETS = {"1m": 1440, "1h": 168, "1d": 31}  # OpenAI's limits per page


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant: str
    api_key_id: str | None  # None: the anonymous tenant, no key
    model: str
    pool: str
    replica: str | None  # None: no replica answered
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    budget_tokens: int  # what the tenant's budget was charged
    cost_usd: str | None  # exact decimal string; None: the model has no prices
    outcome: str  # the HTTP status sent, "error", "disconnected", or router_lost (no router settled it)
    time: float  # Unix seconds when it was settled
    duration_s: float  # from admission to the end
    ttft_s: float | None
    written_tokens: int = 0  # of the computed prompt tokens, written to a cache_control breakpoint
    cached_by_tier: dict[str, int] | None = None  # cached_tokens by origin (device, lower_tier, peer); None: unknown

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> UsageRecord:
        return cls(**json.loads(text))


def decimal_text(x: Fraction, places: int = 12) -> str:
    """A dollar amount as a decimal string, rounded half-up to `places` decimals (a micro-cent is 1e-8)."""
    scaled = (x * 10**places + Fraction(1, 2)).__floor__()
    sign, digits = ("-", str(-scaled)) if scaled < 0 else ("", str(scaled))
    digits = digits.rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")


def record(request_id: str, tenant: str, api_key_id: str | None, model: str, pool: str, replica: str | None,
           usage: Usage | None, budget_tokens: int, prices: Prices | None, outcome: str, now: float,
           duration_s: float, ttft_s: float | None) -> UsageRecord:
    u = usage or Usage(0, 0, 0)
    cost = decimal_text(cost_usd(u, prices)) if prices is not None else None
    return UsageRecord(request_id, tenant, api_key_id, model, pool, replica, u.prompt_tokens, u.cached_tokens,
                       u.completion_tokens, budget_tokens, cost, outcome, now, round(duration_s, 6),
                       None if ttft_s is None else round(ttft_s, 6), u.written_tokens, by_tier(u))


def by_tier(u: Usage) -> dict[str, int] | None:
    """A usage's cached tokens by tier as the record keeps them: {"device": .., "lower_tier": .., "peer": ..}."""
    return None if u.cached_by_tier is None else dict(zip(TIERS, u.cached_by_tier, strict=True))


ROUTER_LOST = "router_lost"  # the outcome of a request no router settled: its reservation is what it was charged


@dataclass(frozen=True)
class Ticket:
    """Who a request is, known at admission: what its pending record needs."""

    request_id: str
    api_key_id: str | None
    pool: str


@dataclass(frozen=True)
class RecordMeta:
    """What the edge knows of a request for its record, beside the budget and the usage."""

    request_id: str
    api_key_id: str | None
    pool: str
    replica: str | None
    outcome: str
    duration_s: float
    ttft_s: float | None


class UsageQueryError(ValueError):
    """A bad query parameter: the 400 to answer, naming it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_query(params: dict[str, list[str]], now: float) -> tuple[int, int, str, tuple[str, ...]]:
    """(start_time, end_time, bucket_width, group_by) from the query string, or UsageQueryError."""
    def one(name: str) -> str | None:
        values = params.get(name)
        return values[-1] if values else None

    def seconds(name: str) -> int | None:
        text = one(name)
        if text is None:
            return None
        if not text.isdigit():
            raise UsageQueryError(f"{name} must be Unix seconds, got {text[:40]!r}", name)
        return int(text)

    start = seconds("start_time")
    if start is None:
        raise UsageQueryError("start_time is required (Unix seconds)", "start_time")
    width = one("bucket_width") or "1d"
    if width not in BUCKET_WIDTHS:
        raise UsageQueryError(f"bucket_width must be one of 1m, 1h, 1d, got {width[:40]!r}", "bucket_width")
    end = seconds("end_time")
    if end is None:
        end = min(int(now) + 1, start + MAX_BUCKETS[width] * BUCKET_WIDTHS[width])
    if end <= start:
        raise UsageQueryError("end_time must be after start_time", "end_time")
    if -(-(end - start) // BUCKET_WIDTHS[width]) > MAX_BUCKETS[width]:
        raise UsageQueryError(f"at most {MAX_BUCKETS[width]} buckets of {width} per page: narrow the times",
                              "end_time")
    group = tuple(g for values in params.get("group_by", []) for g in values.split(",") if g)
    for g in group:
        if g not in GROUP_BY:
            raise UsageQueryError(f"group_by takes model and api_key_id, got {g[:40]!r}", "group_by")
    return start, end, width, group


def usage_page(records: Iterable[UsageRecord], start: int, end: int, width: str,
               group_by: tuple[str, ...] = ()) -> dict:
    """OpenAI's usage page of these records: every bucket from start to end (empty ones included), each result
    summing the records settled inside it."""
    step = BUCKET_WIDTHS[width]
    starts = list(range(start, end, step))
    sums: list[dict[tuple, list[int]]] = [{} for _ in starts]
    for r in records:
        if not start <= r.time < end:
            continue
        key = tuple(getattr(r, g) for g in group_by)
        acc = sums[int((r.time - start) // step)].setdefault(key, [0, 0, 0, 0])
        acc[0] += r.prompt_tokens
        acc[1] += r.cached_tokens
        acc[2] += r.output_tokens
        acc[3] += 1
    data = []
    for s, groups in zip(starts, sums, strict=True):
        results = []
        for key, (inp, cached, out, n) in sorted(groups.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
            res = {"object": "organization.usage.completions.result", "input_tokens": inp,
                   "input_cached_tokens": cached, "output_tokens": out, "num_model_requests": n}
            for g in GROUP_BY:
                res[g] = dict(zip(group_by, key, strict=True)).get(g)
            results.append(res)
        data.append({"object": "bucket", "start_time": s, "end_time": min(s + step, end), "results": results})
    return {"object": "page", "data": data, "has_more": False, "next_page": None}
