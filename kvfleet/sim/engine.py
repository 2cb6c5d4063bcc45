"""One simulated engine replica: a FIFO scheduler with chunked prefill over the engine's real `BlockPool`.

The prefix cache is the engine's own (engine/kv/block_pool.py: reference counts, lazy LRU eviction, the
KV event log), with one pool block per trace block (`block_size` tokens: one Mooncake hash id = 512 tokens).
A sequence is admitted (first come, first served, up to `max_num_seqs`) when the pool can hold its whole
prompt and output: its cached leading blocks are taken back, the rest allocated new (evicting the least
recently freed cached blocks). One whose next block a running prefill is computing waits until it is cached
(those behind it may go first), as the engine's scheduler does. Each step decodes one token for every
sequence past its prefill and spends the rest of `max_batched_tokens` on prefill chunks, in admission order;
blocks that a step fills enter the prefix cache at its end (as the engine registers them), and a finished
sequence frees its blocks tail first.
No preemption: the whole output's blocks are reserved at admission.

Latency targets, as the engine keeps them (engine/scheduler.py): a sequence with a TTFT target is due at its arrival
plus the target, and the waiting queue and the step's prefill chunks go earliest due first (one past its target is
best effort: due BEST_EFFORT_TARGETS targets after its arrival, as the engine's 30 s `--priority-aging` is 20 of a
1.5 s target; one without a target after all that have one). While a sequence with a TPOT target decodes beside
another, a step's prefill is cut to keep the step at TPOT_MARGIN of the strictest such target (at least
MIN_CHUNK_TOKENS); a prompt still computing has no token to pace yet, so its TPOT target does not cut steps.
With targets, a request the router predicts no replica meets is refused as the HTTP router's admission does
(fleet.py, SimConfig.slo_unattainable).
The engine's `--max-step-ms` bound for requests without targets is not modelled.

With a lower tier (tier.py), admission also takes back the run of the prompt's blocks the tier holds right after
the pool's own hit: they get pool blocks, enter the prefix cache and count as hits, and the step that admits them
is longer by their reload time (latency + bytes / bandwidth per request). The engine reloads on its core between
steps (engine/kv/offload.py) when a request arrives; the simulator when it admits it, so a reloaded block cannot
be evicted again while the request waits.

A sequence handed over already prefilled (`prefilled`: a decode replica's, in a disaggregated fleet) takes
blocks for its prompt and output, caches nothing, and produces its first token in its first decode step.

Runs of identical decode-only steps are planned as one stretch (until the first sequence finishes); an
arrival cuts the stretch at the end of the step in progress, so the result is the same as stepping one by
one, only faster.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from contract.kv_events import Snapshot
from contract.slo import step_bound
from engine.kv.block_pool import BlockPool, KVCacheBlock
from kvfleet.sim.cost import CostModel
from kvfleet.sim.tier import MEDIUM, KVTier, TierSpec

BEST_EFFORT_TARGETS = 20  # a sequence past its TTFT target is due this many targets after its arrival
MIN_CHUNK_TOKENS = 16  # a step bounded for a TPOT target still prefills this much (one engine block: prompts progress)


class SimSeq:
    __slots__ = ("rid", "hashes", "prompt", "output", "arrival", "computed", "generated", "blocks", "registered",
                 "hit_blocks", "reloaded_blocks", "prefilled", "first_token_s", "done_s", "on_first", "on_done",
                 "ttft_target", "tpot_target")

    def __init__(self, rid: int, hashes: tuple[int, ...], prompt: int, output: int, arrival: float,
                 on_first: Callable[[SimSeq], None] | None = None, on_done: Callable[[SimSeq], None] | None = None,
                 prefilled: bool = False, ttft_target: float | None = None, tpot_target: float | None = None):
        self.rid = rid
        self.hashes = hashes  # chained hashes of the prompt's cacheable blocks
        self.prompt = prompt
        self.output = max(output, 1)
        self.arrival = arrival
        self.computed = 0
        self.generated = 0
        self.blocks: list[KVCacheBlock] = []
        self.registered = 0
        self.hit_blocks = 0  # cached blocks it found at admission, reloaded ones included
        self.reloaded_blocks = 0  # of those, the ones reloaded from the tier
        self.prefilled = prefilled  # its prompt's KV arrives computed (a decode replica's sequence)
        self.first_token_s: float | None = None
        self.done_s: float | None = None
        self.on_first = on_first
        self.on_done = on_done
        self.ttft_target = ttft_target  # seconds (None: none)
        self.tpot_target = tpot_target

    def due(self, now: float) -> float:
        """When it should have its first token (engine/scheduler.py Scheduler.due, module docstring)."""
        t = self.ttft_target
        if t is None:
            return math.inf
        return self.arrival + t if now <= self.arrival + t else self.arrival + BEST_EFFORT_TARGETS * t


@dataclass(slots=True)
class _Plan:
    start: float
    dt: float
    steps: int
    decode: list[SimSeq]
    chunks: list[tuple[SimSeq, int]]


class SimEngine:
    def __init__(self, name: str, num_blocks: int, block_size: int, cost: CostModel, max_num_seqs: int = 128,
                 max_batched_tokens: int = 2048, tier: TierSpec | None = None):
        self.name = name
        self.block_size = block_size
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.tier_spec = tier
        self.pool = BlockPool(num_blocks)
        self.tier: KVTier | None = None
        if tier is not None:
            self.tier = KVTier(tier.blocks(num_blocks), self.pool.events)
            self.pool.on_evict = self.tier.spill
        self.reload_s = 0.0  # reload time the next planned step carries (sequences it admitted from the tier)
        self.reloaded_blocks = 0
        self.waiting: deque[SimSeq] = deque()
        self._ordered_len = 0  # the waiting queue's length after _admit last ordered and admitted from it
        self._order_valid_until = math.inf  # when a live TTFT target in it passes (its order changes)
        self.running: list[SimSeq] = []
        self.plan: _Plan | None = None
        self.version = 0  # bumped whenever the planned end of the step stretch moves
        self.busy_s = 0.0
        self.prefill_tokens = 0

    def fits(self, seq: SimSeq) -> bool:
        return self._blocks_needed(seq) <= self.pool.num_blocks

    def _blocks_needed(self, seq: SimSeq) -> int:
        return -(-(seq.prompt + seq.output) // self.block_size)

    def add(self, seq: SimSeq, now: float) -> float | None:
        """Queue a sequence; returns the new end of the current stretch when the arrival moved it (or started
        one on an idle engine), else None."""
        self.waiting.append(seq)
        if self.plan is None:
            return self.start(now)
        p = self.plan
        if p.steps > 1:
            done = min(max(math.ceil((now - p.start) / p.dt - 1e-9), 1), p.steps)
            if done < p.steps:
                p.steps = done
                self.version += 1
                return p.start + p.dt * p.steps
        return None

    def start(self, now: float) -> float | None:
        """Plan the next stretch of steps from `now`; its end time, or None when there is nothing to run."""
        self._admit(now)
        if not self.running:
            self.plan = None
            return None
        decode = [s for s in self.running if s.computed >= s.prompt]
        budget = self.max_batched_tokens - len(decode)
        targets = [s.tpot_target for s in decode if s.tpot_target is not None]
        if targets and len(self.running) + len(self.waiting) > 1 and self.cost.prefill_token_s > 0:
            room = (step_bound(min(targets)) - self.cost.step_s(0, len(decode))) / self.cost.prefill_token_s
            budget = min(budget, max(int(room), MIN_CHUNK_TOKENS))
        chunks: list[tuple[SimSeq, int]] = []
        prefilling = [s for s in self.running if s.computed < s.prompt]
        if any(s.ttft_target is not None for s in prefilling):
            prefilling.sort(key=lambda s: s.due(now))
        for s in prefilling:
            if budget > 0:
                c = min(s.prompt - s.computed, budget)
                chunks.append((s, c))
                budget -= c
        one = bool(chunks) or self.reload_s > 0 or any(s.generated == 0 for s in decode)  # first tokens: step by step
        steps = 1 if one else min(s.output - s.generated for s in decode)
        dt = self.cost.step_s(sum(c for _, c in chunks), len(decode)) + self.reload_s
        self.reload_s = 0.0
        self.plan = _Plan(now, dt, steps, decode, chunks)
        self.version += 1
        return now + dt * steps

    def finish(self, now: float) -> list[SimSeq]:
        """End the planned stretch at `now`: apply it; returns the sequences that produced their first token."""
        p = self.plan
        assert p is not None
        self.plan = None
        self.busy_s += p.dt * p.steps
        firsts: list[SimSeq] = []
        done: list[SimSeq] = []
        for s in p.decode:
            if s.generated == 0:  # handed over prefilled: this step made its first token
                s.first_token_s = now
                firsts.append(s)
            s.generated += p.steps
            if s.generated >= s.output:
                done.append(s)
        for s, c in p.chunks:
            s.computed += c
            self.prefill_tokens += c
            self._register(s)
            if s.computed >= s.prompt:
                s.generated = 1
                s.first_token_s = now
                firsts.append(s)
                if s.output <= 1:
                    done.append(s)
        for s in done:
            s.done_s = now
            self.running.remove(s)
            self.pool.free_blocks(reversed(s.blocks))
            s.blocks = []
        for s in firsts:
            if s.on_first is not None:
                s.on_first(s)
        for s in done:
            if s.on_done is not None:
                s.on_done(s)
        return firsts

    def import_from(self, source: SimEngine, hashes: tuple[int, ...]) -> int:
        """Take into this pool, as cached blocks, the leading blocks of `hashes` the source holds past this pool's
        own leading run (as many as free blocks allow); how many."""
        mine, theirs = _leading(self.pool, hashes), _leading(source.pool, hashes)
        n = min(theirs - mine, self.pool.num_free_blocks)
        if n <= 0:
            return 0
        blocks = self.pool.get_new_blocks(n)
        hs = list(hashes[mine:mine + n])
        self.pool.cache_blocks(blocks, hs, [(h,) for h in hs], hashes[mine - 1] if mine else None)
        self.pool.free_blocks(reversed(blocks))
        return n

    def snapshot(self, block_size: int, hash_seed: int) -> Snapshot:
        """What a new subscriber to the engine's KV events gets: the pool's blocks, and the tier's with its medium."""
        tiers = ((MEDIUM, tuple(self.tier.hashes())),) if self.tier is not None else ()
        return Snapshot(self.pool.events.last_seq, block_size, hash_seed, tuple(self.pool.cached), tiers)

    def _admit(self, now: float) -> None:
        pool = self.pool
        if len(self.waiting) > 1 and (len(self.waiting) != self._ordered_len or now > self._order_valid_until):
            self._order(now)
        # blocks running prefills are computing: a waiting sequence whose next block is one of them waits to hit it
        # (those behind it may go first), as the engine's scheduler does (engine/scheduler.py)
        computing = {h for r in self.running if r.computed < r.prompt for h in r.hashes[r.registered:]}
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            s = self.waiting[i]
            hits: list[KVCacheBlock] = []
            for h in s.hashes:
                b = pool.get_cached_block(h, (h,))
                if b is None:
                    break
                hits.append(b)
            if not s.prefilled and len(hits) < len(s.hashes) and s.hashes[len(hits)] in computing:
                i += 1
                continue
            new = self._blocks_needed(s) - len(hits)
            if new + sum(1 for b in hits if b.ref_cnt == 0) > pool.num_free_blocks:
                break  # head of line waits for blocks to free
            del self.waiting[i]
            pool.touch(hits)
            reload = self._reload(s.hashes[len(hits):])  # before allocating: its evictions may fill the tier
            s.blocks = hits + pool.get_new_blocks(new)
            if reload:
                parent = s.hashes[len(hits) - 1] if hits else None
                pool.cache_blocks(s.blocks[len(hits):len(hits) + len(reload)], reload, [(h,) for h in reload],
                                  parent)
            s.hit_blocks = s.registered = len(hits) + len(reload)
            s.reloaded_blocks = len(reload)
            s.computed = s.prompt if s.prefilled else s.registered * self.block_size
            self.running.append(s)
            if s.computed < s.prompt:
                computing.update(s.hashes[s.registered:])
        self._ordered_len = len(self.waiting)

    def _order(self, now: float) -> None:
        """The waiting queue earliest due first (when some has a TTFT target). The order holds until a sequence
        joins the queue (only admission, which keeps it, removes one) or a live target passes: `_admit` sorts again
        only then, so a long queue is not sorted at every step."""
        timed = [s.arrival + s.ttft_target for s in self.waiting if s.ttft_target is not None]
        if timed:
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.due(now)))
        self._order_valid_until = min((t for t in timed if t >= now), default=math.inf)

    def _reload(self, hashes: tuple[int, ...]) -> list[int]:
        """The leading run of `hashes` the tier holds; their reload time goes to the next step."""
        if self.tier is None or self.tier_spec is None:
            return []
        taken = self.tier.take(hashes)
        if taken:
            self.reload_s += self.tier_spec.link.seconds(len(taken) * self.block_size)
            self.reloaded_blocks += len(taken)
        return taken

    def _register(self, s: SimSeq) -> None:
        full = min(s.computed // self.block_size, len(s.hashes))
        if full <= s.registered:
            return
        hs = s.hashes[s.registered:full]
        self.pool.cache_blocks(s.blocks[s.registered:full], list(hs), [(h,) for h in hs],
                               s.hashes[s.registered - 1] if s.registered else None)
        s.registered = full


def _leading(pool: BlockPool, hashes: tuple[int, ...]) -> int:
    """How many of the leading blocks of `hashes` the pool holds."""
    n = 0
    for h in hashes:
        if pool.get_cached_block(h, (h,)) is None:
            break
        n += 1
    return n
