"""Where a decode step's time goes on the CPU: inside the kernels, or on the host around them (issue 45).

For each batch size, B requests of --context random prompt tokens are prefilled in the offline engine as
`kvfleet serve` builds it (default flags: the bundled model, its GGUF weights), then decode-only steps are timed
twice: once plain (wall time per step, and per phase: the scheduler, the model's forward, the sampler, the
step's bookkeeping), once under the torch profiler (the self time of every native op inside the step). The
kernels' share is the time inside compute ops (kvfleet's fused CPU kernels and ATen's matmuls, attention,
embedding, sampling reductions); the host's share is the rest of the step's wall time: Python, op dispatch,
tensor glue (views, slices, allocation, copies) and bookkeeping. Per layer: the forward's host time divided by
the model's layers.

    python -m loadtest.host_share --batch-sizes 1,16,64 --steps 40

Run it with nothing else on the machine; name the CPU beside the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import defaultdict

from loadtest.decode_step import add_batch_args, batch_sizes

# ATen ops that do the arithmetic of a step (the rest of ATen is glue: views, slices, allocation, copies)
COMPUTE_ATEN = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm", "aten::embedding", "aten::index_select", "aten::softmax", "aten::_softmax",
    "aten::log_softmax", "aten::_log_softmax", "aten::topk", "aten::sort", "aten::argmax", "aten::max",
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::silu",
    "aten::mul", "aten::add", "aten::rms_norm", "aten::exponential_", "aten::div", "aten::cumsum", "aten::gather",
    "mkldnn::_linear_pointwise", "aten::mkldnn_linear", "aten::_mkldnn_linear",
})
PHASES = ("schedule", "forward", "sample", "update")


def is_compute(name: str) -> bool:
    return name.startswith("kvfleet_cpu::") or name in COMPUTE_ATEN


def _engine(batch: int, context: int, steps: int, seed: int):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from loadtest.decode_step import until_decoding

    eng = LLMEngine(EngineArgs(max_num_seqs=max(batch, 256)))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=2 * steps + 64, ignore_eos=True, temperature=0)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(1000, 40000) for _ in range(context)], params)
    until_decoding(eng)
    return eng


def _timed_phases(eng) -> dict[str, float]:
    """Wrap the step's phases with timers (on this engine instance only); returns the running sums."""
    sums: dict[str, float] = defaultdict(float)

    def wrap(owner, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sums[phase] += time.perf_counter() - t
        setattr(owner, attr, timed)

    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.runner, "execute", "forward")
    wrap(eng, "_sample", "sample")
    wrap(eng, "_update", "update")
    return sums


def measure(batch: int, steps: int, context: int, seed: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng = _engine(batch, context, steps, seed)
    sums = _timed_phases(eng)
    for _ in range(5):
        eng.step()
    sums.clear()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t) / steps
    phases = {p: sums[p] / steps for p in PHASES}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        profiled = (time.perf_counter() - t) / steps
    compute = glue = 0.0
    top: dict[str, float] = defaultdict(float)
    ops = 0
    for ev in prof.key_averages():
        s = ev.self_cpu_time_total / 1e6 / steps
        ops += ev.count
        if is_compute(ev.key):
            compute += s
            top[ev.key] += s
        else:
            glue += s
    layers = len(getattr(eng.runner.model, "layers", None) or getattr(getattr(eng.runner.model, "model", None),
                                                                    "layers", []) or []) or None
    # the kernels' share of the profiled steps (the profiler's own overhead lands on the host side)
    share = min(compute / profiled, 1.0) if profiled > 0 else 0.0
    kernels = share * wall
    host_forward = max(phases["forward"] - kernels, 0.0)
    return {
        "batch": batch, "wall_ms": wall * 1e3, "phases_ms": {p: v * 1e3 for p, v in phases.items()},
        "other_ms": (wall - sum(phases.values())) * 1e3, "kernels_ms": kernels * 1e3, "glue_ops_ms": glue * 1e3,
        "profiled_ms": profiled * 1e3, "ops_per_step": ops / steps, "host_share": 1 - share,
        "layers": layers, "host_ms_per_layer": host_forward * 1e3 / layers if layers else None,
        "top_kernels_ms": {k: v * 1e3 for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:6]},
        "threads": torch.get_num_threads(), "backend": eng.runner.backend.name,
    }


def report(rows: list[dict]) -> str:
    lines = [f"CPU: {cpu_name()}; torch threads {rows[0]['threads'] if rows else '?'}",
             f"{'batch':>5} {'step ms':>8} {'kernels':>8} {'host':>6} {'sched':>6} {'forward':>8} {'sample':>7} "
             f"{'update':>7} {'other':>6} {'glue ops':>9} {'ops':>6} {'host/layer':>10}"]
    for r in rows:
        ph = r["phases_ms"]
        per_layer = f"{r['host_ms_per_layer']:.3f} ms" if r["host_ms_per_layer"] is not None else "-"
        lines.append(f"{r['batch']:>5} {r['wall_ms']:8.2f} {r['kernels_ms']:8.2f} {r['host_share']:6.0%} "
                     f"{ph['schedule']:6.2f} {ph['forward']:8.2f} {ph['sample']:7.2f} {ph['update']:7.2f} "
                     f"{r['other_ms']:6.2f} {r['glue_ops_ms']:9.2f} {r['ops_per_step']:6.0f} {per_layer:>10}")
    lines.append("ms per step; kernels: the compute ops' share of a profiled step (their self time) times the plain "
                 "step; host: the rest; glue ops: self time of the other ATen ops (profiled)")
    for r in rows:
        lines.append(f"batch {r['batch']} kernels: " + ", ".join(f"{k} {v:.2f}" for k, v in r["top_kernels_ms"].items()))
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    a = ap.parse_args(argv)
    sizes = batch_sizes(ap, a)
    rows = [measure(b, a.steps, a.context, a.seed) for b in sizes]
    print(report(rows))
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
