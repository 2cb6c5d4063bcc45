"""Load arithmetic shared by the policies: effective load per replica, overload, the `kv` cost, and the
candidate pool with tie rotation.

The `kv` score of a replica for one request is in prefill tokens: the prefill the request would add there,
and the prefill it would wait behind, plus the slowdown from sharing batches with requests already running:

    cost = prefill_weight * (prompt tokens - predicted cached tokens)
           + pending tokens: uncached prompt tokens of this router's requests there that have not streamed a
             token yet (measured per replica: the prefill queued or running ahead of this request)
           + waiting_cost * (waiting - this router's pending requests, at least 0)
           + running_cost * (running + sent since the last scrape)
           + kv_token_cost * KV tokens held by running requests (kv_usage * capacity)

(`running`/`waiting` as scraped, less this router's requests that finished since the scrape.) The prefill
ahead is measured, not guessed: a chunked-prefill engine (vLLM, kvfleet) admits requests as "running" while
they prefill, so a constant per waiting or running request could not tell a queued 12,000-token prompt from
a 200-token follow-up. Only waiting requests this router did not send (another router's) still count a
constant each; a running request adds a little per-sequence overhead.

`prefill_weight` (3) counts the prefill a request adds for more than its own wait: a cache miss re-computes
a prefix the fleet already holds, and that work delays the requests queued behind it and, in a session,
splits the history between two replicas. So a request leaves the replica holding its prefix only when the
prefill ahead of it there exceeds the alternative's by more than `prefill_weight` times the tokens it would
have to recompute. Chosen on the fleet simulator (kvfleet/sim, docs/results.md): 1 let transient queues
send follow-ups away on slow engines and lost the Mooncake hit rate (0.26 at 64 replicas); 3 keeps both.
The active KV tokens weigh the contexts being decoded there (off by default; Dynamo's KV router uses 1:1).

An overloaded replica (long waiting queue or KV usage past the limit) is left out for this request only.
Load scraped too long ago is unknown, and unknown is taken pessimistically (the worst fresh load in the
fleet, at least this router's own in-flight requests), never as zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.cacheable import cacheable_tokens
from router.routing.policies.base import Decision, Reason, ReplicaView, RouteRequest

if TYPE_CHECKING:
    from router.config import ScoringConfig


@dataclass(frozen=True, slots=True)
class Load:
    queued: float  # running + waiting + sent since scrape (pessimistic when unknown): for least-load
    running: float  # running + sent since scrape
    waiting: float
    kv_usage: float
    pending_tokens: float  # uncached prompt tokens of this router's requests there that have no token yet
    kv_tokens: float
    pending: float = 0  # those requests' count


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
                        v.pending_tokens, v.kv_tokens, v.pending)
            known.append(load)
            out.append(load)
        else:
            out.append(None)
    worst = Load(max((ld.queued for ld in known), default=0), max((ld.running for ld in known), default=0),
                 max((ld.waiting for ld in known), default=0), max((ld.kv_usage for ld in known), default=0.0),
                 max((ld.pending_tokens for ld in known), default=0), max((ld.kv_tokens for ld in known), default=0.0),
                 max((ld.pending for ld in known), default=0))
    return [ld if ld is not None else
            Load(max(worst.queued, v.inflight), max(worst.running, v.inflight), worst.waiting, worst.kv_usage,
                 max(worst.pending_tokens, v.pending_tokens), worst.kv_tokens, max(worst.pending, v.pending))
            for v, ld in zip(views, out, strict=True)]


def is_overloaded(view: ReplicaView, cfg: ScoringConfig) -> bool:
    """Past the waiting-queue or KV-usage limit. Unknown load counts only what this router itself sent."""
    if not view.load_known:
        return view.inflight >= cfg.overload_waiting
    return view.waiting + view.new_requests >= cfg.overload_waiting or view.kv_usage >= cfg.overload_kv_usage


ADAPTER_LOAD_COST_TOKENS = 2048  # a replica without the request's LoRA adapter: loading it, in prefill tokens
ADAPTER_SLOT_WAIT_COST_TOKENS = 1024  # every LoRA slot there runs another adapter: the request waits for one


def pulled_tokens(view: ReplicaView, req: RouteRequest, cfg: ScoringConfig) -> int:
    """Prompt tokens past the replica's own cached prefix worth pulling from the peer that holds the most: when
    pulls are on and their transfer costs less than prefilling them there (0 otherwise)."""
    if cfg.pull_token_cost <= 0:
        return 0
    extra = min(view.peer_cached_tokens, cacheable_tokens(req.num_prompt_tokens)) - view.cached_tokens - view.tier_tokens
    if extra <= 0 or cfg.pull_fixed_tokens + cfg.pull_token_cost * extra >= extra:
        return 0
    return extra


def prompt_work(view: ReplicaView, req: RouteRequest, cfg: ScoringConfig) -> tuple[int, float]:
    """The request's prompt on the replica: (the tokens it computes there, the rest of its wait for them in
    prefill-token units). Past its cached prefix, a prefix pulled from a peer costs its transfer, or the peer's
    prefill ahead when its copy is still being computed and that is longer (the source streams the blocks as its
    prefill computes them, so the two overlap); a copy on its way there by such a pull, that wait too; one its
    lower tier holds, its reload. The `kv` cost weighs the first by prefill_weight; the TTFT model takes their
    sum (router/routing/latency_model.py), so a cache hit and a pull lower the predicted TTFT alike."""
    pulled = pulled_tokens(view, req, cfg)
    uncached = max(req.num_prompt_tokens - view.cached_tokens - view.tier_tokens - pulled, 0)
    if pulled:
        pull = cfg.pull_fixed_tokens + max(cfg.pull_token_cost * pulled, view.peer_wait_tokens)
    else:  # a copy on its way there by a pull (which this request joins) still waits for the source's prefill
        pull = view.peer_wait_tokens if view.pulling_from is not None else 0.0
    return uncached, pull + cfg.tier_token_cost * view.tier_tokens


def prefill_tokens(view: ReplicaView, req: RouteRequest, cfg: ScoringConfig) -> float:
    """The request's prompt work on the replica in prefill tokens (prompt_work's two parts together)."""
    uncached, rest = prompt_work(view, req, cfg)
    return uncached + rest


def cost(view: ReplicaView, load: Load, req: RouteRequest, cfg: ScoringConfig,
         work: tuple[int, float] | None = None) -> float:
    """One score in prefill-token units: the prompt's work there (prompt_work: the uncached prompt weighed by
    prefill_weight for prefix affinity, a pull's transfer, a tier's reload; `work` where the caller has it), the
    load ahead, and the load of the request's LoRA adapter where the replica does not hold it (adapter affinity,
    spread when holders are busy), and a wait for a LoRA slot where every slot runs another adapter."""
    uncached, rest = work if work is not None else prompt_work(view, req, cfg)
    return (cfg.prefill_weight * uncached + rest + load.pending_tokens + cfg.kv_token_cost * load.kv_tokens
            + cfg.waiting_cost_tokens * max(load.waiting - load.pending, 0) + cfg.running_cost_tokens * load.running
            + (ADAPTER_LOAD_COST_TOKENS if view.adapter_missing else 0)
            + (ADAPTER_SLOT_WAIT_COST_TOKENS if view.adapter_slots_full else 0))


def routable(views: Sequence[ReplicaView]) -> list[int]:
    return [i for i, v in enumerate(views) if v.routable]


def pool(views: Sequence[ReplicaView], cfg: ScoringConfig) -> tuple[list[int], bool]:
    """Indices of routable replicas that are not overloaded (or all routable ones, flagged, if none is)."""
    idx = routable(views)
    fine = [i for i in idx if not is_overloaded(views[i], cfg)]
    return (fine, False) if fine else (idx, True)


def pick(idx: list[int], key: Callable[[int], float | tuple[float, ...]], turn: int) -> int:
    """The index with the lowest key; equal keys rotate with `turn` so equal replicas share the work."""
    keys = {i: key(i) for i in idx}
    best = min(keys.values())
    tied = [i for i in idx if keys[i] == best]
    return tied[turn % len(tied)]


def least_load(views: Sequence[ReplicaView], loads: list[Load], idx: list[int], turn: int) -> int:
    return pick(idx, lambda i: (loads[i].queued, loads[i].kv_usage, views[i].inflight), turn)


def decision(views: Sequence[ReplicaView], loads: list[Load], req: RouteRequest, cfg: ScoringConfig, i: int,
             reason: Reason) -> Decision:
    v = views[i]
    pulled = pulled_tokens(v, req, cfg)
    predicted = min(v.cached_tokens + v.tier_tokens + pulled, cacheable_tokens(req.num_prompt_tokens))
    work = prompt_work(v, req, cfg)
    return Decision(v.url, reason, predicted, cost(v, loads[i], req, cfg, work), pulled, prefill=work[0] + work[1])
