"""The engine on a random-weight model of a real shape: offline throughput per batch size, with and without
CUDA graphs, greedy tokens compared between the two, and per decode step the host time next to GPU time.

For each batch size B, B requests of --prompt-len random token ids each generate --output-len tokens
(greedy, EOS ignored), all submitted at once. Per decode step it records the host time spent in the model
runner (building inputs and launching; the GPU runs behind it), the GPU time of the same span (CUDA
events) and the whole engine step's wall time. Start-up (kernel compilation, graph capture) is reported
separately as load time.

    python -m loadtest.gpu_engine_bench --shape llama3-8b --batches 1,16,64,256 --json out.json
    TRITON_INTERPRET=1 python -m loadtest.gpu_engine_bench --shape tiny --device cpu --batches 1,4 \\
        --prompt-len 16 --output-len 4     # CPU smoke run of the code path (not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    from loadtest.synthetic_model import SHAPES

    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=ints, default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--modes", default=None, help="comma-separated of eager,graphs (default: both on CUDA, eager on CPU)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} ms"


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class StepTimer:
    """Wraps the runner's execute and the engine's step: host ms, GPU ms (CUDA events), step wall ms."""

    def __init__(self, llm, cuda: bool):
        self.cuda, self.host, self.wall, self.events = cuda, [], [], []
        runner, engine = llm.engine.runner, llm.engine
        execute, step = runner.execute, engine.step

        def timed_execute(scheduled, blocks_to_copy=()):
            decode = bool(scheduled) and all(s.num_new_tokens == 1 for s in scheduled)
            if decode and cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            out = execute(scheduled, blocks_to_copy)
            if decode:
                self.host.append((time.perf_counter() - t) * 1e3)
                if cuda:
                    end.record()
                    self.events.append((start, end))
            return out

        def timed_step():
            t = time.perf_counter()
            out = step()
            self.wall.append((time.perf_counter() - t) * 1e3)
            return out

        runner.execute, engine.step = timed_execute, timed_step

    def reset(self) -> None:
        self.host, self.wall, self.events = [], [], []

    def summary(self) -> dict:
        gpu = [s.elapsed_time(e) for s, e in self.events] if self.cuda else []
        return {"decode_steps": len(self.host), "decode_host_ms_median": median(self.host),
                "decode_gpu_ms_median": median(gpu), "engine_step_wall_ms_median": median(self.wall)}


def run_mode(args, mode: str, model_path: str, loaded, device: torch.device, reference: dict | None = None) -> dict:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cuda = device.type == "cuda"
    max_batch = max(args.batches)
    per_seq = -(-(args.prompt_len + args.output_len + 1) // 16)
    t0 = time.perf_counter()
    llm = LLM(model_path, loaded_model=loaded, device=str(device), dtype="bfloat16", attention_backend="triton",
              max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch), num_blocks=max_batch * per_seq + 8,
              max_model_len=args.prompt_len + args.output_len + 16, enable_prefix_caching=False,
              cuda_graphs=mode == "graphs", num_threads=min(8, os.cpu_count() or 1))
    if cuda:
        torch.cuda.synchronize()
    res = {"mode": mode, "load_and_warmup_s": time.perf_counter() - t0,
           "graph_buckets": llm.engine.runner.graphs.buckets if llm.engine.runner.graphs else None, "batches": {}}
    timer = StepTimer(llm, cuda)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens, prompts_of = {}, {}
    vocab = llm.engine.limits.vocab_size  # the smaller of the model's and the tokenizer's
    for b in args.batches:
        prompts = prompts_of[b] = torch.randint(3, vocab, (b, args.prompt_len), generator=gen).tolist()
        timer.reset()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens[b] = [list(o.outputs[0].token_ids) for o in outs]
        n_out = sum(len(x) for x in tokens[b])
        row = {"batch": b, "seconds": dt, "output_tokens": n_out, "output_tokens_per_s": n_out / dt} | timer.summary()
        res["batches"][b] = row
        print(f"  {mode:>6} batch {b:>4}: {n_out / dt:9.1f} output tok/s; decode step host "
              f"{fmt_ms(row['decode_host_ms_median'])}, GPU {fmt_ms(row['decode_gpu_ms_median'])}, "
              f"engine step {fmt_ms(row['engine_step_wall_ms_median'])}", flush=True)
    if reference is not None:
        res["divergence"] = {str(b): divergence(llm, prompts_of[b], reference[b], tokens[b]) for b in args.batches}
    del llm, timer
    if cuda:
        torch.cuda.empty_cache()
    return res | {"tokens": tokens}


def divergence(llm, prompts: list[list[int]], ref: list[list[int]], got: list[list[int]]) -> dict:
    """Where two runs' greedy tokens part: how many sequences are identical, and for each one that is not, how
    close the two tokens chosen at the first difference were (their logprob gap, read by one more prefill of the
    prompt and the common prefix, top 20). bf16 sums in another order move logits by ~1e-2; on a random model's
    flat logits that flips near-ties, which a gap of that size shows. A wrong graph replay parts early and far."""
    from engine.sampling_params import SamplingParams

    parted = [(i, next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))))
              for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]
    out = {"sequences": len(ref), "identical": len(ref) - len(parted), "first_difference_at": [j for _, j in parted],
           "logprob_gaps": []}
    if not parted:
        return out
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    reqs = [{"prompt_token_ids": prompts[i] + ref[i][:j]} for i, j in parted]
    for (i, j), o in zip(parted, llm.generate(reqs, params), strict=True):
        if j >= min(len(ref[i]), len(got[i])):  # one run stopped earlier: no token to compare
            out["logprob_gaps"].append(None)
            continue
        top = dict(o.outputs[0].logprobs[0].top)
        a, b = ref[i][j], got[i][j]
        out["logprob_gaps"].append(abs(top[a] - top[b]) if a in top and b in top else None)  # None: not in top 20
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from loadtest.synthetic_model import SHAPES, build, model_dir

    shape = SHAPES[args.shape]
    modes = args.modes.split(",") if args.modes else (["eager", "graphs"] if device.type == "cuda" else ["eager"])
    layers = args.layers or shape.layers
    max_len = args.prompt_len + args.output_len + 16
    t0 = time.perf_counter()
    loaded = build(shape, device, torch.bfloat16, layers, max_len)
    build_s = time.perf_counter() - t0
    print(f"{shape.name}-shaped random model, {layers} layers, bf16 on {device}: built in {build_s:.1f} s", flush=True)
    result = {"shape": vars(shape), "layers": layers, "device": str(device), "build_s": build_s,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "modes": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(shape, tmp, layers, max_len)
        reference = None
        for mode in modes:
            result["modes"][mode] = run_mode(args, mode, path, loaded, device, reference)
            reference = reference or result["modes"][mode]["tokens"]
            write(args.json, result)
    if len(modes) == 2:
        a, b = (result["modes"][m].pop("tokens") for m in modes)
        result["greedy_equal"] = {str(k): a[k] == b[k] for k in a}
        result["greedy_equal_all"] = all(result["greedy_equal"].values())
        result["divergence"] = result["modes"][modes[1]].pop("divergence")
        print(f"greedy tokens equal between {modes[0]} and {modes[1]}: {result['greedy_equal']}", flush=True)
        for k, d in result["divergence"].items():
            if d["identical"] < d["sequences"]:
                print(f"  batch {k}: {d['identical']}/{d['sequences']} sequences identical; first differences at "
                      f"tokens {d['first_difference_at']}; logprob gaps there {d['logprob_gaps']}", flush=True)
    else:
        for m in modes:
            result["modes"][m].pop("tokens")
    write(args.json, result)
    return 0


def write(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        clean = json.loads(json.dumps(result, default=str))
        for m in clean.get("modes", {}).values():
            m.pop("tokens", None)
        with open(path + ".tmp", "w") as f:
            json.dump(clean, f, indent=2)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
