"""How long an engine step takes, fitted online from the engine's own steps, and how many prompt tokens a step may
carry to stay under a target time.

    seconds ~ c0 + c1 * prefill tokens + c2 * decoding sequences + c3 * context tokens read

(context tokens read: for each sequence in the step, the tokens its attention reads, its computed tokens plus the
new ones). Least squares over the last `window` steps, columns scaled to unit norm; a coefficient that comes out
negative is dropped (fixed at 0) and the rest refitted, so the model stays physical (every feature costs time).
The model is ready once it holds `min_samples` steps and its prefill coefficient is positive; until then
`max_prefill_tokens` answers None (no bound). It refits at most every `refit_every` new steps. Pure: no clock.

Steps cut to a target are aimed at the target over `overrun`: what such steps took over their prediction, averaged
(`observe_cut`: exponentially, OVERRUN_WEIGHT per step, within [OVERRUN_MIN, OVERRUN_MAX]). A linear fit over every
step is biased for the steps that matter: most steps are short decodes, and the cut ones, full of prompt tokens,
took 1.07-1.26x their prediction (two engines at 1.5 requests/s, 100 ms TPOT targets: 112 ms and 95 ms at the median
where 89 ms was predicted, so streams paced at 90 ms went at 96-100 ms).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np


class StepShape(NamedTuple):
    prefill_tokens: int  # tokens of prompt chunks (and of recomputed sequences)
    decode_seqs: int  # sequences decoding one token
    context_tokens: int  # tokens the step's attention reads (computed + new, summed over its sequences)


class _Seq(Protocol):
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


def step_shape(scheduled: Iterable[tuple[_Seq, int]]) -> StepShape:
    """The shape of a step just scheduled, before it runs: (sequence, its new tokens) pairs. A sequence computing
    its last known token decodes (a prompt's last token too: it costs what a decode does); anything else is prompt
    (or recomputed) tokens."""
    prefill = decodes = context = 0
    for seq, n in scheduled:
        if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:
            decodes += 1
        else:
            prefill += n
        context += seq.num_computed_tokens + n
    return StepShape(prefill, decodes, context)


OVERRUN_WEIGHT = 0.05  # a cut step's share in the average overrun (about the last 20 cut steps)
OVERRUN_MIN, OVERRUN_MAX = 0.5, 2.0


class StepTimeModel:
    def __init__(self, window: int = 256, min_samples: int = 32, refit_every: int = 8):
        if window < 4 or not 4 <= min_samples <= window or refit_every < 1:
            raise ValueError(f"need window >= min_samples >= 4 and refit_every >= 1, got {window}, {min_samples}, "
                             f"{refit_every}")
        self.min_samples, self.refit_every = min_samples, refit_every
        self.samples: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.coefficients: tuple[float, float, float, float] | None = None  # c0 (s), c1, c2, c3 (s per unit)
        self._new = 0  # samples since the last fit
        self.overrun = 1.0  # what steps cut to a target took over their prediction, averaged (`observe_cut`)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.samples.append((*shape, seconds))
        self._new += 1
        if len(self.samples) >= self.min_samples and (self.coefficients is None or self._new >= self.refit_every):
            self._new = 0
            self.coefficients = fit(list(self.samples))

    def observe_cut(self, predicted_s: float | None, seconds: float) -> None:
        """A step whose prompt tokens were cut to a target took `seconds`, predicted `predicted_s`."""
        if predicted_s is None or not predicted_s > 0 or not math.isfinite(seconds) or seconds < 0:
            return
        ratio = min(max(seconds / predicted_s, OVERRUN_MIN), OVERRUN_MAX)
        self.overrun = min(max(self.overrun + OVERRUN_WEIGHT * (ratio - self.overrun), OVERRUN_MIN), OVERRUN_MAX)

    def aim(self, target_s: float) -> float:
        """The predicted time a step is cut to so that it takes target_s."""
        return target_s / self.overrun

    @property
    def ready(self) -> bool:
        return self.coefficients is not None

    def predict(self, shape: StepShape) -> float | None:
        if self.coefficients is None:
            return None
        c0, c1, c2, c3 = self.coefficients
        return c0 + c1 * shape.prefill_tokens + c2 * shape.decode_seqs + c3 * shape.context_tokens

    def max_prefill_tokens(self, target_s: float, decode_seqs: int, decode_context: int) -> int | None:
        """The most prompt tokens a step with these decodes can carry and still be predicted at or under target_s
        (0 when the decodes alone reach it; each prompt token counts as one context token read too); None until
        the model is ready."""
        if self.coefficients is None:
            return None
        c0, c1, c2, c3 = self.coefficients
        room = target_s - (c0 + c2 * decode_seqs + c3 * decode_context)
        return max(0, math.floor(room / (c1 + c3) + 1e-9))


@dataclass
class StepTimeStats:
    """What the model predicted against what the steps took (the engine's /metrics: kvfleet:step_*)."""

    last_s: float = 0.0  # the last step's wall time
    last_predicted_s: float = 0.0  # the model's time for it (0 until fitted)
    predicted_steps: int = 0  # steps the model had a prediction for, and over them:
    predicted_s_total: float = 0.0  # the predicted seconds
    observed_s_total: float = 0.0  # the seconds they took
    abs_error_s_total: float = 0.0  # |predicted - taken|

    def record(self, predicted_s: float | None, seconds: float) -> None:
        self.last_s, self.last_predicted_s = seconds, predicted_s or 0.0
        if predicted_s is not None:
            self.predicted_steps += 1
            self.predicted_s_total += predicted_s
            self.observed_s_total += seconds
            self.abs_error_s_total += abs(predicted_s - seconds)


def fit(samples: list[tuple[int, int, int, float]]) -> tuple[float, float, float, float] | None:
    """Least squares (c0, c1, c2, c3) with non-negative coefficients (negative ones dropped, the rest refitted);
    None when the prefill tokens' coefficient is not positive (nothing to bound prompts by)."""
    data = np.asarray(samples, dtype=np.float64)
    x = np.column_stack([np.ones(len(data)), data[:, :3]])
    y = data[:, 3]
    keep = [j for j in range(4) if np.any(x[:, j])]  # a feature never seen (no decodes yet) is not fitted
    coef = np.zeros(4)
    while keep:
        cols = x[:, keep]
        scale = np.linalg.norm(cols, axis=0)
        sol = np.linalg.lstsq(cols / scale, y, rcond=None)[0] / scale
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            coef[keep] = sol
            break
        del keep[worst]
    if coef[1] <= 0:
        return None
    c0, c1, c2, c3 = (float(c) for c in coef)
    return c0, c1, c2, c3
