"""Compile the Triton kernels for sm_90/sm_80 without a GPU and report what the compiler made of them.

Run in a fresh process (`python -m tests.engine.triton_compile_probe`, TRITON_INTERPRET unset) because
Triton fixes compiled-vs-interpreted mode when it is first imported; prints one JSON object keyed by case
id: shared memory, 16-byte vector K/V loads, tensor-core instructions, local memory, and the registers and
spill stores ptxas reports.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

# id: (kernel, dtype, arch, consts, num_warps, num_stages); None for the launch = the module's default
CASES = {
    "decode-bf16-g4-d128-bs16": ("decode", "bf16", 90, dict(G=4, D=128, BS=16), None),
    "decode-fp16-g3-d64-bs8": ("decode", "fp16", 90, dict(G=3, D=64, BS=8), None),
    "decode-bf16-g8-d128-bs32-bn128": ("decode", "bf16", 90, dict(G=8, D=128, BS=32), (128, 8, 4)),
    "decode-fp32-g8-d128-bs64": ("decode", "fp32", 90, dict(G=8, D=128, BS=64), None),
    "decode-bf16-g2-d256-bs16": ("decode", "bf16", 90, dict(G=2, D=256, BS=16), None),
    "decode-fp16-g4-d128-sm80": ("decode", "fp16", 80, dict(G=4, D=128, BS=16), None),
    "reduce-bf16-d128": ("reduce", "bf16", 90, dict(D=128, BLOCK_D=128, BLOCK_S=16, BLOCK_N=64), (0, 4, 1)),
    "extend-bf16-g4-d128": ("extend", "bf16", 90, dict(G=4, D=128, BS=16), None),
    "extend-fp32-g1-d128": ("extend", "fp32", 90, dict(G=1, D=128, BS=16), None),
    "extend-fp16-g2-d80": ("extend", "fp16", 90, dict(G=2, D=80, BS=16), None),
    "extend-bf16-g1-d256": ("extend", "bf16", 90, dict(G=1, D=256, BS=16), None),
    "kv_write-bf16-h8-d128": ("kv_write", "bf16", 90, dict(HKV=8, D=128, BLOCK_H=8, BLOCK_D=128), (0, 4, 1)),
}
# integer arguments that are multiples of 16 at run time (Triton specializes those the same way)
DIV16 = {"stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_pb", "stride_ph", "stride_ps",
         "stride_ot", "stride_oh", "tokens_per_split", "stride_cs", "stride_ch", "stride_kt", "stride_vt",
         "stride_vh"}


def compile_case(kind: str, dtype: str, arch: int, consts: dict, launch) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import extend_attention, kv_write, paged_decode

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    consts = dict(consts)
    if kind == "decode":
        dl = paged_decode.default_launch(tdtype, consts["D"])
        block_n, warps, stages = launch or (dl.block_n, dl.num_warps, dl.num_stages)
        consts.update(BLOCK_G=max(16, triton.next_power_of_2(consts["G"])), BLOCK_D=triton.next_power_of_2(consts["D"]),
                      BLOCK_N=block_n, F32_DOT=dtype == "fp32")
        fn = paged_decode._decode_split_kernel
    elif kind == "extend":
        block_m, block_n, warps = extend_attention.extend_launch(tdtype, consts["D"])
        stages = 2
        consts.update(BLOCK_D=triton.next_power_of_2(consts["D"]), BLOCK_M=block_m, BLOCK_N=block_n,
                      F32_DOT=dtype == "fp32")
        fn = extend_attention._extend_kernel
    else:
        _, warps, stages = launch
        fn = paged_decode._decode_reduce_kernel if kind == "reduce" else kv_write._kv_write_kernel
    t = "*" + dtype
    ptr_types = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "slot_ptr": "*i64"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*i32" if name in ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "seq_ids_ptr")
                                      else t)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
            if name in DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    regs, spills = ptxas_usage(ptx, arch)
    return {"shared": k.metadata.shared, "num_warps": warps, "num_stages": stages,
            "vec16_loads": len(re.findall(r"cp\.async\.c[ga]\.shared\.global[^\n]*0x10", ptx))
            + len(re.findall(r"ld\.global[.\w]*\.v4\.b32", ptx)),
            "vec_stores": len(re.findall(r"st\.global[.\w]*\.v[24]\.b32", ptx)),
            "mma": len(re.findall(r"\bw?gmma|\bmma\.", ptx)), "local": ptx.count(".local"),
            "registers": regs, "spill_store_bytes": spills}


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v",
                              f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"], capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def main(ids: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    out = {}
    for cid in ids or list(CASES):
        try:
            out[cid] = compile_case(*CASES[cid])
        except Exception as e:  # report per case; the test shows the message
            out[cid] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
