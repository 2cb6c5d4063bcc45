"""Predicted time to first token (TTFT) and time per output token (TPOT) on a replica, each fitted online from
what the router observes on the streams it proxies.

    TTFT seconds ~ c0 + c1 * the request's prompt work there, in prefill tokens: its uncached prompt tokens, and in
                             place of a prefix a peer hands over, the pull's measured cost (or the wait for the
                             peer's own prefill), of one a lower tier holds, its reload (policies/load.py)
                      + c2 * prefill this router knows is ahead there (its own requests' uncached tokens, no token yet;
                             for a request with a TTFT target, only theirs due before it: the engine serves prompts
                             earliest due first)
                      + c3 * waiting requests other routers sent there (scraped)
                      + c4 * running sequences there (scraped, plus this router's sent since)
                      + c5 * the prompt work times the running sequences
                      + c6 * the prefill ahead times the running sequences

The products: prompts compute slower the more sequences decode beside them. A step carries each running decode
besides its prompt chunk and is cut to a time (the strictest TPOT target there, or the engine's step bound), so each
decode leaves fewer prompt tokens in each step (seconds per prompt token ~ c1 + c5 * running). Without them the
model, fitted mostly on light load, predicted a 320-token prompt behind 320 more with 3-4 streams decoding at
0.9-1.2 s, where the streams saw 2.7-3.5 s (twenty-eighth and thirty-first sessions, docs/results.md).

    TPOT seconds ~ c0 + c1 * sequences decoding there once the request joins them (scraped, plus this router's sent
                             since, plus the request)
                      + c2 * KV tokens those sequences hold (scraped usage, plus the request's prompt): what each
                             step reads
                      + c3 * prefill ahead there (this router's pending uncached tokens), whose chunks share steps
                      + c4 * waiting requests other routers sent there (scraped)
                      + c5 * uncached prompt tokens/s this router has lately been sending there: the prefill still
                             to come, whose chunks will share the steps of the request's decode

The features are read from the replica's view when the request is placed (`ttft_features`, `tpot_features`); the
request's first streamed token gives the TTFT seconds, its last one over its output tokens the TPOT seconds
(`observe`). One `LatencyModel` per quantity: the least absolute relative error (each observation's error divided
by max(its seconds, `MIN_WEIGHT_S`): a 40 ms first token missed by 20 ms counts as much as a 4 s one missed by 2 s)
over the last `window` observations, as the error is judged: by its median. Least squares aims at the mean, which
a few slow outliers pull and, where the seconds are bimodal (streams at their step bound or at the decodes' pace),
lands between the modes; absolute error aims at a (1 / seconds weighted) median. Replayed on two live runs'
observations (thirty-seventh session, docs/results.md): median TPOT error 0.295 -> 0.232 and 0.264 -> 0.234, TTFT
0.170 -> 0.157 and 0.099 -> 0.095.
Fitted by iteratively reweighted least squares (`IRLS_ROUNDS` rounds from the least-squares solution), columns
scaled to unit norm, every `refit_every` observations while the window fills and every eighth of it after; a
coefficient that comes out negative is fixed at 0 and the rest refitted, so every feature costs time.
A request with a TPOT target on a kvfleet engine is predicted at most the step that engine keeps for it
(`bounded_tpot`): the engine fills each such step with prefill up to that bound while prompts are there, so those
streams go at the bound under load and at the decodes' own pace without it (2/s on two engines, 100 ms targets:
85-100 ms with prefill ahead, 20-25 ms without, where the model fitted on all streams said 35-65 ms). Their
seconds per token as a share of the bound are fitted by a model of their own (the paced model, the same features;
they teach the TPOT model too, so that it is fitted where every stream has a target). Until `min_samples` observations are in (and some coefficient is positive) `predict` answers None: no
prediction, no target refused for want of one. Shared by every replica of a router (the engines of one pool run
one model on like hardware; a replica's own load is in its features). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, TypeVar

import numpy as np

from contract.slo import step_bound
from router.routing.policies.base import ReplicaView

MIN_WEIGHT_S = 0.01  # observations faster than this weigh as much as one of 10 ms
IRLS_ROUNDS = 20  # reweightings toward the least absolute error (20 against 30: within 0.005 of its median error)
IRLS_FLOOR = 1e-3  # relative errors below this weigh as this one (keeps the weights finite)


class TTFTFeatures(NamedTuple):
    prompt_tokens: float  # this request's prompt work on the replica, in prefill tokens (uncached, pulled, reloaded)
    ahead_tokens: float  # this router's pending prefill there
    waiting: float  # other routers' waiting requests there
    running: float  # running sequences there
    prompt_x_running: float  # prompt_tokens * running: decodes beside the prompt slow it
    ahead_x_running: float  # ahead_tokens * running: and the prefill ahead of it

    @classmethod
    def of(cls, prompt_tokens: float, ahead_tokens: float, waiting: float, running: float) -> TTFTFeatures:
        return cls(prompt_tokens, ahead_tokens, waiting, running, prompt_tokens * running, ahead_tokens * running)


class TPOTFeatures(NamedTuple):
    running: float  # sequences decoding there once the request joins them
    kv_tokens: float  # KV tokens they hold: what each decode step reads
    ahead_tokens: float  # this router's pending prefill there: chunks that share the steps
    waiting: float  # other routers' waiting requests there
    prefill_rate: float  # this router's recent uncached prompt tokens/s there: prefill to come during the decode


Features = TypeVar("Features", TTFTFeatures, TPOTFeatures)


def _running(view: ReplicaView) -> int:
    """Sequences running there: the scrape's, less this router's finished since, plus its sent since."""
    return max(view.running - view.finished, 0) + view.new_requests


def _waiting(view: ReplicaView) -> int:
    """Requests waiting there that other routers sent (this router's own are in `pending_tokens`)."""
    return max(view.waiting - view.pending, 0)


def ttft_features(view: ReplicaView, prompt_tokens: float) -> TTFTFeatures:
    """prompt_tokens: the request's prompt work on the replica in prefill tokens (policies/load.py prefill_tokens:
    its uncached tokens, and a peer pull's transfer or a tier's reload in their place)."""
    ahead = view.pending_tokens if view.due_ahead_tokens is None else view.due_ahead_tokens
    return TTFTFeatures.of(float(max(prompt_tokens, 0)), float(ahead), float(_waiting(view)), float(_running(view)))


def tpot_features(view: ReplicaView, num_prompt_tokens: int) -> TPOTFeatures:
    return TPOTFeatures(float(_running(view) + 1), float(view.kv_tokens + num_prompt_tokens),
                        float(view.pending_tokens), float(_waiting(view)), view.prefill_rate)


def bounded_tpot(model: LatencyModel, x: TPOTFeatures, target_s: float | None, bounds_steps: bool,
                 paced: LatencyModel | None = None) -> float | None:
    """The TPOT model's prediction; for a request with a TPOT target on an engine that keeps its steps under it
    (kvfleet's: `step_bound` of the target, contract/slo.py), when a step without prefill fits in it (the model
    without its prefill terms: ahead, waiting, prefill rate), the paced model's share of that bound (once `paced`
    is ready; else the model's prediction), at most the bound: the engine fills each of the request's steps with
    prefill up to the bound while prompts are there, and cuts the rest."""
    s = model.predict(x)
    if s is None or target_s is None or not bounds_steps:
        return s
    bound = step_bound(target_s)
    decode_only = model.predict(x._replace(ahead_tokens=0.0, waiting=0.0, prefill_rate=0.0))
    if decode_only is None or decode_only > bound:
        return s
    share = paced.predict(x) if paced is not None else None
    return min(s if share is None else share * bound, bound)


class LatencyModel:
    def __init__(self, window: int = 512, min_samples: int = 16, refit_every: int = 8):
        if window < 5 or not 5 <= min_samples <= window or refit_every < 1:
            raise ValueError(f"need window >= min_samples >= 5 and refit_every >= 1, got {window}, {min_samples}, "
                             f"{refit_every}")
        self.min_samples, self.refit_every = min_samples, refit_every
        self.samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.coefficients: tuple[float, ...] | None = None  # c0 (s), then seconds per unit of each feature
        self._new = 0

    def observe(self, x: Features, seconds: float) -> None:
        if not seconds >= 0:
            return
        self.samples.append((x, seconds))
        self._new += 1
        if len(self.samples) >= self.min_samples and (self.coefficients is None or self._new >= self._every()):
            self._fit()

    def _every(self) -> int:
        """New observations between fits: `refit_every` while the window fills, then an eighth of the window (a
        fit of a full window takes ~2.7 ms; at 1,000 first tokens/s every 8 would take a third of a core, every
        64 about as much as the least-squares fit every 8 did, and 64 of 512 observations move it little:
        replayed, the median errors stayed within 0.005)."""
        window = self.samples.maxlen or 0
        return self.refit_every if len(self.samples) < window else max(self.refit_every, window // 8)

    def predict(self, x: Features) -> float | None:
        c = self.coefficients
        if c is None:
            return None
        return c[0] + sum(ci * xi for ci, xi in zip(c[1:], x, strict=True))

    @property
    def ready(self) -> bool:
        return self.coefficients is not None

    def _fit(self) -> None:
        self._new = 0
        w = 1.0 / np.maximum([s for _, s in self.samples], MIN_WEIGHT_S)  # relative error: rows scaled by 1/seconds
        a = np.array([(1.0, *x) for x, _ in self.samples]) * w[:, None]
        y = np.array([s for _, s in self.samples]) * w
        keep = list(range(a.shape[1]))
        coef = np.zeros(a.shape[1])
        while keep:
            sol = least_absolute(a[:, keep], y)
            negative = [k for k, v in zip(keep, sol, strict=True) if v < 0]
            if not negative:
                coef[:] = 0.0
                coef[keep] = sol
                break
            keep = [k for k in keep if k not in negative]
        self.coefficients = tuple(float(v) for v in coef) if coef.any() else None


def least_absolute(a: np.ndarray, y: np.ndarray, rounds: int = IRLS_ROUNDS) -> np.ndarray:
    """c minimizing sum |a @ c - y| (approximately: `rounds` reweightings of least squares, each row weighted by
    1 / its last absolute error, from the least-squares solution); columns scaled to unit norm for the solves."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    an = a / norms
    sol = np.linalg.lstsq(an, y, rcond=None)[0]
    for _ in range(rounds):
        root_u = 1.0 / np.sqrt(np.maximum(np.abs(an @ sol - y), IRLS_FLOOR))
        sol = np.linalg.lstsq(an * root_u[:, None], y * root_u, rcond=None)[0]
    return sol / norms
