"""Proposing draft tokens for a step, and keeping those the target model agrees with.

The scheduler asks `propose(seq, num_running)` for every running sequence that decodes; a sequence with drafts
d_1..d_k runs k+1 query positions in the step (its last token and the drafts, as a short prompt chunk over its
paged KV), and the model returns logits for each. `sampling_rows` gives the sampler one row per position: row j
is the sequence as it would stand after d_1..d_j (penalties, min_tokens and the seeded draw's position all
follow). Each row is sampled exactly as a decode step would sample it, and `accept` keeps the longest run of
drafts equal to what was sampled at their positions, plus the token sampled after that run (the correction, or
the bonus token when every draft was kept).

That is the standard rejection rule for a draft distribution that is a point mass on d (accept d with probability
p(d), else draw from p without d, renormalized), drawn by sampling t ~ p and accepting when t = d: the emitted
tokens are distributed exactly as without speculation. Greedy rows are the argmax, so greedy output is token for
token the output without speculation whenever the verifying rows' logits equal a decode step's (always under
--deterministic); seeded rows draw the same numbers as they would one token at a time, so seeded output is the
same too.

Grammars (structured outputs, tool calls): a constrained sequence's drafts are cut before the first one its grammar
refuses, or after which the grammar would be done, and each verifying row j gets a fork of its matcher advanced
over d_1..d_j, so the sampler masks every position with the grammar's state there; the sequence's own matcher
advances only over the tokens kept (the engine loop). LoRA requests are proposed for like any other: each row of a
run carries its sequence's adapter (engine/lora/). Not proposed for: a sequence still in its prompt.

Where the drafts come from: prompt lookup (engine/spec/ngram.py) and suffix decoding (engine/spec/suffix.py) are
worked out in `propose`; a draft model (engine/spec/draft_model.py) runs once per step, before the scheduler, over
every running sequence that decodes (`begin_step`), and `propose` hands out what it drafted. Whatever the method,
`begin_step` asks the gate (engine/spec/draft_gate.py) whether the step drafts, and `end_step` tells it what the
step's drafting gained: the gate stops drafting that does not pay.

Back-off (a simple rule): a step with more running sequences than `disable_by_batch_size` proposes nothing; and a
sequence whose drafts were all rejected skips its next 1, 2, 4, 8, then 16 decode steps (doubling while
verifications keep rejecting everything, back to 0 at the first accepted draft).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.sequence import Sequence
from engine.spec import ngram, suffix
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_gate import PROBE_SEQS, DraftGate, undrafted

if TYPE_CHECKING:
    from engine.spec.draft_model import DraftModel

logger = logging.getLogger(__name__)

MAX_SKIP = 16


@dataclass
class SpecStats:
    """vLLM's spec_decode counters, since start."""

    num_drafts: int = 0  # verifications of a sequence with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i (0-based)


class _Backoff:
    __slots__ = ("skip", "wait")

    def __init__(self) -> None:
        self.skip = 0  # decode steps the last all-rejected verification made it skip (doubling, up to MAX_SKIP)
        self.wait = 0  # decode steps still to skip


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None,
                 gated: bool = True):
        """draft: the draft model's runner for method draft_model (engine/spec/draft_model.py); gated=False: every
        step drafts, whatever it gains (tests that count drafts)."""
        self.config = config
        self.draft = draft
        self._pending: dict[int, list[int]] = {}  # draft_model: this step's drafts by seq_id (begin_step)
        self.gate = DraftGate() if gated else None  # whether drafting pays (None: every step drafts)
        self._allowed = False  # this step may draft (begin_step: the gate said so)
        self._probe_left: int | None = None  # ngram/suffix in a probe step: sequences still to draft for
        self._drafted = False  # this step drafted for a sequence
        self._draft_wall_s = 0.0
        self._step_accepted = 0  # this step's drafts kept (accept), for the gate
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._backoff: weakref.WeakKeyDictionary[Sequence, _Backoff] = weakref.WeakKeyDictionary()
        # suffix decoding across requests: the outputs of the last finished ones (engine/spec/suffix.py)
        self.cache = (suffix.SuffixCache(config.suffix_decoding_max_cached_requests)
                      if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0 else None)

    # ---- proposing (the scheduler) -----------------------------------------------------------

    def begin_step(self, running: Seq[Sequence]) -> None:
        """Before the scheduler: whether this step drafts (the gate), and for draft_model the drafts, over every
        running sequence that decodes and would be proposed for (propose then hands them out). Other methods draft
        in propose."""
        self._pending = {}
        self._drafted, self._draft_wall_s, self._step_accepted = False, 0.0, 0
        decoding = [seq for seq in running if seq.num_tokens - seq.num_computed_tokens == 1]
        wanted = [(seq, k) for seq in decoding if (k := self._room(seq, len(running), peek=True)) > 0]
        gate = self.gate
        self._allowed = bool(wanted) and (gate is None or gate.allow(len(decoding)))
        probe = self._allowed and gate is not None and not gate.open
        self._probe_left = PROBE_SEQS if probe and self.draft is None else None
        draft = self.draft
        if draft is None or not self._allowed:
            return
        if probe:  # the sequences the draft has seen most of
            wanted = sorted(wanted, key=lambda w: draft.unseen(w[0]))[:PROBE_SEQS]
        t = time.perf_counter()
        try:
            self._pending = draft.propose(wanted)
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError: this step undrafted
            logger.warning("the draft model failed a step of %d sequences (%s: %s): no drafts this step",
                           len(wanted), type(e).__name__, e)
            return
        self._drafted, self._draft_wall_s = bool(self._pending), time.perf_counter() - t

    def end_step(self, step_s: float, out) -> None:
        """The step's whole time (the draft's included) and its SchedulerOutput: a step of decodes only tells the
        gate what drafting gained, or (drafting nothing) what a step without drafts takes."""
        drafted, self._drafted, self._allowed = self._drafted, False, False
        if self.gate is None:
            return
        shape = undrafted(out.shape, (len(it.spec_token_ids) for it in out.scheduled))
        if shape.prefill_tokens or not shape.decode_seqs:
            return  # a prompt chunk in the step: its time would hide what drafting cost or gained
        if drafted:
            draft_s = self.draft.last_cost_s if self.draft is not None else 0.0
            self.gate.observe(draft_s, step_s - self._draft_wall_s, shape.decode_seqs,
                              self._step_accepted)
        else:
            self.gate.observe_plain(step_s, shape.decode_seqs)

    def propose(self, seq: Sequence, num_running: int) -> list[int]:
        """Drafts for a running sequence that decodes this step (its last token is its only uncomputed one)."""
        k = self._room(seq, num_running, peek=False)
        if k <= 0 or (self.gate is not None and not self._allowed) or self._probe_left == 0:
            return []
        cfg = self.config
        if cfg.method == "draft_model":
            drafts = self._pending.pop(seq.seq_id, [])[:k]
        elif cfg.method == "suffix":
            drafts = self._suffix(seq.token_ids, k)
        else:
            drafts = ngram.propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if drafts and seq.matcher is not None:
            drafts = grammar_prefix(seq.matcher, drafts)
        if drafts:
            self._drafted = True
            if self._probe_left is not None:
                self._probe_left -= 1
        return drafts

    def _room(self, seq: Sequence, num_running: int, peek: bool) -> int:
        """How many drafts seq may verify now (0: none this step); a back-off wait counts down unless peek."""
        cfg = self.config
        if num_running > cfg.disable_by_batch_size:
            return 0
        if seq.num_output_tokens == 0:
            return 0  # its prompt's last token: the step that forks n > 1 and reports the first token
        back = self._backoff.get(seq)
        if back is not None and back.wait > 0:
            if not peek:
                back.wait -= 1
            return 0
        k = min(cfg.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return k

    def _suffix(self, tokens: list[int], k: int) -> list[int]:
        """The sequence's own prompt and output, or the outputs of the last finished requests: the higher score."""
        cfg = self.config
        args = (k, cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor,
                cfg.suffix_decoding_min_token_prob)
        own = suffix.propose(np.asarray(tokens, dtype=np.int64), tokens, *args)
        if self.cache is not None and self.cache.num_requests:
            shared = suffix.propose(self.cache.array(), tokens, *args)
            if shared.score > own.score:
                return shared.tokens
        return own.tokens

    def finished(self, seq: Sequence, aborted: bool) -> None:
        """A sequence ended: with suffix decoding its output joins the shared index (not an aborted one's); a draft
        model gives its draft blocks back."""
        if self.cache is not None and not aborted:
            self.cache.add(seq.output_token_ids)
        if self.draft is not None:
            self.draft.finished(seq)

    # ---- verifying (the engine, after the forward pass) ---------------------------------------

    def sampling_rows(self, seqs: Seq[Sequence], drafts: dict[int, Seq[int]]) -> list:
        """What the sampler reads for each logits row: `seqs` lists a sequence with k drafts k+1 times in a row
        (one per verified position); row j of it is the sequence after its first j drafts."""
        rows: list = []
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            d = drafts.get(seq.seq_id, ())
            rows.append(seq)
            matcher = seq.matcher
            for j in range(1, len(d) + 1):
                if matcher is not None:  # the grammar's state after d_1..d_j (propose kept only drafts it accepts)
                    matcher = matcher.fork()
                    matcher.accept_token(d[j - 1])
                rows.append(DraftView(seq, d[:j], matcher))
            i += len(d) + 1
        return rows

    def accept(self, seqs: Seq[Sequence], token_ids: Seq[int], logprobs: Seq, drafts: dict[int, Seq[int]]
               ) -> list[tuple[Sequence, list[int], list, int]]:
        """Per sequence: (seq, tokens to emit, their logprobs, drafts it ran). Rows as in sampling_rows."""
        out = []
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            d = drafts.get(seq.seq_id, ())
            sampled = token_ids[i:i + len(d) + 1]
            a = 0
            while a < len(d) and sampled[a] == d[a]:
                a += 1
            out.append((seq, list(sampled[:a + 1]), list(logprobs[i:i + a + 1]), len(d)))
            if d:
                self._count(seq, len(d), a)
            self._step_accepted += a
            i += len(d) + 1
        return out

    def _count(self, seq: Sequence, k: int, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += accepted
        for pos in range(accepted):
            st.accepted_per_pos[pos] += 1
        back = self._backoff.get(seq)
        if accepted:
            if back is not None:
                back.skip = back.wait = 0
            return
        if back is None:
            back = self._backoff[seq] = _Backoff()
        back.skip = min(MAX_SKIP, max(1, back.skip * 2))
        back.wait = back.skip


class DraftView:
    """A sequence as it would stand after some of its drafts: what the sampler reads of a row."""

    __slots__ = ("seq", "drafts", "matcher")

    def __init__(self, seq: Sequence, drafts: Seq[int], matcher=None):
        self.seq = seq
        self.drafts = list(drafts)
        self.matcher = matcher  # a constrained sequence's grammar state after the drafts (a fork of its matcher)

    @property
    def params(self):
        return self.seq.params

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts


def grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The drafts up to the first the grammar refuses or after which it is done (a stop token, or a completed
    grammar that ends without one): every kept draft leaves a position the grammar still has a mask for. The
    sequence's matcher is not advanced (the drafts run on a fork)."""
    if matcher.is_terminated():
        return []
    fork = matcher.fork()
    n = 0
    while n < len(drafts) and fork.accept_token(drafts[n]) and not fork.is_terminated():
        n += 1
    return drafts[:n]
