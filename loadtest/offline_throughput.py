"""Offline throughput: kvfleet's continuous batching vs Hugging Face `generate` with static batches.

Both run the same seeded chat-like trace (kvfleet.workload, mode "single": log-normal prompt lengths
around 60 tokens, outputs of 16-128 tokens, EOS suppressed so every request produces exactly its
length). HF runs it in static batches of --hf-batch (left-padded, contiguous KV, every batch runs until
its longest request is done); kvfleet gets every request at once. Prints output tokens/s of each and
the ratio, kvfleet's tokens/s at several concurrency limits, and the achieved fraction of this CPU's
measured matmul FLOP/s (the compute limit for a model this small).

    python -m loadtest.offline_throughput --num-requests 64 --dtype auto
    python -m loadtest.offline_throughput --num-requests 8 --batch-sizes 1,4 --hf-batch 4   # smoke run
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as engine/__init__.py sets it, for both sides (before torch loads)

import torch  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.model.loader import load_model, resolve_dtype  # noqa: E402
from engine.model.registry import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kvfleet.workload import generate_trace  # noqa: E402


def build_trace(tokenizer, n: int, seed: int, prompt_mean: float, min_out: int, max_out: int
                ) -> list[tuple[list[int], int]]:
    """Chat-templated prompts whose token lengths (template included) are log-normal around prompt_mean."""
    overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}]))
    reqs = generate_trace(n, seed=seed, mode="single", mean_prompt_tokens=max(8.0, prompt_mean - overhead),
                          min_output_tokens=min_out, max_output_tokens=max_out)
    return [(tokenizer.apply_chat_template(list(r.messages)), r.max_tokens) for r in reqs]


def model_flops_per_token(cfg, context: float) -> float:
    """2 x (weights touched per token, lm_head included) + attention score/value work at `context`."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    return 2 * weights + 4 * cfg.num_layers * q * context


def measure_matmul_flops(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


def run_kvfleet(llm: LLM, trace) -> tuple[float, int, int]:
    """(seconds, output tokens, prompt tokens) for the whole trace."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in trace]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in trace], params)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), sum(len(p) for p, _ in trace)


def run_hf(source, dtype: torch.dtype, trace, batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    pad = 2
    useful = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(trace), batch):
            chunk = trace[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            cfg = GenerationConfig(max_new_tokens=max(n for _, n in chunk), min_new_tokens=max(n for _, n in chunk),
                                   do_sample=False, eos_token_id=None, pad_token_id=pad)
            hf.generate(ids, attention_mask=mask, generation_config=cfg)
            useful += sum(n for _, n in chunk)  # tokens the requests asked for; the rest is static-batch waste
    return time.perf_counter() - t, useful


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-mean", type=float, default=60, help="mean prompt tokens, chat template included")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16, help="HF static batch size")
    ap.add_argument("--batch-sizes", default="1,8,32,64", help="kvfleet concurrency limits to measure")
    ap.add_argument("--requests-per-batch-size", type=int, default=2,
                    help="requests run at each concurrency limit B: B x this (capped by --num-requests)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="kvfleet's concurrency for the HF comparison")
    ap.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    source = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, "cpu")
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    loaded = load_model(source, dtype, "cpu", 4096)

    def make_llm(max_num_seqs: int) -> LLM:  # same weights, a fresh KV cache and scheduler
        return LLM(args.model, loaded_model=loaded, dtype=args.dtype, max_model_len=4096, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max(2048, max_num_seqs), kv_cache_memory=args.kv_cache_memory,
                   enable_prefix_caching=False, num_threads=args.num_threads)

    llm = make_llm(args.max_num_seqs)
    threads = torch.get_num_threads()
    trace = build_trace(llm.tokenizer, args.num_requests, args.seed, args.prompt_mean, args.min_output, args.max_output)
    prompt_lens = [len(p) for p, _ in trace]
    print(f"model {source.path}  dtype {dtype}  threads {threads}")
    print(f"trace: {len(trace)} requests, prompt tokens mean {sum(prompt_lens) / len(trace):.1f} "
          f"(min {min(prompt_lens)}, max {max(prompt_lens)}), output tokens {sum(n for _, n in trace)}")

    run_kvfleet(llm, trace[:2])  # warm-up
    dt, out_tokens, in_tokens = run_kvfleet(llm, trace)
    kv_tps = out_tokens / dt
    print(f"kvfleet (max_num_seqs {args.max_num_seqs}): {out_tokens} output tokens in {dt:.2f} s = "
          f"{kv_tps:.1f} tok/s")

    peak = measure_matmul_flops(dtype)
    cfg = llm.engine.config
    avg_ctx = sum(len(p) + n / 2 for p, n in trace) / len(trace)
    achieved = (in_tokens + out_tokens) * model_flops_per_token(cfg, avg_ctx) / dt
    print(f"matmul peak ({dtype}, 2048^3): {peak / 1e9:.1f} GFLOP/s; kvfleet achieved {achieved / 1e9:.1f} GFLOP/s "
          f"= {achieved / peak:.1%} of it")

    for b in sizes:
        sub = trace[:min(len(trace), b * args.requests_per_batch_size)]
        dt_b, out_b, _ = run_kvfleet(make_llm(b), sub)
        print(f"  batch {b:>3}: {len(sub)} requests, {out_b / dt_b:8.1f} output tok/s")

    if not args.skip_hf:
        dt_hf, useful = run_hf(source, dtype, trace, args.hf_batch)
        hf_tps = useful / dt_hf
        print(f"HF generate (static batches of {args.hf_batch}): {useful} output tokens in {dt_hf:.2f} s = "
              f"{hf_tps:.1f} tok/s")
        print(f"ratio kvfleet / HF: {kv_tps / hf_tps:.2f}x (target >= 3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
