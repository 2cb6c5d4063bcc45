"""A deterministic fake engine loop around the real scheduler (used by the scheduler tests).

The fake model reads every context token back *through the block table* from a simulated paged
cache (so a wrong block, a missed copy-on-write or a stale prefix hit changes the output) and
predicts `(sum of context + completion index) % VOCAB`.
"""

from __future__ import annotations

from collections import Counter

from engine.admission import EngineLimits, admit
from engine.config import DEFAULT_MAX_STEP_MS, SchedulerConfig
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

VOCAB = 101


class FakeEngine:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_num_seqs: int = 8,
                 max_model_len: int = 256, prefix_caching: bool = True, policy: str = "fcfs", aging_s: float = 30.0,
                 max_step_ms: float = DEFAULT_MAX_STEP_MS):
        self.now = 0.0  # the scheduler's clock (priority aging); tests move it
        self.kv = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                             enable_prefix_caching=prefix_caching))
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                               max_model_len=max_model_len, policy=policy, priority_aging_s=aging_s,
                                               max_step_ms=max_step_ms),
                               self.kv, clock=lambda: self.now)
        self.bs = block_size
        self.limits = EngineLimits(VOCAB, max_model_len, max_num_seqs, block_size, num_blocks)
        self.cache: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.seqs: list[Sequence] = []  # every sequence ever seen, children included
        self.forked: set[str] = set()
        self.outputs: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int | None = 8, n: int = 1,
            cache_salt: str | None = None, priority: int = 0, fairness_id: str = "",
            tpot_target_s: float | None = None, ttft_target_s: float | None = None) -> Sequence:
        """Admit (engine/admission.py, as the engine does) and queue a request, arriving at `self.now`."""
        prompt, params = admit(prompt, SamplingParams(max_tokens=max_tokens, n=n, priority=priority,
                                                           fairness_id=fairness_id, tpot_target_s=tpot_target_s,
                                                           ttft_target_s=ttft_target_s),
                               self.limits)
        seq = Sequence(request_id, prompt, params, cache_salt, arrival_time=self.now)
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.outputs.append(out)
        self.check_output(out)
        for src, dst in out.blocks_to_copy:
            self.cache[dst] = list(self.cache[src])
        for item in out.scheduled:
            seq = item.seq
            for j in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                self.cache[seq.block_table[j // self.bs]][j % self.bs] = seq.token_ids[j]
        self.sched.on_step_done(out)
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished or seq.num_computed_tokens < seq.num_tokens:
                continue
            group = [seq]
            if seq.params.n > 1 and seq.request_id not in self.forked:
                self.forked.add(seq.request_id)
                group += self.sched.fork(seq, seq.params.n - 1)
                self.seqs.extend(group[1:])
            for s in group:
                s.append_token(self.predict(s))
                if s.num_output_tokens >= s.params.max_tokens:
                    self.sched.finish(s, SequenceStatus.FINISHED_LENGTH)
        self.check_blocks()
        return out

    def predict(self, seq: Sequence) -> int:
        context = [self.cache[seq.block_table[j // self.bs]][j % self.bs] for j in range(seq.num_tokens)]
        assert context == seq.token_ids, f"cache does not hold {seq!r}'s tokens"
        return (sum(context) + seq.index) % VOCAB

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps <= max_steps, "the scheduler made no progress"
        return steps

    def check_output(self, out: SchedulerOutput) -> None:
        cfg = self.sched.config
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled)
        for item in out.scheduled:
            seq = item.seq
            assert item.num_new_tokens >= 1 and seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens + item.num_new_tokens <= seq.num_tokens
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + item.num_new_tokens
        preempted = {id(s) for s in out.preempted}
        assert not preempted & {id(i.seq) for i in out.scheduled}
        for seq in out.preempted:
            assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING

    def check_blocks(self) -> None:
        live = self.sched.running + list(self.sched.waiting)
        holders = Counter(b for s in live for b in s.block_table)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == []
        assert self.kv.pool.num_used_blocks == len(holders)
        reserved = sum(s.params.n - 1 for s in self.sched.running
                       if s.params.n > 1 and s.request_id not in self.forked)
        assert self.sched._reserved_seats == reserved
        assert self.sched.num_running + reserved <= self.sched.config.max_num_seqs

    def outputs_by_seq(self) -> dict[tuple[str, int], list[int]]:
        return {(s.request_id, s.index): s.output_token_ids for s in self.seqs}


def test_the_fake_model_notices_a_corrupted_cache():
    eng = FakeEngine()
    eng.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    eng.step()
    seq = eng.seqs[0]
    assert seq.output_token_ids == [15]
    eng.cache[seq.block_table[0]][0] = 99
    try:
        eng.step()
    except AssertionError as e:
        assert "cache does not hold" in str(e)
    else:
        raise AssertionError("a corrupted cache went unnoticed")
