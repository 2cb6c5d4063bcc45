"""Whether a draft model's drafts pay for themselves on this hardware and traffic (pure: timings are passed in).

Drafting costs k forward passes of the draft model every step, whatever it proposes; verifying costs the target
little more than a decode step at small batches. Per step that drafted, with B sequences decoding, A drafts kept,
the draft's passes taking d seconds (their steady-state cost: passes x the time of a one-token pass, so a
sequence's catch-up after idle steps does not count against drafting) and the rest of the step s seconds:

    speed-up r = ((B + A) / (d + s)) / (B / s0) = (1 + A / B) * s0 / (d + s)

tokens per second against the same step without drafts, s0: s scaled by the engine's step-time model's ratio
of the step without its drafts (each drafting sequence one decode row, its k verifying rows gone) to the step as
it ran (engine/step_time.py, `undrafted`); s itself until that model is fitted. At 16 sequences the k+1 rows
each verifies make the step 2-3x a decode step, which a draft must win back too. `speedup` follows r (a moving average: 1/4 weight per step while drafting, 1/2 per probe
while not). Below 1 the gate closes: no drafts, except one probe step after `probe_every` steps, doubling from
MIN_PROBE_EVERY to MAX_PROBE_EVERY while the probes say no; at 1 or above it opens again. A draft that rarely
agrees, or one as slow as the model, stops costing after a few steps; one that pays keeps drafting.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.step_time import StepShape

MIN_PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
WEIGHT_OPEN = 0.25
WEIGHT_PROBE = 0.5


class DraftGate:
    def __init__(self) -> None:
        self.open = True
        self.speedup: float | None = None  # the moving average of r; None before the first step that drafted
        self.probe_every = MIN_PROBE_EVERY
        self._idle = 0  # steps without drafts since the gate closed or last probed
        self.num_closed_steps = 0  # steps that did not draft because the gate was closed (since start)

    def allow(self) -> bool:
        """Once per step, before drafting: whether this step drafts (open, or a probe is due)."""
        if self.open:
            return True
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return True
        self.num_closed_steps += 1
        return False

    def observe(self, draft_s: float, step_s: float, decoding: int, accepted: int,
                undrafted_s: float | None = None) -> None:
        """A step that drafted: its draft cost, the rest of its time, its decoding sequences, the drafts kept, and
        the time the step would have taken without its drafts (None: step_s)."""
        if decoding <= 0 or step_s <= 0:
            return
        base = step_s if undrafted_s is None or undrafted_s <= 0 else undrafted_s
        r = (1 + accepted / decoding) * base / (max(0.0, draft_s) + step_s)
        w = WEIGHT_OPEN if self.open else WEIGHT_PROBE
        self.speedup = r if self.speedup is None else self.speedup + w * (r - self.speedup)
        if self.speedup >= 1.0:
            self.open, self.probe_every = True, MIN_PROBE_EVERY
        elif self.open:
            self.open, self._idle = False, 0
        else:
            self.probe_every = min(MAX_PROBE_EVERY, 2 * self.probe_every)


def undrafted(shape: StepShape, drafts: Iterable[int]) -> StepShape:
    """The step's shape without its drafts: a sequence that verified k drafts ran k+1 rows (counted as prompt
    tokens, engine/step_time.py's step_shape) and read k more context tokens; without them it is one decode."""
    prefill, decodes, context = shape
    for k in drafts:
        if k > 0:
            prefill, decodes, context = prefill - (k + 1), decodes + 1, context - k
    return StepShape(prefill, decodes, context)
