"""Continuous batching: which sequences run this step, and how many of their tokens.

Each sequence catches up on its known tokens: `num_computed_tokens` chases `num_tokens`, so a
prompt (possibly in chunks) and a decode step are the same thing. One token budget per step
(`max_num_batched_tokens`) and a cap on running sequences (`max_num_seqs`). Running sequences
go first, oldest first; then waiting ones in queue order. When blocks run out, a running sequence is
preempted by recompute (blocks freed, back to the waiting queue), and nothing new is admitted in that
step. After a step runs out of memory the token budget shrinks (engine/oom_backoff.py).

The queue order and the victim depend on the policy (`SchedulerConfig.policy`, vLLM's
`--scheduling-policy`):
- fcfs: arrival order; the victim is the newest running sequence (a preempted one goes back to the head);
- priority: by (effective priority, arrival, index), lower first, where a waiting request's effective
  priority is its `priority` minus one per `priority_aging_s` it has waited since arrival (so a low priority
  is never starved forever); the victim is the running sequence of the worst effective priority (aged the
  same way from its arrival), newest first among equals. Before each step, while the head of the queue has a
  strictly better effective priority than some running sequence and cannot be admitted (no seat or too few free
  blocks), that running sequence is preempted for it. Both sides age alike, so two requests never preempt each
  other in turn: their effective priorities differ by their priorities minus the periods between their arrivals,
  give or take one, and only a strict difference preempts. A sequence preempted in a step is not readmitted in it.

TTFT deadlines (`Scheduler.due`): a request with a time-to-first-token target (x-llm-d-slo-ttft-ms) is due at its
arrival plus the target; one without, or whose target has already passed, is best effort, due `priority_aging_s`
after its arrival. Under fcfs the waiting queue goes earliest due first (preempted sequences still ahead of all),
under priority `due` replaces the arrival in the rank. A running prompt's chunk leaves the step's tokens to prompts
due before it (`_goes_before`: waiting ones that can start now, and running ones later in the list). So a short interactive request is not queued behind batch
prompts that arrived before it, a request without a target waits at most about `priority_aging_s` for those with
targets, one that can no longer meet its target does not delay those that still can, and with no targets the order
is arrival order, as above.

Fair share (engine/fair_share.py): waiting requests carry a fairness id (the tenant the router names); under fcfs
the queue is served lowest virtual token counter first (each id's requests in the order above), preempted sequences
still ahead of all; under priority the counters order requests of equal effective priority. With one id (or none)
the order is exactly the one above.

Bounded steps (engine/step_time.py): the engine reports each step's time (`observe_step`) and the scheduler fits a
step-time model. When more than one sequence is waiting or running, a step's prompt tokens are cut so that the
step is predicted to take at most 90% of `max_step_ms` (TPOT_MARGIN: so that it stays under it; never below one
block of prompt tokens, so prompts progress), over what such cut steps have lately taken over their prediction (the
model's `overrun`: a step predicted at the aim then takes it);
a lone request, and every step until the model is fitted, gets the whole `max_num_batched_tokens`. A step that
can give the head of the waiting queue its first token (its whole remaining prompt fits the step) is kept shorter:
prompt chunks that do not finish in it (running ones, and waiting ones behind the head) share only the tokens that
keep it under half the target (at least one block), so a short request's own step is not filled up with another
request's long prompt (Sarathi-Serve's stall-free batching: its first token comes after the step in flight and one
short step). Whole prompts that finish in the step are not cut by this. Shorter still: when the whole prompts at
the head of the waiting queue finish in a step of their own predicted at most a quarter of the target
(`SHORT_HEADS_SHARE`: a chat's prompt beside a batch of long ones), they get that step alone, without the running
sequences' decodes and chunks, which go on in the next one (never two such steps in a row, and not while a running
sequence has a TPOT target: its steps are already cut to fit it). So a short request's first token comes after the
step in flight and a step as short as its own prompt; the decodes wait that long (at most a quarter of a step).

The engine loop: `out = schedule()`; copy `out.blocks_to_copy` in every layer's cache; run the
model on the scheduled tokens; `on_step_done(out)` (`on_step_failed(out)` if it ran out of memory);
append the sampled token to each sequence whose known tokens are now all computed; `finish(seq,
status)` the ones that are done; `observe_step(out, seconds)` with the step's wall time.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# TPOT_MARGIN: steps are sized to this share of a TPOT target (the model's ~10% error)
from contract.slo import step_bound
from engine.config import SchedulerConfig
from engine.fair_share import FairShare
from engine.kv.manager import KVCacheManager
from engine.oom_backoff import OomBackoff
from engine.sequence import Sequence, SequenceStatus
from engine.step_time import StepShape, StepTimeModel, StepTimeStats, step_shape


class DraftProposer(Protocol):
    """Draft tokens for a running sequence that decodes this step (engine/spec/decoder.py's SpecDecoder)."""

    def propose(self, seq: Sequence, num_running: int) -> list[int]: ...

    def finished(self, seq: Sequence, aborted: bool) -> None: ...


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens seq.token_ids[num_computed_tokens : num_computed_tokens + this]
    # draft tokens verified after seq's last token (engine/spec/): num_new_tokens is then 1 + len(spec_token_ids)
    spec_token_ids: tuple[int, ...] | list[int] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    shape: StepShape = StepShape(0, 0, 0)  # what the step-time model reads (engine/step_time.py)
    predicted_s: float | None = None  # the model's time for this step, when fitted
    cut: bool = False  # its prompt tokens were cut to the step's target (the step-time model's overrun learns)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled




SHORT_HEADS_SHARE = 0.25  # a step of short waiting prompts alone is predicted at most this share of the step target
# A lone prompt without a TTFT target, while requests with one came in the last RECENT_TTFT_S seconds, is computed in
# steps of at most LONE_SHARE of the strictest of those targets: a request with a target that arrives meanwhile waits
# for at most that much of the step in flight (whole, a 1,000-token prompt is one ~2 s step on a 2-core CPU).
LONE_SHARE = 1 / 3
RECENT_TTFT_S = 60.0


def step_target_s(max_step_ms: float, running) -> float | None:
    """The time a step is aimed at: TPOT_MARGIN of the strictest of max_step_ms and the TPOT targets of the running
    sequences that decode (a step is one token of each decode; steps aimed at a bound itself overrun it about half
    the time; a prompt still computing has no token to pace yet: its target bounds the steps once it decodes);
    None when neither bounds it."""
    targets = [step_bound(s.params.tpot_target_s) for s in running
               if s.params.tpot_target_s is not None and s.num_tokens - s.num_computed_tokens == 1]
    bounds = targets + ([step_bound(max_step_ms / 1000)] if max_step_ms else [])
    return min(bounds) if bounds else None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.clock = clock  # the clock of Sequence.arrival_time (aging)
        self.by_priority = config.policy == "priority"
        self._now = 0.0  # the clock at the start of the step being scheduled (priority policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_request: dict[str, list[Sequence]] = {}
        self._forked: set[str] = set()  # requests whose sequence has forked
        self._reserved_seats = 0  # children that running, not yet forked sequences will fork into
        self.oom = OomBackoff(config.max_num_batched_tokens)
        self.fair = FairShare()
        self._room_unused = False  # the last step's running prompts left room that no waiting prompt took
        self._recent_ttft: tuple[float, float] | None = None  # the strictest TTFT target lately, when last seen
        self._chunk_room: int | None = None  # this step's tokens for prompt chunks that do not finish in it
        self._heads_only = False  # the last step was one of short waiting prompts alone (`_short_heads_step`)
        self.step_time = StepTimeModel()
        self.step_stats = StepTimeStats()
        self.proposer: DraftProposer | None = None  # with --speculative-config: drafts for decodes (engine/spec/)

    # ---- admission -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, already admitted (engine/admission.py: it fits max_model_len and the cache)."""
        seq.status = SequenceStatus.WAITING
        self.fair.enter(seq.fairness_id)
        self.waiting.append(seq)
        if seq.params.ttft_target_s is not None:
            now, target, last = self.clock(), seq.params.ttft_target_s, self._recent_ttft
            if last is not None and now - last[1] <= RECENT_TTFT_S:
                target = min(target, last[0])
            self._recent_ttft = (target, now)
        self._by_request.setdefault(seq.request_id, []).append(seq)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, half_room = self._step_budget(self.oom.token_budget)
        if self.by_priority:
            self._now = now = self.clock()
            if self.waiting:
                self.waiting = self._ranked(now)
                self._preempt_for_head(out, now, budget)
        elif len(self.waiting) > 1:
            self._order_waiting()
        made_room = len(out.preempted)
        if not made_room and self._short_heads_step(out, budget):
            return out
        # a step in which running prompts made room for waiting ones that did not start after all (blocks ran
        # out) is not followed by another: running prompts always progress
        fair = not self.by_priority and len(self.fair.active) > 1
        timed = self._some_live_target(now := self.clock())
        yields = (fair or timed) and bool(self.waiting) and not self._room_unused
        startable = self._startable(budget) if yields else []
        self._chunk_room = self._chunk_room_for(budget, half_room, startable if yields else None)
        self._schedule_running(out, budget, startable, fair, now if timed else None)
        num_running = len(out.scheduled)
        budget -= out.num_batched_tokens
        if len(out.preempted) == made_room:  # no running sequence ran out of blocks
            self._schedule_waiting(out, budget)
        self._room_unused = bool(startable) and len(out.scheduled) == num_running
        out.shape = step_shape((item.seq, item.num_new_tokens) for item in out.scheduled)
        out.predicted_s = self.step_time.predict(out.shape)
        out.cut = half_room is not None and out.shape.prefill_tokens > 0
        return out

    def _short_heads_step(self, out: SchedulerOutput, budget: int) -> bool:
        """A step of its own for the short prompts at the head of the waiting queue (module docstring): scheduled
        into `out` when they finish in a step predicted at most SHORT_HEADS_SHARE of the step target, while others
        run, no running sequence has a TPOT target and the last step was not one such; False (nothing scheduled)
        otherwise."""
        last, self._heads_only = self._heads_only, False
        if last or not self.waiting or not self.running or any(s.params.tpot_target_s is not None
                                                                 for s in self.running):
            return False
        target = step_target_s(self.config.max_step_ms, self.running)
        if target is None or not self.step_time.ready:
            return False
        total = context = 0
        for k, (seq, n) in enumerate(self._startable(budget)):
            predicted = self.step_time.predict(StepShape(total + n, 0, context + seq.num_tokens))
            if self.waiting[k] is not seq or predicted is None or predicted > SHORT_HEADS_SHARE * target:
                break
            total, context = total + n, context + seq.num_tokens
        if total <= 0:
            return False
        self._chunk_room = 0  # the heads whole, nobody's chunk
        self._schedule_waiting(out, total)
        if not out.scheduled:
            return False
        self._heads_only = True
        out.shape = step_shape((item.seq, item.num_new_tokens) for item in out.scheduled)
        out.predicted_s = self.step_time.predict(out.shape)
        return True

    def _step_budget(self, budget: int) -> tuple[int, int | None]:
        """The step's token budget: all of it for an unfitted model or a lone sequence (but a prompt without a TTFT
        target while targets came lately: _lone_target), else the decodes' tokens
        and the prompt tokens that keep the step's predicted time at or under its target: max_step_ms, or the
        strictest TPOT target of a running sequence when that is lower (at least one block). And the prompt tokens
        that keep it under half the target (None when the step is not bounded)."""
        lone = len(self.running) + len(self.waiting) <= 1
        target = self._lone_target() if lone else step_target_s(self.config.max_step_ms, self.running)
        if target is None:
            return budget, None
        decodes = [s.num_tokens for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        chunked = [s.num_computed_tokens for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        context = sum(decodes) + sum(chunked)  # what the decodes and the prompts already started read
        aim = self.step_time.aim(target)  # what the model predicts for steps that take the target
        room = self.step_time.max_prefill_tokens(aim, len(decodes), context)
        if room is None:
            return budget, None
        half = None if lone else self.step_time.max_prefill_tokens(aim / 2, len(decodes), context)
        return min(budget, len(decodes) + max(room, self.kv.block_size)), half

    def _lone_target(self) -> float | None:
        """The step target of a lone sequence: none, unless it is a prompt without a TTFT target while requests
        with one came lately (LONE_SHARE of the strictest of them)."""
        seqs = self.running or self.waiting
        if not seqs or self._recent_ttft is None or self.clock() - self._recent_ttft[1] > RECENT_TTFT_S:
            return None
        seq = seqs[0]
        if seq.params.ttft_target_s is not None or seq.num_tokens - seq.num_computed_tokens <= 1:
            return None
        return step_bound(self._recent_ttft[0] * LONE_SHARE)

    def _chunk_room_for(self, budget: int, half_room: int | None,
                        startable: list[tuple[Sequence, int]] | None) -> int | None:
        """The prompt tokens that chunks not finishing this step may take in all (None: no limit beyond the budget):
        at least one block, at most what keeps the step under half its target, when the head of the waiting queue
        can start now and its whole remaining prompt fits the step beside the decodes."""
        if half_room is None or not self.waiting:
            return None
        heads = startable if startable is not None else self._startable(budget, first_only=True)
        decodes = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        if not heads or heads[0][1] > budget - decodes:
            return None
        return max(half_room, self.kv.block_size)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran the step `out` in `seconds` (wall time, schedule to sampled tokens)."""
        if out.scheduled:
            self.step_stats.record(out.predicted_s, seconds)
            self.step_time.observe(out.shape, seconds)
            if out.cut:
                self.step_time.observe_cut(out.predicted_s, seconds)

    # ---- priority --------------------------------------------------------------------------

    def due(self, seq: Sequence, now: float) -> float:
        """When `seq` should have its first token: its arrival plus its TTFT target, while that is not past; else
        (no target, or one already missed) its arrival plus priority_aging_s: best effort."""
        target = seq.params.ttft_target_s
        if target is not None and now <= seq.arrival_time + target:
            return seq.arrival_time + target
        return seq.arrival_time + self.config.priority_aging_s

    def _order_waiting(self) -> None:
        """fcfs: preempted sequences first (at the head already: they stay there), then the others earliest due
        first (only when some carries a TTFT target: otherwise that is arrival order), merged across fairness ids
        lowest counter first."""
        timed = any(s.params.ttft_target_s is not None for s in self.waiting)
        if not timed and len(self.fair.active) <= 1:
            return
        preempted = [s for s in self.waiting if s.num_preemptions]
        rest = [s for s in self.waiting if not s.num_preemptions]
        if timed:
            now = self.clock()
            rest.sort(key=lambda s: self.due(s, now))  # stable: equal dues keep queue order
        self.waiting = deque(preempted + self.fair.order(rest))

    def rank(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        """A sequence's place in the priority order (effective priority, due, index): lower goes first; the running
        one with the largest is preempted first."""
        aged = int(max(0.0, now - seq.arrival_time) // self.config.priority_aging_s)
        return seq.params.priority - aged, self.due(seq, now), seq.index

    def _preempt_for_head(self, out: SchedulerOutput, now: float, budget: int) -> None:
        head = self.waiting[0]
        effective = self.rank(head, now)[0]
        while self.running:
            worst = max(self.running, key=lambda s: self.rank(s, now))
            if self.rank(worst, now)[0] <= effective:
                break  # nobody running has a strictly lower priority than the head (the common case: no lookup)
            if self._fits(head, budget):
                break
            self.running.remove(worst)
            self._preempt(worst)
            out.preempted.append(worst)
        if out.preempted:  # the preempted went to the front: the head goes back in front of them
            self.waiting = self._ranked(now)

    def _ranked(self, now: float) -> deque[Sequence]:
        """The waiting queue by rank; among equal effective priorities, lowest virtual token counter first."""
        ranked = sorted(self.waiting, key=lambda s: self.rank(s, now))
        if len(self.fair.active) > 1:
            runs = itertools.groupby(ranked, key=lambda s: self.rank(s, now)[0])
            ranked = [s for _, run in runs for s in self.fair.order(list(run))]
        return deque(ranked)

    def _fits(self, seq: Sequence, budget: int) -> bool:
        """Whether the waiting `seq` has a seat and the blocks its first chunk needs."""
        seats = 1 + self._unforked_children(seq)
        if len(self.running) + self._reserved_seats + seats > self.config.max_num_seqs:
            return False
        computed, num_hit = self.kv.get_computed_blocks(seq)
        n = max(1, min(seq.num_tokens - seq.num_computed_tokens - num_hit, budget - len(self.running)))
        return self.kv.num_blocks_needed(seq, n, computed) <= self.kv.num_free_blocks

    def _startable(self, budget: int, first_only: bool = False) -> list[tuple[Sequence, int]]:
        """(sequence, prompt tokens) of the waiting sequences at the head of the queue that could start now (a
        seat, an adapter slot, no wait for a block being computed), as many as the budget holds: a running prompt
        leaves their tokens to those that go before it (`_goes_before`)."""
        out: list[tuple[Sequence, int]] = []
        total, seats = 0, len(self.running) + self._reserved_seats
        computing = self._computing_blocks()
        for seq in self.waiting:
            seats += 1 + self._unforked_children(seq)
            if total >= budget or seats > self.config.max_num_seqs or not self._lora_fits(seq):
                break
            num_hit = self.kv.get_computed_blocks(seq)[1]
            if not self._next_block_computing(seq, num_hit, computing):
                n = seq.num_tokens - seq.num_computed_tokens - num_hit
                out.append((seq, n))
                total += n
                if first_only:
                    break
        return out

    def _some_live_target(self, now: float) -> bool:
        """Whether a waiting sequence, or a running one still in its prompt, has a TTFT target not yet past."""
        return any(self._live_target(s, now) for s in self.waiting) or any(
            self._live_target(s, now) for s in self.running if s.num_tokens - s.num_computed_tokens > 1)

    @staticmethod
    def _live_target(seq: Sequence, now: float) -> bool:
        target = seq.params.ttft_target_s
        return target is not None and now <= seq.arrival_time + target

    def _goes_before(self, other: Sequence, seq: Sequence, fair: bool, now: float | None) -> bool:
        """Whether the prompt `other` (waiting and able to start, or running after `seq` in the list) gets a step's
        tokens before the running prompt chunk of `seq`: under fair share a waiting one of a lower counter, and
        (`now` given) one with a TTFT target not yet past that is due before seq (under priority, of no worse a
        priority)."""
        if fair and other.status is SequenceStatus.WAITING and (
                self.fair.counters.get(other.fairness_id, 0) < self.fair.counters.get(seq.fairness_id, 0)):
            return True
        if now is None or not self._live_target(other, now) or self.due(other, now) >= self.due(seq, now):
            return False
        return not self.by_priority or self.rank(other, now)[0] <= self.rank(seq, now)[0]

    def _schedule_running(self, out: SchedulerOutput, budget: int, startable: list[tuple[Sequence, int]],
                          fair: bool, now: float | None) -> None:
        # A prefill chunk never takes the token that a later decode needs: decodes are not
        # starved while a long prompt ahead of them in the running list is prefilled. Nor does it take the tokens
        # of prompts that go before it (`_goes_before`): waiting ones that could start now, of a lower fairness
        # counter or due earlier, and running ones later in the list due earlier (`now`: some TTFT target is live).
        owed = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            need = seq.num_tokens - seq.num_computed_tokens
            if need == 1:
                owed -= 1
            n = min(need, budget - owed) if need > 1 else need
            if need > 1 and (startable or now is not None):
                ahead = sum(t for other, t in startable if self._goes_before(other, seq, fair, now))
                if now is not None:
                    ahead += sum(o.num_tokens - o.num_computed_tokens for o in self.running[i + 1:]
                                 if o.num_tokens - o.num_computed_tokens > 1 and self._goes_before(o, seq, fair, now))
                n = min(n, budget - owed - ahead)
            if 1 < need and n < need and self._chunk_room is not None:
                n = min(n, self._chunk_room)
                self._chunk_room -= max(0, n)
            if n <= 0:
                i += 1
                continue
            drafts = (self._drafts(seq, budget - owed - n, len(self.running) - i - 1)
                      if need == 1 and self.proposer is not None else ())
            n += len(drafts)
            copies = self.kv.allocate_slots(seq, n)
            while copies is None:
                victim = self._pop_victim(i)
                if victim is not seq and victim.num_tokens - victim.num_computed_tokens == 1:
                    owed -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq, n)
            if copies is None:
                break  # seq preempted itself: every sequence before it is scheduled
            out.blocks_to_copy.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            out.num_batched_tokens += n
            budget -= n
            i += 1

    def _drafts(self, seq: Sequence, room: int, later: int) -> list[int]:
        """The draft tokens a decoding seq verifies this step: what the proposer offers, as many as the step's `room`
        holds. Drafts are never worth a preemption or a delayed admission: they take new blocks only while no request
        waits for a free seat, and leave one free block for each of the `later` running sequences still to schedule."""
        assert self.proposer is not None
        drafts = self.proposer.propose(seq, len(self.running))[:max(0, room)]
        if drafts:
            base = self.kv.num_blocks_needed(seq, 1)
            admitting = self.waiting and len(self.running) + self._reserved_seats < self.config.max_num_seqs
            spare = 0 if admitting else max(0, self.kv.num_free_blocks - base - later)
            while drafts and self.kv.num_blocks_needed(seq, 1 + len(drafts)) - base > spare:
                drafts = drafts[:-1]
        return drafts

    def _pop_victim(self, i: int) -> Sequence:
        """Take the running sequence to preempt, among those not scheduled yet this step (from index i on)."""
        if not self.by_priority:
            return self.running.pop()  # newest
        victim = max(self.running[i:], key=lambda s: self.rank(s, self._now))
        self.running.remove(victim)
        return victim

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        computing: set[int] | None = None  # prompt blocks running prefills have yet to cache (built when needed)
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seq.status is SequenceStatus.WAITING and out.preempted and seq in out.preempted:
                break  # preempted in this step for the one ahead of it: not back before the next
            seats = 1 + self._unforked_children(seq)
            if len(self.running) + self._reserved_seats + seats > self.config.max_num_seqs:
                break
            if seq.lora is not None and not self._lora_fits(seq):
                break  # its adapter would make a step need more than max_loras slots: it waits for one to end
            computed, num_hit = self.kv.get_computed_blocks(seq)
            if computing is None:
                computing = self._computing_blocks()
            if self._next_block_computing(seq, num_hit, computing):
                i += 1  # a running prefill is computing the block it needs next: it waits to hit it, not to redo it
                continue
            need = seq.num_tokens - seq.num_computed_tokens - num_hit
            n = min(need, budget)
            if n < need and self._chunk_room is not None:  # a chunk that will not finish in this step
                n = min(n, self._chunk_room)
                if n <= 0:
                    break
            copies = self.kv.allocate_slots(seq, n, computed)
            if copies is None:
                break  # nobody overtakes the head of the queue
            if n < need and self._chunk_room is not None:
                self._chunk_room -= n
            del self.waiting[i]
            self._reserved_seats += seats - 1
            self.kv.record_prefix_query(seq.num_tokens, num_hit)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
                self.fair.charge(seq.fairness_id, prompt_tokens=seq.num_tokens - seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            computing.update(self._uncached_prompt_blocks(seq))
            out.blocks_to_copy.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, n))
            out.num_batched_tokens += n
            budget -= n

    # ---- one prefill per new prefix ------------------------------------------------------------
    # Requests that arrive together with the same new prefix (a burst on a new system prompt) would each compute
    # it, side by side, in the same steps. Instead, a waiting request whose next block a running prefill is
    # computing waits (those behind it may go first): when that prefill has cached the block, it is a hit.
    # The wait lasts while the block is being computed, no longer: an aborted or preempted prefill frees it.

    def _computing_blocks(self) -> set[int]:
        return {h for s in self.running for h in self._uncached_prompt_blocks(s)}

    def _uncached_prompt_blocks(self, seq: Sequence) -> list[int]:
        """Hashes of the full prompt blocks seq is still computing (none once its prompt is done)."""
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            return []
        hashes = self.kv.hash_prompt(seq)
        return hashes[seq.num_computed_tokens // self.kv.block_size:seq.num_prompt_tokens // self.kv.block_size]

    def _next_block_computing(self, seq: Sequence, num_hit: int, computing: set[int]) -> bool:
        if not computing or seq.block_table:
            return False
        hashes = self.kv.hash_prompt(seq)
        nxt = (seq.num_computed_tokens + num_hit) // self.kv.block_size
        return nxt < len(hashes) and hashes[nxt] in computing

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether seq's adapter is running already or one more adapter fits the step's max_loras slots."""
        running = {s.lora.id for s in self.running if s.lora is not None}
        return seq.lora is None or seq.lora.id in running or len(running) < self.config.max_loras

    def _unforked_children(self, seq: Sequence) -> int:
        """Sequences a request with n > 1 will still fork into (they need running slots too)."""
        if seq.params.n > 1 and seq.request_id not in self._forked:
            return seq.params.n - 1
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self._reserved_seats -= self._unforked_children(seq)
        self.kv.free(seq)
        self.kv.num_preemptions += 1
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The forward pass ran: advance computed tokens and cache the blocks that became full."""
        if out.scheduled:
            self.oom.on_success()
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished while the step ran
            seq.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)  # drafts: on_drafts_verified
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # a token is sampled for it
                self.fair.charge(seq.fairness_id, generated_tokens=1)

    def on_drafts_verified(self, seq: Sequence, num_accepted: int) -> None:
        """seq verified drafts in the step and kept num_accepted of them (its tokens appended already, the last one
        sampled after them): their K/V is computed; the slots of the rejected ones are given back, and only full
        blocks of kept tokens enter the prefix cache."""
        if seq.status is not SequenceStatus.RUNNING:
            return  # finished inside the run (its blocks are freed) or aborted
        seq.num_computed_tokens += num_accepted
        self.kv.free_tail(seq)
        self.kv.cache_full_blocks(seq)
        if num_accepted:
            self.fair.charge(seq.fairness_id, generated_tokens=num_accepted)

    def on_step_failed(self, out: SchedulerOutput) -> str | None:
        """The forward pass ran out of memory: no sequence advanced, and the next steps are smaller. A sequence
        whose copy-on-write was in the step is preempted by recompute (the copy may be half done); the others
        keep their slots for the retry. Returns the request to give up on (engine/oom_backoff.py), if any."""
        copied = {dst for _, dst in out.blocks_to_copy}
        for item in reversed(out.scheduled):  # newest first: they return to the waiting queue in order
            if copied.intersection(item.seq.block_table):
                self.running.remove(item.seq)
                self._preempt(item.seq)
            elif item.spec_token_ids and item.seq.status is SequenceStatus.RUNNING:
                self.kv.free_tail(item.seq)  # its drafts' slots: the retry proposes again
        return self.oom.on_oom(out.num_batched_tokens, {item.seq.request_id for item in out.scheduled})

    # ---- leaving ---------------------------------------------------------------------------

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (stop/length/abort) and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish needs a finished status, got {status}")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._reserved_seats -= self._unforked_children(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        if self.proposer is not None:
            self.proposer.finished(seq, status is SequenceStatus.FINISHED_ABORTED)
        self.fair.leave(seq.fairness_id)
        group = self._by_request.get(seq.request_id)
        if group is not None:
            group.remove(seq)
            if not group:
                del self._by_request[seq.request_id]
                self._forked.discard(seq.request_id)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every unfinished sequence of a request, in any state; returns them."""
        seqs = list(self._by_request.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    # ---- parallel sampling -----------------------------------------------------------------

    def fork(self, seq: Sequence, n_children: int) -> list[Sequence]:
        """n_children copies of seq sharing its blocks; indices seq.index+1, ...; same queue as seq."""
        if seq.is_finished:
            raise ValueError(f"cannot fork finished {seq!r}")
        if seq.status is SequenceStatus.RUNNING:
            self._reserved_seats -= self._unforked_children(seq)
        children = []
        for k in range(1, n_children + 1):
            child = Sequence(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.params, seq.cache_salt,
                             index=seq.index + k, arrival_time=seq.arrival_time)
            child.token_ids = list(seq.token_ids)
            child.num_cached_tokens = seq.num_cached_tokens
            child.first_scheduled_time = seq.first_scheduled_time
            child.status = seq.status
            self.kv.fork(seq, child)
            self.fair.enter(child.fairness_id)
            children.append(child)
        if seq.status is SequenceStatus.RUNNING:
            self.running.extend(children)
        else:
            pos = self.waiting.index(seq) + 1
            for j, child in enumerate(children):
                self.waiting.insert(pos + j, child)
        self._by_request.setdefault(seq.request_id, []).extend(children)
        self._forked.add(seq.request_id)
        return children

    # ---- state -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.kv.num_preemptions

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def get_seqs(self, request_id: str) -> list[Sequence]:
        return list(self._by_request.get(request_id, ()))

