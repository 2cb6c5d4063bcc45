"""What each replica holds of one prompt, for the placement core (router/routing/placement.py): its prefix-cache hit
from the exact index (KV events, hashed with each replica's own block size and seed) or the approximate one (where
the router sent prompts), the prompts on their way into a cache, the tokens a lower KV tier holds, and
the peers a replica could pull from - the replica views the policy chooses over. Pure: it reads the core's indexes
and replica states, and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from router.routing.latency_model import bounded_tpot, tpot_features, ttft_features
from router.routing.policies import Decision, IndexKind, ReplicaView, RouteRequest
from router.routing.policies.load import prefill_tokens

NO_PULLS = frozenset({"vllm", "sglang"})  # engines that neither serve nor take a peer pull
BOUNDS_STEPS = frozenset({"kvfleet"})  # engines that keep their steps under a request's TPOT target

if TYPE_CHECKING:
    from router.routing.placement import Placement, Prompt


def due(prompt: Prompt, now: float) -> float | None:
    """When a request placed now is due its first token: now + its TTFT target (None without one)."""
    target = getattr(prompt, "ttft_target_s", None)
    return None if target is None else now + target


class Prediction:
    def __init__(self, placement: Placement):
        self.p = placement

    def predict_cached(self, prompt: Prompt, replicas: Sequence[str], now: float | None = None,
                       on_the_way: dict[str, str | None] | None = None, tiered: dict[str, int] | None = None
                       ) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds: from the exact index where its KV events are
        live (hashed with the block size and seed of its snapshot), from the approximate index where the policy
        falls back to it; no entry where neither predicts. With `now` given, a prompt routed to an
        exact-index replica in the last cfg.inflight_s seconds counts as held there already (on_the_way, if given,
        collects the replicas predicted so, each with the peer it was sent to pull that copy from, or None). tiered, if given, gets per replica the tokens past its cached prefix its
        lower tier holds."""
        p = self.p
        needs = p.policy.needs
        out: dict[str, int] = {}
        approx: list[str] = []
        exact: dict[tuple[int, int], list[str]] = {}
        for r in replicas:
            kind = needs.index_for(p.replicas[r].kv_events)
            if kind is IndexKind.APPROX:
                approx.append(r)
            elif kind is IndexKind.EXACT and (params := p.index.params.get(r)) is not None:
                exact.setdefault(params, []).append(r)
        for (bs, seed), group in exact.items():
            hashes = prompt.block_hashes(bs, seed)
            if hashes is not None:
                matched = p.index.matched_blocks(hashes, group)
                out.update((r, n * bs) for r, n in matched.items())
                if tiered is not None:
                    for r, n in matched.items():
                        if (t := p.index.tier_run(hashes, r, n)) > 0:
                            tiered[r] = t * bs
                if now is not None and p.inflight_on:
                    for r, n in p.inflight.matched_blocks(hashes, group, now).items():
                        if n * bs > out.get(r, 0):
                            out[r] = n * bs
                            if tiered is not None:
                                tiered.pop(r, None)
                            if on_the_way is not None:
                                on_the_way[r] = p.inflight.pulling_from(r, hashes[n - 1], now)
        if approx and (hashes := prompt.block_hashes(p.cfg.block_size, p.cfg.hash_seed)) is not None:
            bs = p.cfg.block_size
            out.update((r, n * bs) for r, n in p.approx.matched_blocks(hashes, approx).items())
        return out

    def views(self, prompt: Prompt, replicas: Sequence[str], now: float,
              excluded: set[str] | frozenset[str] = frozenset()) -> list[ReplicaView]:
        """What the policy sees of each replica for this request (an excluded one is not routable)."""
        p = self.p
        on_the_way: dict[str, str | None] = {}
        tiered: dict[str, int] = {}
        cached = self.predict_cached(prompt, replicas, now, on_the_way, tiered)
        adapter = getattr(prompt, "adapter", None)
        due_at = due(prompt, now)
        views = [p.replicas[r].view(now, p.cfg.stale_s, cached.get(r, 0), r in excluded, adapter, due_at)
                 for r in replicas]
        if tiered:
            views = [replace(v, tier_tokens=tiered[v.url]) if v.url in tiered else v for v in views]
        if p.cfg.scoring.pull_token_cost <= 0:
            return views
        # a source whose copy is on the way streams it as its prefill computes it: the pull waits for that prefill
        wait = {r: v.pending_tokens for v in views if (r := v.url) in on_the_way}
        # a copy on its way by a pull: the requests that follow it there carry the same pull (and join it), and
        # wait as it does for the source's prefill
        views = [replace(v, pulling_from=src, pulling_pending=src in on_the_way, peer_wait_tokens=wait.get(src, 0))
                 if (src := on_the_way.get(v.url)) is not None and src in p.replicas and p.replicas[src].ready else v
                 for v in views]
        # pulls go between kvfleet engines only: none from or to a replica whose metrics say it is another kind
        sources = sorted(((n, r) for r, n in cached.items() if n > 0 and p.replicas[r].ready
                          and p.replicas[r].engine not in NO_PULLS), reverse=True)[:2]
        if not sources:
            return views
        out = []
        for v in views:
            if p.replicas[v.url].engine in NO_PULLS:
                out.append(v)
                continue
            n, r = next(((n, r) for n, r in sources if r != v.url), (0, ""))
            if v.pulling_from is not None:
                r = v.pulling_from
                n = max(n, cached.get(r, 0))
            out.append(replace(v, peer_cached_tokens=n, peer_wait_tokens=wait.get(r, 0), peer_on_the_way=r in on_the_way))
        return out

    def ttft(self, views: Sequence[ReplicaView], prompt: Prompt) -> dict[str, float]:
        """Per routable view, the TTFT model's predicted seconds to the first token (none while it is not ready):
        a cached prefix lowers it, and so does one a peer hands over faster than it is computed (the same prompt
        work the policy costs, policies/load.py prefill_tokens)."""
        model, scoring = self.p.ttft, self.p.scoring()
        req = RouteRequest(prompt.num_prompt_tokens, prompt.session_key)
        return {v.url: s for v in views
                if v.routable and (s := model.predict(ttft_features(v, prefill_tokens(v, req, scoring)))) is not None}

    def tpot(self, views: Sequence[ReplicaView], prompt: Prompt) -> dict[str, float]:
        """Per routable view, the TPOT model's predicted seconds per output token (none while it is not ready),
        bounded where the engine keeps the request's TPOT target (`bounded_tpot`)."""
        return {v.url: s for v in views if v.routable and (s := self.tpot_at(v, prompt)) is not None}

    def tpot_at(self, view: ReplicaView, prompt: Prompt) -> float | None:
        """The predicted seconds per output token on the view's replica (router/routing/latency_model.py)."""
        st = self.p.replicas.get(view.url)
        return bounded_tpot(self.p.tpot, tpot_features(view, prompt.num_prompt_tokens),
                            getattr(prompt, "tpot_target_s", None), st is not None and st.engine in BOUNDS_STEPS,
                            self.p.tpot_paced)

    def missing_target(self, views: Sequence[ReplicaView], prompt: Prompt, ttft: float | None,
                       tpot: float | None) -> set[str]:
        """The routable replicas predicted to miss the TTFT or the TPOT target (None: no such target), when at
        least one is predicted to meet both (else none: the request goes where the policy puts it, the admission
        having let it through). A replica with no prediction (its model not ready yet) misses nothing."""
        predicted: dict[str, bool] = {}
        for target, seconds in ((ttft, self.ttft(views, prompt) if ttft is not None else {}),
                                (tpot, self.tpot(views, prompt) if tpot is not None else {})):
            if target is None:
                continue
            for url, s in seconds.items():
                predicted[url] = predicted.get(url, False) or s > target
        slow = {u for u, missed in predicted.items() if missed}
        routable = sum(v.routable for v in views)
        return slow if len(slow) < routable else set()

    def pull_source(self, decision: Decision, views: Sequence[ReplicaView]) -> str | None:
        """The ready replica other than the chosen one holding the most of the prompt (where it pulls from)."""
        p = self.p
        best = max(((v.cached_tokens, v.url) for v in views if v.url != decision.url and p.replicas[v.url].ready),
                   default=None)
        return best[1] if best is not None and best[0] > 0 else None
