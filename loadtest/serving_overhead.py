"""What serving costs: time per output token through HTTP against the bare decode step and the same work offline.

    python -m loadtest.serving_overhead                         # c=16 and 64; core process and core thread
    python -m loadtest.serving_overhead --concurrency 16 --cores process

Two offline baselines, each in a process of its own, then, per engine core mode, a `kvfleet engine --engine-core
MODE` serving the seeded chat trace of `loadtest.http_bench` at the same concurrency, in --rounds rounds (a shared
machine's speed can drift by a quarter within minutes, so only figures of one round compare):

- the bare decode step (`loadtest.decode_step`, fused CPU kernels, bf16) at a batch of that concurrency: served
  TPOT p50 over it is the issue's figure (target: at most 1.15). Above 1 are the host work the server adds and
  the trace's prompts: every step of a served run also prefills the prompts of the requests that replace the
  finished ones (the run prints how many prompt tokens it computed per output token);
- the same work offline: the same trace, chat-templated alike, through `LLMEngine.step()` in a loop that keeps
  the same number of requests in flight (same sampling: greedy, EOS ignored, same max_tokens). Served TPOT p50
  over its TPOT p50 is what serving alone adds: HTTP, SSE, tokenizing, the core's pipes, and on a small machine
  the CPU that the server and its clients take from the core's threads.

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from kvfleet.workload import ChatRequest, generate_trace
from loadtest.http_bench import KVFLEET_CMD, percentile, print_table, run_level, turns

TARGET = 1.15


def child(module: str, *args: str, **env: str) -> list[dict]:
    """Run `python -m module args` in a process of its own; the JSON list its last line prints."""
    out = subprocess.run([sys.executable, "-m", module, *args], env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def offline_steps(batches: list[int], context: int, steps: int) -> dict[int, float]:
    rows = child("loadtest.decode_step", "--child", "--batch-sizes", ",".join(map(str, batches)), "--steps",
                 str(steps), "--context", str(context), KVFLEET_CPU_KERNELS="auto")
    return {r["batch"]: r["ms_per_step"] / 1e3 for r in rows}


MAX_MODEL_LEN = 2048


def chat_trace(num_requests: int, concurrency: list[int], seed: int) -> list[ChatRequest]:
    return generate_trace(max(num_requests, 2 * max(concurrency)), seed, "single", max_output_tokens=128,
                          min_output_tokens=16)


def level_trace(trace: list[ChatRequest], num_requests: int, concurrency: int) -> list[ChatRequest]:
    return trace[:max(num_requests, 2 * concurrency)]


def replays(trace: list[ChatRequest], num_requests: int, concurrency: list[int]) -> list[dict]:
    """The served run's work without the server (see the module's docstring), one engine for every level as one
    server serves them all."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import load_tokenizer

    engine = LLMEngine(EngineArgs(model="smollm2", max_model_len=MAX_MODEL_LEN))
    tok = load_tokenizer("smollm2")
    return [replay(engine, tok, level_trace(trace, num_requests, c), c) for c in concurrency]


def replay(engine, tok, trace: list[ChatRequest], concurrency: int) -> dict:
    """TPOT per request is its last token's step end minus its first's over the tokens between, as the client
    measures it from SSE chunks."""
    from engine.sampling_params import SamplingParams

    def params(max_tokens: int) -> SamplingParams:  # http_bench's request extras
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logit_bias=((2, -100.0),))

    engine.add_request("warm-up", tok.apply_chat_template(trace[0].messages), params(4))
    while engine.has_unfinished_requests():
        engine.step()
    queue = [(r.request_id, tok.apply_chat_template(r.messages), params(r.max_tokens)) for r in reversed(trace)]
    before = engine.stats()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    started = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            engine.add_request(*queue.pop())
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            n = sum(len(c.token_ids) for c in d.outputs)
            if n:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] = count.get(d.request_id, 0) + n
    wall = time.perf_counter() - started
    out = sum(count.values())
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1]
    after = engine.stats()
    computed = (after.prompt_tokens_total - before.prompt_tokens_total) \
        - (after.prefix_hits_tokens - before.prefix_hits_tokens)
    return {"concurrency": concurrency, "tpot_p50": percentile(tpots, 0.5), "out_tok_s": out / wall,
            "output_tokens": out, "prompt_per_output": computed / out}


def offline_replays(concurrency: list[int], num_requests: int, seed: int) -> dict[int, dict]:
    rows = child("loadtest.serving_overhead", "--replay-child", "--concurrency", *map(str, concurrency),
                 "--num-requests", str(num_requests), "--seed", str(seed))
    return {r["concurrency"]: r for r in rows}


async def served(cores: list[str], concurrency: list[int], num_requests: int, seed: int, extra: str) -> list:
    trace = chat_trace(num_requests, concurrency, seed)
    targets = {f"core-{m}": "http://127.0.0.1:8001" for m in cores}
    starts = {f"core-{m}": f"{KVFLEET_CMD} --max-model-len {MAX_MODEL_LEN} --engine-core {m} {extra}".strip()
              for m in cores}
    results = []
    for turn, url in turns(targets, starts, 1, 600, "serving_overhead"):
        async with turn:
            for c in concurrency:
                r = await run_level(url, "smollm2", level_trace(trace, num_requests, c), c, turn.name, 0.0, 600)
                print_table([r])
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--cores", nargs="+", choices=("process", "thread"), default=["process", "thread"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=200, help="KV tokens per sequence in the offline step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="baselines and server alternate this many times")
    ap.add_argument("--kvfleet-args", default="", help="extra flags for the served engine")
    ap.add_argument("--replay-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if min(a.concurrency) < 1 or a.num_requests < 1 or a.rounds < 1:
        ap.error("--concurrency, --num-requests and --rounds must be >= 1")
    if a.replay_child:
        print(json.dumps(replays(chat_trace(a.num_requests, a.concurrency, a.seed), a.num_requests, a.concurrency)))
        return 0
    step_ms: dict[tuple[int, int], float] = {}  # (round, concurrency) -> ms
    same_ms: dict[tuple[int, int], float] = {}
    served_ms: dict[tuple[int, str, int], float] = {}  # (round, target, concurrency) -> ms
    ok = True
    for rnd in range(a.rounds):  # the baselines and the server one after the other in every round
        print(f"--- round {rnd + 1} of {a.rounds}", flush=True)
        for b, sec in offline_steps(a.concurrency, a.context, a.steps).items():
            step_ms[rnd, b] = sec * 1e3
            print(f"offline decode step, batch {b}: {sec * 1e3:.1f} ms ({b / sec:.0f} tok/s)", flush=True)
        for c, r in offline_replays(a.concurrency, a.num_requests, a.seed).items():
            same_ms[rnd, c] = r["tpot_p50"] * 1e3
            print(f"offline, same trace at c={c}: TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms ({r['out_tok_s']:.0f} out "
                  f"tok/s, {r['prompt_per_output']:.2f} prompt tokens computed per output token)", flush=True)
        for r in asyncio.run(served(a.cores, a.concurrency, a.num_requests, a.seed, a.kvfleet_args)):
            served_ms[rnd, r.target, r.concurrency] = r.tpot_p50 * 1e3
            ok &= r.failed == 0
    print(f"\nserved TPOT p50 over the offline step at the same batch (target <= {TARGET}), and over the same "
          f"trace offline (what serving adds); per round, then pooled (sums over rounds)")
    rounds = range(a.rounds)
    for target in sorted({t for _, t, _ in served_ms}):
        for c in a.concurrency:
            mine = [served_ms[r, target, c] for r in rounds]
            per_step = " ".join(f"x{served_ms[r, target, c] / step_ms[r, c]:.2f}" for r in rounds)
            per_same = " ".join(f"x{served_ms[r, target, c] / same_ms[r, c]:.2f}" for r in rounds)
            print(f"  {target:<13} c={c:<3} TPOT p50 {' '.join(f'{m:.1f}' for m in mine)} ms   over the step {per_step} "
                  f"(pooled x{sum(mine) / sum(step_ms[r, c] for r in rounds):.2f})   over the same trace offline "
                  f"{per_same} (pooled x{sum(mine) / sum(same_ms[r, c] for r in rounds):.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
