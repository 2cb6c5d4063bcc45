"""The CPU kernels on cold data, as a decode step meets them: every layer's weights and KV blocks are
read from memory, not from a cache that a repeated call keeps warm.

    python -m loadtest.cpu_kernels_bench projections --rows 1,16,64,128,256
    python -m loadtest.cpu_kernels_bench attention --batch 64 --context 125
    python -m loadtest.cpu_kernels_bench --threads 2 projections   # torch threads
    python -m loadtest.cpu_kernels_bench lora --rows-per-slot 1,2,4,16,64 --adapters 8 --rank 16

`projections`: one step's projections of a Llama-shaped model (SmolLM2-135M by default: 30 layers of
qkv, o, gate/up and down) with exact 4-bit group weights, through `q4_linear` (packed 4-bit: AMX tiles, or
AVX-512 BF16 dot products on CPUs without AMX) and
through oneDNN on the same weights in bf16 (what the engine uses otherwise), alternating per row count;
the median of --rounds is printed with the ratio. `attention`: `paged_decode_` over --layers separate KV
caches with shuffled blocks; achieved GB/s of K/V read and the fraction of this machine's read bandwidth
(a sum over a 1 GiB tensor on the same threads). `lora`: one step's LoRA products (every projection of every
layer, --adapters slots of --rank on every part, each row under one slot) through the fused kernel and through
the torch paths (masked over every slot for steps of up to 32 rows, per slot otherwise), ms per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.kernels import cpu_ops


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def q4_layer_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half()
    return q, s, m


def bench_projections(a: argparse.Namespace) -> int:
    from engine.model.quantized import dequant_reference, pack_q4

    ops = cpu_ops.ops()
    path = ops.quant_path()
    if path == "portable":
        print("q4_linear runs its portable loops here (neither AMX nor AVX-512 BF16): nothing to compare",
              file=sys.stderr)
        return 1
    h, inter = a.hidden, a.intermediate
    qkv = h + 2 * a.kv_dim
    shapes = [(qkv, h), (h, h), (2 * inter, h), (h, inter)]
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layer = []
        for n, k in shapes:
            q, s, m = q4_layer_weights(n, k, gen)
            bf16 = dequant_reference(q, s, m).to(torch.bfloat16)
            layer.append((pack_q4(q, s, m), torch.ops.mkldnn._reorder_linear_weight(bf16, 64)))
        layers.append(layer)
    q4_bytes = sum(qw.numel() + sc.numel() * 2 for layer in layers for (qw, sc), _ in layer)
    print(f"{a.layers} layers, hidden {h}, intermediate {inter}: {q4_bytes / 2**20:.0f} MiB packed 4-bit vs "
          f"{sum(n * k for n, k in shapes) * a.layers * 2 / 2**20:.0f} MiB bf16 per step")
    print(f"q4_linear on {path}")
    print(f"{'rows':>5} {'q4_linear ms':>13} {'oneDNN bf16 ms':>15} {'ratio':>6}")
    for rows in a.rows:
        xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in shapes]

        def step(which: str, xs: list[torch.Tensor] = xs) -> float:
            t = time.perf_counter()
            for layer in layers:
                for x, ((qw, sc), packed) in zip(xs, layer, strict=True):
                    if which == "q4":
                        ops.q4_linear(x, qw, sc)
                    else:
                        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            return (time.perf_counter() - t) * 1e3

        step("q4"), step("dnn")
        times: dict[str, list[float]] = {"q4": [], "dnn": []}
        for _ in range(a.rounds):
            for which in times:
                times[which].append(step(which))
        q4, dnn = statistics.median(times["q4"]), statistics.median(times["dnn"])
        print(f"{rows:>5} {q4:>13.2f} {dnn:>15.2f} {dnn / q4:>5.2f}x")
    return 0


def read_bandwidth() -> float:
    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    x.sum()
    t = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def bench_attention(a: argparse.Namespace) -> int:
    b, ctx, bs, hkv, d = a.batch, a.context, a.block_size, a.kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = (ctx + bs - 1) // bs
    caches = [(torch.randn(b * blocks_per_seq, bs, hkv, d, generator=gen).to(torch.bfloat16),
               torch.randn(b * blocks_per_seq, bs, hkv, d, generator=gen).to(torch.bfloat16)) for _ in range(a.layers)]
    tables = torch.randperm(b * blocks_per_seq, generator=gen).to(torch.int32).view(b, blocks_per_seq).contiguous()
    lens = torch.full((b,), ctx, dtype=torch.int32)
    q = torch.randn(b, hkv * a.group, d, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    paged_decode_ = cpu_ops.ops().paged_decode_

    def step() -> float:
        t = time.perf_counter()
        for k, v in caches:
            paged_decode_(out, q, k, v, tables, lens, d ** -0.5)
        return (time.perf_counter() - t) / len(caches)

    step()
    per_layer = statistics.median(step() for _ in range(a.rounds))
    kv_bytes = b * ctx * hkv * d * 2 * 2
    bw = read_bandwidth()
    print(f"batch {b}, context {ctx}, {hkv} kv heads x {a.group} queries, head_dim {d}, block {bs}, {a.layers} layers")
    print(f"paged_decode_: {per_layer * 1e6:.0f} us per layer, K/V read at {kv_bytes / per_layer / 1e9:.1f} GB/s "
          f"= {kv_bytes / per_layer / 1e9 / bw:.0%} of the measured read bandwidth ({bw:.1f} GB/s)")
    return 0


class _Zeros(torch.nn.Module):
    """A projection whose output is zeros: the LoRA wrapper's own cost, without the base matmul."""

    def __init__(self, out: int):
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.out)


def bench_lora(a: argparse.Namespace) -> int:
    from engine.lora import layers

    h, inter, kv = a.hidden, a.intermediate, a.kv_dim
    shapes = [(h, [h, kv, kv]), (h, [h]), (h, [inter, inter]), (inter, [h])]  # qkv, o, gate|up, down
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    paths = {"fused": (True, 10**9), "torch": (False, 0)}  # (fused kernel on, FUSED_MAX_SLOT_ROWS)
    print(f"{a.layers} layers x 4 projections, {a.adapters} slots of rank {a.rank} on every part, bf16; "
          f"ms per step for the LoRA products alone")
    print(f"{'rows/slot':>9} {'rows':>5} {'fused ms':>9} {'torch ms':>9} {'ratio':>6}")
    for per_slot in a.rows_per_slot:
        row_slots = [s for s in range(a.adapters) for _ in range(per_slot)]
        times: dict[str, list[float]] = {name: [] for name in paths}
        built = {}
        for name, (fused, max_rows) in paths.items():  # weights per path and layer: read from memory, as in a step
            batch = layers.LoRABatch()
            batch.cpu_kernel = fused
            wrappers = []
            for _ in range(a.layers):
                for fan_in, sizes in shapes:
                    w = layers.LoRALinear(_Zeros(sum(sizes)), batch, sizes, fan_in, a.adapters, a.rank, dt,
                                          torch.device("cpu"))
                    for slot in range(a.adapters):
                        w.set_slot(slot, [((torch.randn(a.rank, fan_in, generator=gen) * 0.05).to(dt),
                                           (torch.randn(n, a.rank, generator=gen) * 0.05).to(dt)) for n in sizes])
                    wrappers.append((fan_in, w))
            built[name] = (batch, wrappers, max_rows)
        xs = {fan_in: torch.randn(len(row_slots), fan_in, generator=gen).to(dt) for fan_in in (h, inter)}
        for _ in range(a.rounds):
            for name, (batch, wrappers, max_rows) in built.items():
                layers.FUSED_MAX_SLOT_ROWS = max_rows
                batch.set(row_slots, torch.device("cpu"))
                with torch.no_grad():
                    t0 = time.perf_counter()
                    for fan_in, w in wrappers:
                        w(xs[fan_in])
                    times[name].append(time.perf_counter() - t0)
        fused_ms, torch_ms = (statistics.median(times[n]) * 1e3 for n in ("fused", "torch"))
        print(f"{per_slot:>9} {len(row_slots):>5} {fused_ms:>9.2f} {torch_ms:>9.2f} {torch_ms / fused_ms:>5.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("projections", help="q4_linear vs oneDNN bf16 over one step's projections")
    p.add_argument("--rows", type=int_list, default=[1, 16, 64, 128, 256], help="comma-separated row counts")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv-dim", type=int, default=192, help="kv heads x head_dim")
    p.add_argument("--rounds", type=int, default=5)
    p = sub.add_parser("lora", help="the fused LoRA kernel vs the torch paths over one step's projections")
    p.add_argument("--rows-per-slot", type=int_list, default=[1, 2, 4, 16, 64], help="comma-separated")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv-dim", type=int, default=192, help="kv heads x head_dim")
    p.add_argument("--rounds", type=int, default=5)
    p = sub.add_parser("attention", help="paged_decode_ on cold KV blocks")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=125)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    sizes = {k: v for k, v in vars(a).items() if k in ("layers", "hidden", "intermediate", "kv_dim", "rounds", "batch",
                                                          "context", "kv_heads", "group", "head_dim", "block_size",
                                                          "threads", "adapters", "rank") and v is not None}
    bad = [k for k, v in sizes.items() if v < 1]
    if bad:
        ap.error(f"--{bad[0].replace('_', '-')} must be >= 1")
    if a.what == "projections" and (a.hidden % 32 or a.intermediate % 32 or a.kv_dim % 16):
        ap.error("--hidden and --intermediate must be multiples of 32 and --kv-dim of 16 (4-bit groups of 32)")
    if not cpu_ops.load():
        print(f"the CPU kernels are unavailable: {cpu_ops.unavailable_reason()}", file=sys.stderr)
        return 1
    if a.threads:
        torch.set_num_threads(a.threads)
    return {"projections": bench_projections, "attention": bench_attention, "lora": bench_lora}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
