"""Output tokens/s with LoRA adapters against the base model alone, same trace, one engine (offline, in process).

    python -m loadtest.lora_bench [--dtype bfloat16] [--adapters 8] [--rank 16] [--targets all|qv]
                                  [--concurrency 16] [--tokens 64] [--rounds 3]

The trace: `concurrency` prompts (distinct, ~40 tokens) decoded together for `tokens` greedy tokens each; run
three times on one engine with LoRA enabled (--max-loras = adapters, every adapter read and in a slot before
the timed runs): all on the base model, on `adapters` adapters drawn uniformly, and drawn by zipf popularity
(s = 1.1); `rounds` times, alternating. Adapters are random, rank `rank`, on all seven projections (or q and v),
written in PEFT's format (tests/engine/lora/_adapters.py's recipe). Prints tokens/s per run, and the medians
and their ratio to the base model (the issue's target on CPU: >= 0.8x).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.lora_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3, help="times each mix runs, alternating (medians reported)")
    p.add_argument("--targets", default="all", choices=("all", "qv"),
                   help="the adapters' target modules: all seven projections, or q_proj and v_proj (PEFT's default)")
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from engine import SamplingParams
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from tests.engine.lora._adapters import write_adapter

    targets = (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") if ns.targets == "all"
               else ("q_proj", "v_proj"))
    root = tempfile.mkdtemp(prefix="lora-bench-")
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(root, f"a{i}"), ns.rank, targets, seed=i))
             for i in range(ns.adapters)]
    llm = LLM(ns.model, dtype=ns.dtype, attention_backend=ns.attention_backend, max_model_len=1024,
              max_num_seqs=max(ns.concurrency, 16), seed=0, num_threads=ns.threads, enable_lora=True,
              max_loras=ns.adapters, max_lora_rank=ns.rank)
    prompts = [llm.tokenizer.encode(f"Request {i}: write a short story about a {w} lighthouse keeper and the sea.")
               for i, w in enumerate(random.Random(0).choices(["brave", "old", "tired", "young", "curious"],
                                                               k=ns.concurrency))]
    rng = random.Random(1)
    zipf = [1 / (k + 1) ** 1.1 for k in range(ns.adapters)]
    mixes = {"base": [None] * ns.concurrency,
             "uniform": [loras[i % ns.adapters] for i in range(ns.concurrency)],
             "zipf": rng.choices(loras, zipf, k=ns.concurrency)}
    # warm: every adapter read and in a slot (--max-loras = adapters: the steady state of a replica serving them)
    llm.generate(prompts[:ns.adapters], [SamplingParams(max_tokens=4, temperature=0.0, lora=lora) for lora in loras])
    rates: dict[str, list[float]] = {name: [] for name in mixes}
    for rnd in range(ns.rounds):  # the mixes alternate, so a slow spell of the machine hits each of them
        for name, mix in mixes.items():
            params = [SamplingParams(max_tokens=ns.tokens, temperature=0.0, ignore_eos=True, lora=lora) for lora in mix]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(n / dt)
            print(f"round {rnd + 1} {name:8s} {n} tokens in {dt:.2f} s = {n / dt:.1f} tokens/s", flush=True)
    base = statistics.median(rates["base"])
    for name, mix in mixes.items():
        used = len({x.name for x in mix if x})
        rate = statistics.median(rates[name])
        print(f"{name:8s} {used:2d} adapters  median {rate:.1f} tokens/s  ({rate / base:.2f}x the base model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
