"""Served steps carry decodes and a prompt: their projections through the 4-bit kernel against oneDNN bf16.

    python -m loadtest.mixed_step                       # 64 decodes + prompts of 65, 130, 200 and 400 tokens
    python -m loadtest.mixed_step --batch 16 --prompts 16,64,240 --repeats 20

One engine (the bundled model, bf16, fused CPU kernels) holds --batch sequences decoding over --context tokens
of KV each; every timed step also prefills one new prompt of P random tokens (which then ends, max_tokens 1).
For each prompt length the two paths alternate step by step, `Q4Linear.max_rows` switched between unlimited
(every row through q4_linear) and 0 (every row through its oneDNN weight), so both meet the same machine state;
medians and their ratio are printed. This is how `Q4_AVX512_MAX_ROWS` (engine/model/cpu_linear.py) was chosen
for CPUs with AVX-512 BF16 and no AMX; on AMX every step takes the 4-bit kernel anyway. Nothing else should run
on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

MAX_MODEL_LEN = 2048


PATHS: dict[str, int | None] = {"q4_linear": None, "oneDNN bf16": 0}  # Q4Linear.max_rows: None = no limit, 0 = all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="decoding sequences in every step")
    ap.add_argument("--context", type=int, default=150, help="prompt tokens of each decoding sequence")
    ap.add_argument("--prompts", default="65,130,200,400", help="comma-separated prompt lengths, one per timed step")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per path and prompt length")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        prompts = [int(x) for x in a.prompts.split(",")]
    except ValueError:
        ap.error(f"--prompts must be comma-separated integers, got {a.prompts!r}")
    if min(prompts) < 1 or a.batch < 1 or a.context < 1 or a.repeats < 1:
        ap.error("--prompts, --batch, --context and --repeats must be >= 1")
    steps = len(prompts) * len(PATHS) * 2 * (a.repeats + 1)
    if a.context + steps + 16 > MAX_MODEL_LEN:
        ap.error(f"--context {a.context} leaves too little room for {steps} steps in {MAX_MODEL_LEN} tokens")

    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.model.cpu_linear import Q4Linear
    from engine.sampling_params import SamplingParams
    from loadtest.decode_step import until_decoding

    engine = LLMEngine(EngineArgs(model="smollm2", dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=a.batch + 1, max_num_batched_tokens=max(2048, a.batch + max(prompts))))
    q4 = [m for m in engine.runner.model.modules() if isinstance(m, Q4Linear)]
    if not q4:
        print("no 4-bit projections on this machine (no AVX-512 BF16, or KVFLEET_QUANT_KERNELS=off): nothing to compare")
        return 1
    rng = random.Random(a.seed)
    decode = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0)
    for i in range(a.batch):
        engine.add_request(f"d{i}", [rng.randrange(1000, 40000) for _ in range(a.context)], decode)
    until_decoding(engine)
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(a.repeats + 1):  # the first round warms both paths' shapes up, untimed
        for p in prompts:
            for name, max_rows in PATHS.items():
                for m in q4:
                    m.max_rows = max_rows
                engine.add_request(f"p{p}-{rep}-{name}", [rng.randrange(1000, 40000) for _ in range(p)],
                                   SamplingParams(max_tokens=1, temperature=0))
                t = time.perf_counter()
                engine.step()
                if rep:
                    times.setdefault((p, name), []).append(time.perf_counter() - t)
                engine.step()  # the prompt's request ends here
    print(f"{a.batch} decodes over {a.context} tokens of KV each, plus one prompt per step; medians of {a.repeats}")
    print(f"{'prompt':>6} {'rows':>5} {'q4_linear ms':>13} {'oneDNN bf16 ms':>15} {'oneDNN / q4':>12}")
    for p in prompts:
        q, d = (statistics.median(times[p, n]) * 1e3 for n in PATHS)
        print(f"{p:>6} {a.batch + p:>5} {q:>13.1f} {d:>15.1f} {d / q:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
