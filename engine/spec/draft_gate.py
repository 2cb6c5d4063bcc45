"""Whether drafts pay for themselves on this hardware and traffic, for every method (pure: timings are passed in).

Verifying k+1 rows per sequence makes a step dearer (at 16 sequences a step verifying 4 drafts each took ~3x a
decode step on a 2-core CPU), and a draft model also costs k forward passes of its own every step, whatever it
proposes; prompt lookup and suffix decoding cost little to propose (their time is inside the step's), but at a
batch of ordinary chats their few kept drafts can still cost more rows than they save (7% slower at 16 chats on
an AMD EPYC). The gate compares, on steps of decodes only (no prompt chunk: a prompt's time would hide either
side):

    speed-up r = ((B + A) / (d + s)) / (B / s0(B))

with B sequences decoding, A drafts kept, the draft's passes d seconds (at their steady-state cost: passes x a
one-token pass, so a sequence's catch-up after steps without drafts does not count against drafting), the rest of
the step s (ngram and suffix: d = 0, their proposing is in s), and s0(B) the time of a decode step of B sequences
without drafts: least squares a + b * B over the last CONTROL_SAMPLES such steps (the mean where they all had one
B). Those come from the steps that do not draft: while the gate is open, one control step in every CONTROL_EVERY
drafts nothing (every CONTROL_EVERY_SURE while the speed-up is at least SURE: a control step gives up what drafting
gains, ~4% of a 1.9x copy speed-up at one in 16, and the decision far from 1 needs a fresher baseline less); while
it is closed, every step but the probes. `speedup` follows r (a moving average: 1/4 weight per step while open, 1/2
per probe while closed). Below 1 the gate closes: no drafts except one probe step after `probe_every` steps,
doubling from MIN_PROBE_EVERY to MAX_PROBE_EVERY while the probes say no; at REOPEN or above it opens again (not at
1: near break-even a lucky probe would reopen it, and the steps that draft until the average falls below 1 again
lose more than drafting gains there). A probe drafts for at most PROBE_SEQS sequences (engine/spec/decoder.py): for
a draft model those it has seen most of (after a closed stretch the draft must first compute every token it missed,
which for a draft as large as the model costs more than the probe's steps saved); for ngram and suffix the first
that find a draft. Drafts that rarely agree, or a draft model as slow as the model, cost a probe step now and then
instead of every step; drafts that pay keep drafting in 15 steps of 16, or 63 of 64 when they pay 1.5x or more.

The verdict (open or closed, the speed-up, the probe interval, the steps since) is kept per class of batch sizes,
1, 2-3, 4-7, 8-15, ... decoding sequences (`batch_class`); the baseline is one line for all. What drafting gains
turns on B: at one sequence the step is memory-bound and four drafts cost about a sixth of it, at sixteen every
verifying row costs what a sequence's decode row costs (docs/results.md, thirty-second session). A single verdict
learnt on a burst of 16 chats stayed closed when one agent's copy request followed alone, and it drafted only
after the probe interval the chats had doubled, up to 256 steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from engine.step_time import StepShape

MIN_PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
CONTROL_EVERY = 16
CONTROL_EVERY_SURE = 64
SURE = 1.5
PROBE_SEQS = 4
CONTROL_SAMPLES = 64
WEIGHT_OPEN = 0.25
WEIGHT_PROBE = 0.5
REOPEN = 1.1


def batch_class(decoding: int) -> int:
    """The class of a step's batch size: 1 for one decoding sequence, 2 for 2-3, 3 for 4-7, 4 for 8-15, ..."""
    return max(decoding, 1).bit_length()


class Verdict:
    """Whether drafting pays at one class of batch sizes (see the module docstring)."""

    __slots__ = ("idle", "open", "probe_every", "speedup")

    def __init__(self) -> None:
        self.open = True
        self.speedup: float | None = None  # the moving average of r; None before the first step that drafted
        self.probe_every = MIN_PROBE_EVERY
        self.idle = 0  # closed: steps without drafts since it closed or last probed; open: since the last control


class DraftGate:
    def __init__(self) -> None:
        self.verdicts: dict[int, Verdict] = {}  # by batch_class
        self.current = self.verdict(1)  # the verdict of the class the last step that could draft was in
        self.num_closed_steps = 0  # steps that did not draft because their class was closed (since start)
        self._plain: deque[tuple[int, float]] = deque(maxlen=CONTROL_SAMPLES)  # (B, seconds) of undrafted steps

    @property
    def open(self) -> bool:
        """The last step's class drafts (open), or only probes (closed)."""
        return self.current.open

    @property
    def speedup(self) -> float | None:
        return self.current.speedup

    def verdict(self, decoding: int) -> Verdict:
        return self.verdicts.setdefault(batch_class(decoding), Verdict())

    def allow(self, decoding: int) -> bool:
        """Once per step that could draft, before drafting, with the sequences it decodes: whether it drafts (its
        class open and not a control step, or a probe is due)."""
        v = self.current = self.verdict(decoding)
        v.idle += 1
        if v.open:
            every = CONTROL_EVERY_SURE if v.speedup is not None and v.speedup >= SURE else CONTROL_EVERY
            if v.idle >= every or not self._plain:
                v.idle = 0
                return False  # a control step: the decode step without drafts, measured
            return True
        if v.idle >= v.probe_every:
            v.idle = 0
            return True
        self.num_closed_steps += 1
        return False

    def observe_plain(self, step_s: float, decoding: int) -> None:
        """A step of `decoding` decodes and nothing else that did not draft: the baseline's sample."""
        if decoding > 0 and step_s > 0:
            self._plain.append((decoding, step_s))

    def baseline(self, decoding: int) -> float | None:
        """s0(B): a decode step of B sequences without drafts, from the plain steps seen (None: none yet)."""
        if not self._plain:
            return None
        b = np.array([p[0] for p in self._plain], dtype=float)
        t = np.array([p[1] for p in self._plain])
        if b.min() == b.max():
            return float(t.mean())
        slope, intercept = np.polyfit(b, t, 1)
        if slope < 0:  # more sequences never make a step faster: the mean, as if B did not matter
            return float(t.mean())
        return float(max(0.0, intercept) + slope * decoding)

    def observe(self, draft_s: float, step_s: float, decoding: int, accepted: int) -> None:
        """A step of decodes only that drafted: its draft cost, the rest of its time, its decoding sequences and
        the drafts they kept; it teaches their class's verdict. Nothing is learnt before a plain step of decodes
        gave the baseline."""
        base = self.baseline(decoding)
        if decoding <= 0 or step_s <= 0 or base is None:
            return
        v = self.current = self.verdict(decoding)
        r = (1 + accepted / decoding) * base / (max(0.0, draft_s) + step_s)
        w = WEIGHT_OPEN if v.open else WEIGHT_PROBE
        v.speedup = r if v.speedup is None else v.speedup + w * (r - v.speedup)
        if v.open:
            if v.speedup < 1.0:
                v.open, v.idle = False, 0
        elif v.speedup >= REOPEN:
            v.open, v.idle, v.probe_every = True, 0, MIN_PROBE_EVERY
        else:
            v.probe_every = min(MAX_PROBE_EVERY, 2 * v.probe_every)


def undrafted(shape: StepShape, drafts: Iterable[int]) -> StepShape:
    """The step's shape without its drafts: a sequence that verified k drafts ran k+1 rows (counted as prompt
    tokens, engine/step_time.py's step_shape) and read k more context tokens; without them it is one decode."""
    prefill, decodes, context = shape
    for k in drafts:
        if k > 0:
            prefill, decodes, context = prefill - (k + 1), decodes + 1, context - k
    return StepShape(prefill, decodes, context)
