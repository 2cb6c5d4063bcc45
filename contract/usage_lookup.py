"""The usage lookup between a router and an engine: what the engine's requests really used, by the router's
request id (the `x-request-id` the router sent), for the router that reconciles a request whose own router died
(router/tenants/reconcile.py; the engine's side: engine/usage_book.py, engine/server/usage.py).

    POST /v1/kvfleet/usage/lookup   {"request_ids": ["req_...", ...]}          (at most MAX_IDS)
    200 {"object": "kvfleet.usage_lookup", "data": {"req_...": {"prompt_tokens": 12, "cached_tokens": 0,
         "completion_tokens": 30, "written_tokens": 8,
         "cached_tokens_by_tier": {"device": 0, "lower_tier": 0, "peer": 0}, "outcome": "aborted",
         "finished_at": 1764...},
         "req_2": "running", "req_3": "unknown"}}

`written_tokens` (prompt tokens the request computed and wrote to its cache_control breakpoints) is missing from
the answers of engines older than it: read as 0. `cached_tokens_by_tier` (where the cached tokens' blocks came from)
is missing from those too: the record then carries no split.

Like the engine's other internal endpoints it needs `Authorization: Bearer <internal token>` where one is set.
"""

from __future__ import annotations

PATH = "/v1/kvfleet/usage/lookup"
# where a request's cached prompt tokens came from: the entries of `cached_tokens_by_tier`, in the engine's usage
# (`prompt_tokens_details`) and in its lookup answers
TIERS = ("device", "lower_tier", "peer")
MAX_IDS = 10_000
RUNNING = "running"  # the engine is still running it
UNKNOWN = "unknown"  # never seen there, or forgotten (a restart, or older than the engine keeps)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_answer(body) -> dict[str, dict | str]:
    """The `data` of an answer, each entry checked: a usage dict, RUNNING, or UNKNOWN (anything malformed)."""
    data = body.get("data") if isinstance(body, dict) else None
    out: dict[str, dict | str] = {}
    for rid, v in (data or {}).items() if isinstance(data, dict) else ():
        if v == RUNNING:
            out[rid] = RUNNING
        elif isinstance(v, dict) and all(_count(v.get(k)) for k in ("prompt_tokens", "cached_tokens",
                                                                     "completion_tokens")) \
                and v["cached_tokens"] <= v["prompt_tokens"] and isinstance(v.get("outcome"), str) \
                and _count(v.get("written_tokens", 0)):
            out[rid] = v
        else:
            out[rid] = UNKNOWN
    return out
