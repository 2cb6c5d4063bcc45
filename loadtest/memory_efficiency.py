"""How much of the KV memory a paged cache really fills, against contiguous per-request reservation.

A seeded chat trace (prompt and output lengths log-normal, ShareGPT-like means by default) runs
through the real scheduler and KV cache manager with a fake model (pure Python, no tensors; the
prefix cache is off so only paging is measured). After every step we count the slots that hold a
token's K/V against the slots allocated. Reported, per block size:

- the fraction of allocated slots holding tokens at peak KV usage (and its mean over the run);
- the same running batch reserved contiguously: max_model_len per request (the pre-paging
  systems) and prompt + max_tokens per request;
- how many sequences run concurrently in the same fixed pool, paged vs contiguous max_model_len.

Target (issue 2, after the vLLM paper's < 4% waste): >= 96% of allocated slots used with block 16.

    python -m loadtest.memory_efficiency --requests 1000 --pool-tokens 65536
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from kvfleet.workload import lognormal_length

TARGET = 0.96


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int  # tokens actually generated (<= max_tokens)
    max_tokens: int


@dataclass
class RunResult:
    block_size: int
    peak_used_blocks: int = 0
    used_at_peak: float = 0.0  # slots holding tokens / slots allocated, mean over steps at peak KV usage
    min_used_at_peak: float = 1.0  # the worst such step
    peak_steps: int = 0
    mean_used: float = 0.0  # over every step
    max_model_len_used_at_peak: float = 0.0  # same batch, max_model_len reserved per sequence
    exact_reserve_used_at_peak: float = 0.0  # same batch, prompt + max_tokens reserved per sequence
    peak_running: int = 0
    running_at_peak: float = 0.0  # mean running sequences over the steps at peak KV usage
    mean_running: float = 0.0
    steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0


def make_trace(n: int, seed: int, prompt_mean: float, output_mean: float, sigma: float,
               max_tokens: int, max_model_len: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = lognormal_length(rng, prompt_mean, sigma, 1, max_model_len - max_tokens)
        output = lognormal_length(rng, output_mean, sigma, 1, max_tokens)
        out.append(TraceRequest(prompt, output, max_tokens))
    return out


def simulate(trace: list[TraceRequest], block_size: int, pool_tokens: int, max_model_len: int,
             max_num_seqs: int, budget: int) -> RunResult:
    kv = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=pool_tokens // block_size,
                                    enable_prefix_caching=False))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len), kv)
    rng = random.Random(1)
    want: dict[int, TraceRequest] = {}
    for i, req in enumerate(trace):
        seq = Sequence(f"r{i}", [rng.randrange(32000) for _ in range(req.prompt_len)],
                       SamplingParams(max_tokens=req.max_tokens))
        want[seq.seq_id] = req
        sched.add(seq)
    res = RunResult(block_size)
    used_sum = running_sum = 0.0
    at_peak: list[float] = []
    running_at_peak: list[int] = []
    t0 = time.perf_counter()
    while sched.has_unfinished():
        out = sched.schedule()
        sched.on_step_done(out)
        running = sched.running
        tokens = sum(s.num_computed_tokens for s in running)
        used_blocks = kv.pool.num_used_blocks
        if used_blocks:
            frac = tokens / (used_blocks * block_size)
            used_sum += frac
            running_sum += len(running)
            res.steps += 1
            if used_blocks > res.peak_used_blocks:
                res.peak_used_blocks = used_blocks
                at_peak, running_at_peak = [], []
                res.max_model_len_used_at_peak = tokens / (len(running) * max_model_len)
                res.exact_reserve_used_at_peak = tokens / sum(s.num_prompt_tokens + want[s.seq_id].max_tokens
                                                              for s in running)
            if used_blocks == res.peak_used_blocks:
                at_peak.append(frac)
                running_at_peak.append(len(running))
        res.peak_running = max(res.peak_running, len(running))
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(7)
                if seq.num_output_tokens >= want[seq.seq_id].output_len:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    res.seconds = time.perf_counter() - t0
    res.used_at_peak = sum(at_peak) / max(1, len(at_peak))
    res.min_used_at_peak = min(at_peak, default=0.0)
    res.peak_steps = len(at_peak)
    res.running_at_peak = sum(running_at_peak) / max(1, len(running_at_peak))
    res.mean_used = used_sum / max(1, res.steps)
    res.mean_running = running_sum / max(1, res.steps)
    res.preemptions = sched.num_preemptions
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="memory_efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="number of requests in the trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-mean", type=float, default=161.0, help="mean prompt tokens (ShareGPT: 161)")
    p.add_argument("--output-mean", type=float, default=338.0, help="mean output tokens (ShareGPT: 338)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of every request")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--pool-tokens", type=int, default=65536, help="KV pool size in token slots")
    p.add_argument("--block-sizes", default="8,16,32")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    a = p.parse_args(argv)
    for name in ("requests", "pool_tokens", "max_model_len", "max_tokens", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_tokens >= a.max_model_len:
        p.error("--max-tokens must be below --max-model-len")
    try:
        a.block_sizes = [int(b) for b in a.block_sizes.split(",")]
    except ValueError:
        p.error(f"--block-sizes must be comma-separated integers, got {a.block_sizes!r}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    trace = make_trace(a.requests, a.seed, a.prompt_mean, a.output_mean, a.sigma, a.max_tokens, a.max_model_len)
    mean_p = sum(r.prompt_len for r in trace) / len(trace)
    mean_o = sum(r.output_len for r in trace) / len(trace)
    print(f"trace: {len(trace)} requests, seed {a.seed}, log-normal sigma {a.sigma}: prompt mean {mean_p:.0f} "
          f"tokens, output mean {mean_o:.0f} tokens; max_tokens {a.max_tokens}, max_model_len {a.max_model_len}")
    print(f"pool: {a.pool_tokens} KV slots; contiguous max_model_len reservation fits "
          f"{a.pool_tokens // a.max_model_len} sequences")
    print()
    print("slots used = KV slots holding a token / slots allocated; '@peak' = mean over the steps at peak")
    print("KV usage (their count in 'peak steps'), 'worst' = the lowest such step, 'all steps' = mean of all")
    print(f"{'layout':<34}{'used @peak':>11}{'worst':>8}{'all steps':>10}{'peak steps':>11}{'peak seqs':>10}"
          f"{'mean seqs':>10}{'preempt':>8}{'sim s':>7}")
    results = {}
    for bs in a.block_sizes:
        r = simulate(trace, bs, a.pool_tokens, a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens)
        results[bs] = r
        print(f"{f'paged, block {bs}':<34}{r.used_at_peak:>11.2%}{r.min_used_at_peak:>8.2%}{r.mean_used:>10.2%}"
              f"{r.peak_steps:>11}{r.peak_running:>10}{r.mean_running:>10.1f}{r.preemptions:>8}{r.seconds:>7.2f}")
    ref = results.get(16) or next(iter(results.values()))
    contiguous = a.pool_tokens // a.max_model_len
    print(f"contiguous, the block-{ref.block_size} run's first peak batch reserved instead: "
          f"max_model_len each {ref.max_model_len_used_at_peak:.1%} used, prompt + max_tokens each "
          f"{ref.exact_reserve_used_at_peak:.1%} used")
    print()
    if 16 in results:
        r = results[16]
        verdict = "PASS" if r.used_at_peak >= TARGET else "FAIL"
        print(f"target: block 16 uses {r.used_at_peak:.2%} of allocated slots at peak (worst step "
              f"{r.min_used_at_peak:.2%}; target >= {TARGET:.0%}, ratio {r.used_at_peak / TARGET:.3f}) -> {verdict}")
    print(f"concurrency in a full pool of {a.pool_tokens} slots: paged block {ref.block_size} ran "
          f"{ref.running_at_peak:.1f} sequences on average at peak usage (max {ref.peak_running}) vs "
          f"{contiguous} contiguous max_model_len reservations: {ref.running_at_peak / max(1, contiguous):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
