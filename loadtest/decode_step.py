"""Decode-step speed of the engine with and without the fused CPU kernels, back to back.

For each batch size, B requests with random prompts of --context tokens (default 100) are prefilled, then the
benchmark times `LLMEngine.step()` over decode-only steps, each sequence's KV cache holding about --context
tokens, and prints tokens/s and ms/step. Each mode runs in its own
process (`KVFLEET_CPU_KERNELS=auto` and `=torch`), one after the other, so they share the machine's state
as closely as two runs can; the ratio is fused / plain.

    python -m loadtest.decode_step --batch-sizes 1,16,64 --steps 40
    python -m loadtest.decode_step --batch-sizes 1 --context 3000   # one long chat stream
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """The flags of a decode-step benchmark: --batch-sizes, --steps, --context, --seed (read with batch_sizes)."""
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per sequence: its KV length when timed")
    ap.add_argument("--seed", type=int, default=0)


def batch_sizes(ap: argparse.ArgumentParser, a: argparse.Namespace) -> list[int]:
    """--batch-sizes as integers, with --steps and --context checked (each >= 1); a clear CLI error otherwise."""
    try:
        sizes = [int(x) for x in a.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated integers, got {a.batch_sizes!r}")
    if any(b < 1 for b in sizes) or a.steps < 1 or a.context < 1:
        ap.error("--batch-sizes, --steps and --context must be >= 1")
    return sizes


def until_decoding(engine) -> None:
    """Step `engine` until every request it holds is past its prompt: the next steps decode only."""
    while engine.scheduler.num_waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                              for s in engine.scheduler.running):
        engine.step()


def measure(batch: int, steps: int, context: int, seed: int) -> dict:
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    blocks = max(4096, batch * -(-(context + steps + 64) // 16))
    eng = LLMEngine(EngineArgs(model="smollm2", dtype="bfloat16", num_blocks=blocks, max_num_seqs=max(batch, 1)))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=0)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(1000, 40000) for _ in range(context)], params)
    until_decoding(eng)
    for _ in range(5):
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t) / steps
    return {"batch": batch, "ms_per_step": dt * 1e3, "tok_s": batch / dt, "backend": eng.runner.backend.name}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = batch_sizes(ap, a)
    if a.child:
        print(json.dumps([measure(b, a.steps, a.context, a.seed) for b in sizes]))
        return 0
    runs = {}
    for mode in ("auto", "torch"):
        env = {**os.environ, "KVFLEET_CPU_KERNELS": mode, "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-m", "loadtest.decode_step", "--child", "--batch-sizes", a.batch_sizes,
                              "--steps", str(a.steps), "--context", str(a.context), "--seed", str(a.seed)],
                             env=env, capture_output=True, text=True, check=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"context {a.context} tokens per sequence, {a.steps} decode steps")
    print(f"{'batch':>5}  {'fused kernels':>24}  {'plain PyTorch':>24}  ratio")
    for f, p in zip(runs["auto"], runs["torch"], strict=True):
        print(f"{f['batch']:>5}  {f['tok_s']:9.1f} tok/s {f['ms_per_step']:7.1f} ms  "
              f"{p['tok_s']:9.1f} tok/s {p['ms_per_step']:7.1f} ms  x{f['tok_s'] / p['tok_s']:.2f}"
              f"{'' if f['backend'] == 'cpu' else '  (fused kernels unavailable: ' + f['backend'] + ' backend)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
