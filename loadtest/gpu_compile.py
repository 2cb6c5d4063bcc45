"""Compile every Triton kernel variant for Hopper (sm_90) and Blackwell (sm_100) without a GPU, and read what
the compiler made of each: registers, spills, shared memory, occupancy, tensor-core use.

    python -m loadtest.gpu_compile [--arch 90,100] [--json out.json] [--markdown out.md]
    python -m loadtest.gpu_compile --device      # on a GPU: the variants for the device it runs on
    python -m loadtest.gpu_compile --docs        # rewrite the table in docs/engine-internals.md

The variants are the engine's own enumeration (engine/kernels/variants.py: what ModelRunner.warm_up compiles
on CUDA), at the bundled model's shapes and at Llama-3-8B's and Qwen2.5-7B's (loadtest/synthetic_model.py:
what loadtest/gpu_check.sh and the GPU benchmarks run), in bfloat16, float16 and float32, with LoRA (rank 16)
and the backend's own KV write. Each is compiled through Triton's own argument binder (the specialization a
real launch gets) with `triton.compile(..., target=GPUTarget("cuda", arch, 32))`; then read:
registers and spills from `ptxas --verbose` on the PTX (the same ptxas and flags Triton used), registers and
shared memory again from the cubin (`cuobjdump -res-usage`), tensor-core instructions from the PTX
(mma / wgmma / tcgen05.mma) and the SASS (`cuobjdump -sass`: HMMA / HGMMA / UTC*MMA), and for every `tt.dot`
of the kernel's TTIR whether its TTGIR op runs on tensor cores. A variant fails when it does not compile,
spills, needs more shared memory than a block may have, cannot fit one block per SM, or has a 16-bit tl.dot
that did not become tensor-core instructions (float32 products are IEEE FMA by design: no TF32).

Beside the occupancy, the paged decode and prefill kernels get the time per call that bytes moved / HBM
bandwidth and FLOPs executed / tensor-core peak imply at the benchmark shapes (a lower bound to hold the
device run to). Exit status 1 when a variant fails, naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
MODELS = ("smollm2", "llama3-8b", "qwen2.5-7b")
BLOCK_SIZE = 16  # the engine's default and the benchmarks'
MAX_NUM_SEQS = 256  # the largest batch the GPU benchmarks run (EngineArgs' default is 128)
LORA_RANK = 16  # EngineArgs.max_lora_rank's default
DECODE_SHAPE = (64, 2048)  # batch, context: inside gpu_check.sh's pass-mark region (batch >= 16, context >= 2K)
PREFILL_TOKENS = 2048  # one prompt, nothing cached
CACHE_DIR = os.environ.get("KVFLEET_GPU_COMPILE_CACHE",  # ptxas/cuobjdump readings per PTX (Triton caches its own)
                           os.path.join(os.path.expanduser("~"), ".cache", "kvfleet", "gpu_compile"))


@dataclass(frozen=True)
class Device:
    name: str
    hbm_gbs: float  # HBM bandwidth, GB/s (datasheet)
    tc_tflops: float  # dense 16-bit tensor-core peak
    fp32_tflops: float  # FP32 on the CUDA cores (the IEEE float32 products)


@dataclass(frozen=True)
class Arch:
    cc: int
    sms: int
    devices: tuple[Device, ...]
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    smem_per_sm: int = 228 * 1024
    smem_per_block: int = 227 * 1024  # opt-in maximum
    smem_reserved_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


# datasheet figures (SXM parts); H100 and H200 share the sm_90 die (132 SMs), B200 has 148 SMs
ARCHS = {
    90: Arch(90, 132, (Device("H100", 3350, 989, 67), Device("H200", 4800, 989, 67))),
    100: Arch(100, 148, (Device("B200", 8000, 2250, 75),)),
}


# ---- the variants ------------------------------------------------------------------------------------------------

def model_config(name: str):
    from engine.model.llama import ModelConfig
    from loadtest.synthetic_model import SHAPES

    if name == "smollm2":  # the bundled model's own config, read from its GGUF where it is installed
        from engine.model.loader import load_hf_config
        from engine.model.registry import ModelNotFoundError, resolve_model

        try:
            return ModelConfig.from_hf(load_hf_config(resolve_model("smollm2")))
        except ModelNotFoundError:  # a GPU machine without the package: the same shape, written down
            pass

    return ModelConfig.from_hf(SHAPES[name].hf_config())


def variants_for(arch: int, models=MODELS, dtypes=DTYPES, sms: int | None = None) -> list[tuple[str, Any]]:
    """(model name, Variant) for every variant at these models and dtypes on a GPU of this architecture."""
    import torch

    from engine.kernels.variants import decode_split_counts, dedupe, engine_variants, kv_write_variants

    out = []
    for model in models:
        cfg = model_config(model)
        for dt in dtypes:
            dtype = getattr(torch, dt)
            counts = decode_split_counts(MAX_NUM_SEQS, cfg.num_kv_heads, sms or ARCHS[arch].sms)
            vs = dedupe(engine_variants(cfg, dtype, BLOCK_SIZE, counts, LORA_RANK) + kv_write_variants(cfg, dtype))
            out += [(model, v) for v in vs]
    return out


# ---- compile and inspect -------------------------------------------------------------------------------------------

def compile_variant(variant, arch: int):
    """Triton's CompiledKernel for this variant and target, its arguments specialized by Triton's own binder."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    fn = variant.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = [MockTensor.wrap_dtype(a) for a in variant.args]
    bound, spec, opts = binder(*args, **variant.meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(variant.meta), bound, spec, opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _tool(name: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    if name == "ptxas":
        return get_ptxas(arch).path
    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def ptxas_verbose(ptx: str, arch: int) -> dict:
    """Registers, spill stores/loads, stack frame and shared memory as ptxas --verbose reports them."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([_tool("ptxas", arch), "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True, check=True)
    log = res.stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "ptxas_smem": num(r"(\d+) bytes smem")}


def cubin_facts(cubin: bytes, arch: int, sass: bool) -> dict:
    """From the cubin Triton built: REG / SHARED / LOCAL (cuobjdump -res-usage) and, when `sass` (the kernel has
    a tl.dot: disassembly is most of a variant's inspection time), its tensor-core SASS instructions."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        cuobjdump = _tool("cuobjdump", arch)
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        code = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout \
            if sass else ""

    def num(key: str) -> int:
        m = re.search(key + r":(\d+)", usage)
        return int(m.group(1)) if m else -1

    return {"cubin_registers": num("REG"), "cubin_shared": num("SHARED"), "cubin_local": num("LOCAL"),
            "sass_tc": len(re.findall(r"\b(?:HMMA|HGMMA|UTC\w*MMA)\b", code)) if sass else None}


def dot_lowering(ttir: str, ttgir: str, ptx: str) -> dict:
    """tl.dots in the TTIR, and how many of them the TTGIR runs on tensor cores: a dot stays a `tt.dot` with
    a blocked (FMA) result unless it became an nvidia_mma dot (mma.sync), a warp-group dot (wgmma) or a
    tcgen05 MMA (the pipeliner may copy a dot into its prologue: counted per dot of the TTIR, not per op);
    and the tensor-core instructions in the PTX."""
    dots = len(re.findall(r"= tt\.dot ", ttir))
    mma_aliases = set(re.findall(r"^(#\w+) = #ttg\.nvidia_mma<", ttgir, re.M))
    tc_ops = len(re.findall(r"ttng\.(?:warp_group_dot|tc_gen5_mma)\b", ttgir))
    fma = 0
    for line in re.findall(r"= tt\.dot .*", ttgir):
        enc = re.search(r"-> tensor<[^,]+, (#\w+)>", line)
        if enc and enc.group(1) in mma_aliases:
            tc_ops += 1
        else:
            fma += 1
    return {"dots": dots, "tc_dots": max(0, dots - min(fma, dots)) if tc_ops else 0,
            "ptx_tc": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b", ptx))}


def occupancy(a: Arch, registers: int, shared: int, warps: int) -> dict:
    """Resident blocks per SM and the fraction of the SM's warps they fill, from registers (allocated per warp
    in units of 256), shared memory (plus 1 KB reserved per block) and threads, against the arch's limits."""
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = (a.regs_per_sm // regs_per_warp) // warps
    by_smem = a.smem_per_sm // (shared + a.smem_reserved_per_block) if shared else 1 << 30
    by_warps = a.max_warps_per_sm // warps
    blocks = min(by_regs, by_smem, by_warps, a.max_blocks_per_sm)
    limit = min(("registers", by_regs), ("shared", by_smem), ("warps", by_warps), ("blocks", a.max_blocks_per_sm),
                key=lambda t: t[1])[0]
    return {"blocks_per_sm": blocks, "occupancy": blocks * warps / a.max_warps_per_sm, "limited_by": limit}


def inspect(variant, arch: int) -> dict:
    """Compile one variant and read everything off the compiler's output (cached per PTX and tool version)."""
    k = compile_variant(variant, arch)
    ptx = k.asm["ptx"]
    key = hashlib.sha256(f"v2\0{arch}\0{_tool('ptxas', arch)}\0{ptx}".encode()).hexdigest()[:32]
    path = os.path.join(CACHE_DIR, key + ".json")
    try:
        with open(path) as f:
            facts = json.load(f)
    except (OSError, ValueError):
        has_dots = re.search(r"= tt\.dot ", k.asm["ttir"]) is not None
        facts = ptxas_verbose(ptx, arch) | cubin_facts(k.asm["cubin"], arch, sass=has_dots)
        os.makedirs(CACHE_DIR, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(facts, f)
        os.replace(path + ".tmp", path)
    warps = k.metadata.num_warps
    return facts | dot_lowering(k.asm["ttir"], k.asm["ttgir"], ptx) | {
        "shared": k.metadata.shared, "num_warps": warps, "threads": warps * 32, "num_stages": k.metadata.num_stages,
    } | occupancy(ARCHS[arch], facts["registers"], k.metadata.shared, warps)


def problems(r: dict, arch: int) -> list[str]:
    """Why a variant's compile result fails (empty: it passes)."""
    if "error" in r:
        return [f"does not compile: {r['error']}"]
    a = ARCHS[arch]
    out = []
    if r["spill_stores"] or r["spill_loads"] or r["cubin_local"] > 0:
        out.append(f"spills {r['spill_stores']} B stored / {r['spill_loads']} B loaded (local {r['cubin_local']} B)")
    if r["shared"] > a.smem_per_block:
        out.append(f"needs {r['shared']} B of shared memory, over the {a.smem_per_block} B a block may have")
    if r["blocks_per_sm"] < 1 and r["limited_by"] == "registers":
        out.append(f"{r['registers']} registers x {r['threads']} threads do not fit one block per SM")
    if r["dots"] and r["tensor_cores_expected"] and (r["tc_dots"] < r["dots"] or r["ptx_tc"] == 0 or r["sass_tc"] == 0):
        out.append(f"{r['dots'] - r['tc_dots']} of {r['dots']} tl.dot not on tensor cores "
                   f"(PTX {r['ptx_tc']}, SASS {r['sass_tc']} tensor-core instructions)")
    if r["cubin_registers"] >= 0 and r["cubin_registers"] != r["registers"]:
        out.append(f"ptxas reports {r['registers']} registers, the cubin {r['cubin_registers']}")
    return out


# ---- expected time per call ----------------------------------------------------------------------------------------

def expected_us(model_name: str, cfg, variant, dev: Device) -> tuple[str, float] | None:
    """(shape, microseconds) for paged decode and prefill at the benchmark shapes: max(bytes moved / HBM
    bandwidth, FLOPs executed / peak); tensor-core peak for 16-bit products, CUDA-core FP32 for float32."""
    m, elem = variant.meta, variant.dtype.itemsize
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    peak = (dev.fp32_tflops if m.get("F32_DOT") else dev.tc_tflops) * 1e12
    if variant.kernel == "paged_decode_split":
        batch, ctx = DECODE_SHAPE
        nbytes = batch * ctx * hkv * d * 2 * elem + 2 * batch * h * d * elem + batch * -(-ctx // BLOCK_SIZE) * 4
        flops = 4 * batch * hkv * m["BLOCK_G"] * ctx * m["BLOCK_D"]  # padded rows: what the tensor cores execute
        shape = f"batch {batch} x context {ctx}"
    elif variant.kernel == "extend":
        t, bm, bn = PREFILL_TOKENS, m["BLOCK_M"], m["BLOCK_N"]
        nbytes = t * (2 * h + 2 * hkv) * d * elem + -(-t // BLOCK_SIZE) * 4
        key_tiles = sum(-(-min(t, (i + 1) * bm) // bn) for i in range(-(-t // bm)))
        flops = 4 * h * key_tiles * bm * bn * m["BLOCK_D"]
        shape = f"prompt {t}"
    else:
        return None
    return shape, max(nbytes / (dev.hbm_gbs * 1e9), flops / peak) * 1e6


# ---- the run -------------------------------------------------------------------------------------------------------

_VARIANTS: dict = {}


def _variants_cached(arch: int, model: str, dtype: str, sms: int | None) -> list:
    key = (arch, model, dtype, sms)
    if key not in _VARIANTS:
        _VARIANTS[key] = [v for _, v in variants_for(arch, (model,), (dtype,), sms)]
    return _VARIANTS[key]


def _inspect_one(job: tuple) -> dict:
    """Worker: compile variant `index` of (arch, model, dtype) (enumerated again here: kernels do not pickle)."""
    arch, model, dtype, sms, index = job
    return _inspect_timed(_variants_cached(arch, model, dtype, sms)[index], arch)


def _inspect_timed(v, arch: int) -> dict:
    t0 = time.perf_counter()
    try:
        r = inspect(v, arch)
    except Exception as e:  # noqa: BLE001 - reported per variant, the run goes on
        r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    r["compile_s"] = round(time.perf_counter() - t0, 2)
    return r


def run(archs: list[int], models=MODELS, dtypes=DTYPES, jobs: int = 2, sms: int | None = None,
        extra: list | None = None) -> list[dict]:
    """One row per (architecture, model, variant): what the compiler made of it, its problems (empty: it
    passes) and, for decode and prefill, the expected time per call on each device of the architecture.
    extra: (name, Variant) pairs compiled here too, in this process (the tests' deliberately bad variants)."""
    rows, work, variants = [], [], []
    for arch in archs:
        for model in models:
            for dt in dtypes:
                for i, v in enumerate(_variants_cached(arch, model, dt, sms)):
                    rows.append(_row(arch, model, v))
                    variants.append(v)
                    work.append((arch, model, dt, sms, i))
    results = _map(_inspect_one, work, jobs)
    for arch in archs:
        for name, v in extra or []:
            rows.append(_row(arch, name, v))
            variants.append(v)
            results.append(_inspect_timed(v, arch))
    cfgs = {m: model_config(m) for m in models}
    for row, v, r in zip(rows, variants, results, strict=True):
        row.update(r)
        row["problems"] = problems(row, row["arch"])
        if row["model"] in cfgs and "error" not in r:
            for dev in ARCHS[row["arch"]].devices:
                e = expected_us(row["model"], cfgs[row["model"]], v, dev)
                if e is not None:
                    row["expected_shape"] = e[0]
                    row.setdefault("expected_us", {})[dev.name] = round(e[1], 1)
    return rows


def _row(arch: int, model: str, v) -> dict:
    return {"arch": arch, "model": model, "kernel": v.kernel, "dtype": str(v.dtype).replace("torch.", ""),
            "variant": v.label, "tensor_cores_expected": not v.meta.get("F32_DOT", False)}


def _map(fn, work: list, jobs: int) -> list:
    if jobs <= 1 or len(work) <= 1:
        return [fn(w) for w in work]
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, work, chunksize=max(1, len(work) // (8 * jobs))))


def failures(rows: list[dict]) -> list[str]:
    """One line per failing variant, naming it."""
    return [f"sm_{r['arch']} {r['model']} {r['variant']}: {'; '.join(r['problems'])}" for r in rows if r["problems"]]


# ---- the table -----------------------------------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
    """The table of every variant: one row per (architecture, model, variant)."""
    head = ["arch", "model", "kernel (constants, warps w, stages s)", "regs", "spill B", "smem B", "threads",
            "blocks/SM (limit)", "occupancy", "tl.dot on TC", "TC instr PTX/SASS", "expected µs per call", "ok"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| sm_{r['arch']} | {r['model']} | {r['variant']} | | | | | | | | | | "
                       f"**FAILS**: {r['problems'][0][:80]} |")
            continue
        dots = f"{r['tc_dots']}/{r['dots']}" if r["dots"] else "-"
        if r["dots"] and not r["tensor_cores_expected"]:
            dots += " (fp32 IEEE: FMA)"
        exp = "-"
        if r.get("expected_us"):
            exp = " / ".join(f"{d} {us:g}" for d, us in r["expected_us"].items()) + f" ({r['expected_shape']})"
        out.append(f"| sm_{r['arch']} | {r['model']} | {r['variant']} | {r['registers']} | "
                   f"{r['spill_stores'] + r['spill_loads']} | {r['shared']} | {r['threads']} | "
                   f"{r['blocks_per_sm']} ({r['limited_by']}) | {100 * r['occupancy']:.0f}% | {dots} | "
                   f"{r['ptx_tc']}/{'-' if r['sass_tc'] is None else r['sass_tc']} | {exp} | {'yes' if not r['problems'] else '**FAILS**'} |")
    return "\n".join(out)


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "engine-internals.md")
DOCS_BEGIN = "<!-- the table below is written by `python -m loadtest.gpu_compile --docs` -->"
DOCS_END = "<!-- end of the gpu_compile table -->"


def docs_table(path: str = DOCS) -> str:
    """The variant table as docs/engine-internals.md holds it (between its markers)."""
    with open(path) as f:
        text = f.read()
    return text[text.index(DOCS_BEGIN) + len(DOCS_BEGIN):text.index(DOCS_END)].strip()


def write_docs_table(table: str, path: str = DOCS) -> None:
    with open(path) as f:
        text = f.read()
    begin, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    with open(path, "w") as f:
        f.write(text[:begin] + "\n\n" + table + "\n\n" + text[end:])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90,100", help="comma-separated compute capabilities (default 90,100)")
    p.add_argument("--device", action="store_true",
                   help="on a GPU: the architecture and SM count of the device this runs on (overrides --arch)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--json", default=None, help="write every row to this file")
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.add_argument("--docs", action="store_true",
                   help="write the table into docs/engine-internals.md (every model, dtype and both architectures)")
    args = p.parse_args(argv)
    args.arch = [int(a) for a in args.arch.split(",") if a]
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [a for a in args.arch if a not in ARCHS] + [m for m in args.models if m not in MODELS] + \
        [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown: {', '.join(map(str, bad))}")
    if args.docs and (args.device or args.arch != [90, 100] or args.models != list(MODELS) or
                      args.dtypes != list(DTYPES)):
        p.error("--docs writes the whole table: every model and dtype for sm_90 and sm_100, without --device")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted (read when triton is imported)
    args = parse_args(argv)
    sms = None
    if args.device:
        import torch

        if not torch.cuda.is_available():
            print("gpu_compile --device: no CUDA device", file=sys.stderr)
            return 2
        major, minor = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        args.arch, sms = [major * 10 + minor], props.multi_processor_count
        if args.arch[0] not in ARCHS:
            print(f"gpu_compile --device: sm_{args.arch[0]} ({props.name}) has no limits here; "
                  f"known: {sorted(ARCHS)}", file=sys.stderr)
            return 2
        print(f"device: {props.name}, sm_{args.arch[0]}, {sms} SMs")
    t0 = time.perf_counter()
    rows = run(args.arch, args.models, args.dtypes, args.jobs, sms)
    table = markdown(rows)
    print(table)
    bad = failures(rows)
    print(f"\n{len(rows)} variants ({len(rows) - len(bad)} pass) compiled for "
          f"{', '.join(f'sm_{a}' for a in args.arch)} in {time.perf_counter() - t0:.1f} s")
    for line in bad:
        print("FAIL " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failures": bad}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.docs:
        write_docs_table(table)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
