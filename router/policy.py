"""Routing policies: pure scoring and choice over a snapshot of the fleet (no I/O, no clocks).

The `kv` score of a replica for one request estimates how long the request would wait for its first token
there, in prefill-token equivalents: its own uncached prompt, the prefill queued ahead of it, and the
slowdown from sharing batches with requests already running:

    cost = (prompt tokens - predicted cached tokens)
           + uncached prompt tokens this router sent there since the last scrape
           + kv_token_cost * KV tokens held by running requests (kv_usage * capacity)
           + waiting_cost * waiting + running_cost * (running + sent since the last scrape)

(`running`/`waiting` as scraped, less this router's requests that finished since the scrape.) The active
KV tokens weigh the contexts being decoded there (0.5 per prefill token by default; Dynamo's KV router uses
1:1); they keep a long shared prefix from piling every session onto one replica. Each running request adds
a little per-sequence overhead; each waiting one is a whole unknown prompt ahead.

An overloaded replica (long waiting queue or KV usage past the limit) is left out for this request only:
affinity yields per request, and a cache miss never goes to an overloaded replica. When no replica holds
any of the prompt, a session key picks a replica by consistent hashing with bounded load, otherwise the
least-loaded one wins. Load scraped too long ago is unknown, and unknown is taken pessimistically (the
worst fresh load in the fleet, at least this router's own in-flight requests), never as zero.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from contract.cacheable import cacheable_tokens
from router.config import ScoringConfig


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows about one replica when it routes one request."""

    url: str
    routable: bool = True  # ready, circuit not open, not already tried for this request
    load_known: bool = True  # the last /metrics scrape is fresh
    kv_usage: float = 0.0
    kv_tokens: float = 0.0  # KV cache tokens held by running requests (kv_usage * capacity; 0 if unknown)
    running: int = 0
    waiting: int = 0
    new_requests: int = 0  # sent by this router since the last scrape, still in flight
    new_tokens: int = 0  # their uncached prompt tokens
    finished: int = 0  # this router's requests counted by the last scrape that have finished since
    inflight: int = 0  # all of this router's in-flight requests on the replica
    cached_tokens: int = 0  # predicted prefix-cache hit for this request


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_prompt_tokens: int = 0
    session_key: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    url: str
    reason: str  # cache | session | least-load | round-robin | all-overloaded
    predicted_cached_tokens: int
    cost: float


@dataclass(frozen=True, slots=True)
class Load:
    queued: float  # running + waiting + sent since scrape (pessimistic when unknown): for least-load
    running: float  # running + sent since scrape
    waiting: float
    kv_usage: float
    new_tokens: float
    kv_tokens: float


def _scraped(v: ReplicaView) -> tuple[int, int]:
    """(running, waiting) at the last scrape, less this router's requests that have finished since."""
    running = max(v.running - v.finished, 0)
    waiting = max(v.waiting - max(v.finished - v.running, 0), 0)
    return running, waiting


def effective_loads(views: Sequence[ReplicaView]) -> list[Load]:
    """Each replica's load; unknown load is the worst fresh load in the fleet, never below our own in-flight."""
    known: list[Load] = []
    out: list[Load | None] = []
    for v in views:
        if v.load_known:
            running, waiting = _scraped(v)
            load = Load(running + waiting + v.new_requests, running + v.new_requests, waiting, v.kv_usage,
                        v.new_tokens, v.kv_tokens)
            known.append(load)
            out.append(load)
        else:
            out.append(None)
    worst = Load(max((ld.queued for ld in known), default=0), max((ld.running for ld in known), default=0),
                 max((ld.waiting for ld in known), default=0), max((ld.kv_usage for ld in known), default=0.0),
                 max((ld.new_tokens for ld in known), default=0), max((ld.kv_tokens for ld in known), default=0.0))
    return [ld if ld is not None else
            Load(max(worst.queued, v.inflight), max(worst.running, v.inflight), worst.waiting, worst.kv_usage,
                 max(worst.new_tokens, v.new_tokens), worst.kv_tokens)
            for v, ld in zip(views, out, strict=True)]


def is_overloaded(view: ReplicaView, cfg: ScoringConfig) -> bool:
    """Past the waiting-queue or KV-usage limit. Unknown load counts only what this router itself sent."""
    if not view.load_known:
        return view.inflight >= cfg.overload_waiting
    return view.waiting + view.new_requests >= cfg.overload_waiting or view.kv_usage >= cfg.overload_kv_usage


def cost(view: ReplicaView, load: Load, req: RouteRequest, cfg: ScoringConfig) -> float:
    uncached = max(req.num_prompt_tokens - view.cached_tokens, 0)
    return (uncached + load.new_tokens + cfg.kv_token_cost * load.kv_tokens
            + cfg.waiting_cost_tokens * load.waiting + cfg.running_cost_tokens * load.running)


def _pool(views: Sequence[ReplicaView], cfg: ScoringConfig) -> tuple[list[int], bool]:
    """Indices of routable replicas that are not overloaded (or all routable ones, flagged, if none is)."""
    routable = [i for i, v in enumerate(views) if v.routable]
    fine = [i for i in routable if not is_overloaded(views[i], cfg)]
    return (fine, False) if fine else (routable, True)


def _pick(idx: list[int], key, tiebreak: int) -> int:
    """The index with the lowest key; equal keys rotate with `tiebreak` so equal replicas share the work."""
    keys = {i: key(i) for i in idx}
    best = min(keys.values())
    tied = [i for i in idx if keys[i] == best]
    return tied[tiebreak % len(tied)]


def _least_load(views: Sequence[ReplicaView], loads: list[Load], idx: list[int], tiebreak: int = 0) -> int:
    return _pick(idx, lambda i: (loads[i].queued, loads[i].kv_usage, views[i].inflight), tiebreak)


def choose_by_cache(views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig,
                    ring: HashRing | None = None, tiebreak: int = 0) -> Decision | None:
    """`kv` / `approx-prefix`: lowest cost among non-overloaded replicas; no cache signal → session or least load."""
    idx, all_overloaded = _pool(views, cfg)
    if not idx:
        return None
    loads = effective_loads(views)
    if all_overloaded:
        best = _pick(idx, lambda i: cost(views[i], loads[i], req, cfg), tiebreak)
        return _decision(views, loads, req, cfg, best, "all-overloaded")
    if any(views[i].cached_tokens > 0 for i in idx):
        best = _pick(idx, lambda i: (cost(views[i], loads[i], req, cfg), -views[i].cached_tokens), tiebreak)
        return _decision(views, loads, req, cfg, best, "cache")
    if req.session_key is not None and ring is not None:
        best = ring.choose(req.session_key, views, loads, idx, cfg.session_load_factor)
        return _decision(views, loads, req, cfg, best, "session")
    return _decision(views, loads, req, cfg, _least_load(views, loads, idx, tiebreak), "least-load")


def choose_session(views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig,
                   ring: HashRing, tiebreak: int = 0) -> Decision | None:
    """`session`: consistent hashing with bounded load on the session key; no key → least load."""
    idx, _ = _pool(views, cfg)
    if not idx:
        return None
    loads = effective_loads(views)
    if req.session_key is None:
        return _decision(views, loads, req, cfg, _least_load(views, loads, idx, tiebreak), "least-load")
    return _decision(views, loads, req, cfg, ring.choose(req.session_key, views, loads, idx,
                                                         cfg.session_load_factor), "session")


def choose_least_load(views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig,
                      tiebreak: int = 0) -> Decision | None:
    idx = [i for i, v in enumerate(views) if v.routable]
    if not idx:
        return None
    loads = effective_loads(views)
    return _decision(views, loads, req, cfg, _least_load(views, loads, idx, tiebreak), "least-load")


def choose_round_robin(views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig,
                       counter: int) -> Decision | None:
    """The counter-th routable replica in URL order (the caller advances the counter)."""
    idx = sorted((i for i, v in enumerate(views) if v.routable), key=lambda i: views[i].url)
    if not idx:
        return None
    return _decision(views, effective_loads(views), req, cfg, idx[counter % len(idx)], "round-robin")


def _decision(views, loads, req, cfg, i: int, reason: str) -> Decision:
    v = views[i]
    predicted = min(v.cached_tokens, cacheable_tokens(req.num_prompt_tokens))
    return Decision(v.url, reason, predicted, cost(v, loads[i], req, cfg))


def _h64(data: str) -> int:
    return xxhash.xxh3_64_intdigest(data.encode("utf-8"))


class HashRing:
    """Consistent hashing with bounded load (Mirrokni et al.): walk clockwise from the key's point and take
    the first eligible replica whose load is under ceil(c * (total + 1) / n). Adding or removing a replica
    moves only the keys whose walk meets it. Immutable once built; rebuild when the replica set changes."""

    def __init__(self, urls: Sequence[str], vnodes: int = 64):
        self.urls = tuple(sorted(set(urls)))
        points = sorted((_h64(f"{url}#{k}"), url) for url in self.urls for k in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [u for _, u in points]

    def walk(self, key: str):
        """Replica URLs in the order the key's walk meets them (each once)."""
        if not self._keys:
            return
        start = bisect.bisect(self._keys, _h64(key))
        seen: set[str] = set()
        n = len(self._keys)
        for k in range(n):
            url = self._owners[(start + k) % n]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == len(self.urls):
                    return

    def choose(self, key: str, views: Sequence[ReplicaView], loads: list[Load], idx: list[int],
               load_factor: float) -> int:
        by_url = {views[i].url: i for i in idx}
        total = sum(loads[i].queued for i in idx)
        capacity = math.ceil(load_factor * (total + 1) / len(idx))
        first = None
        for url in self.walk(key):
            i = by_url.get(url)
            if i is None:
                continue
            if first is None:
                first = i
            if loads[i].queued < capacity:
                return i
        if first is not None:
            return first
        return min(idx, key=lambda i: (loads[i].queued, i))  # replicas the ring does not know yet
