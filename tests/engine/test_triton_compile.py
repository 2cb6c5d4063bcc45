"""The Triton kernels compile for Hopper (sm_90: H100/H200) and Ampere (sm_80) without a GPU.

Triton ships ptxas, so the full compile pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs on any
machine. Beyond "it compiles", the checks pin what makes the decode kernel fast: K/V rows are moved as
16-byte vectors (pipelined cp.async), the products run on tensor cores (mma) for 16-bit inputs, and
the shared memory each program needs fits the SM, and ptxas neither spills registers nor needs more
than 128 per thread for the decode kernel (so several programs stay resident per SM).
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from engine.kernels import extend_attention, kv_write, paged_decode

HOPPER, AMPERE = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)
MAX_SHARED = 227 * 1024  # per-block opt-in limit on H100/H200 (A100: 163 KiB)
# integer arguments that are multiples of 16 at run time (Triton specializes those the same way)
DIV16 = {"stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_pb", "stride_ph", "stride_ps",
         "stride_ot", "stride_oh", "tokens_per_split", "stride_cs", "stride_ch", "stride_kt", "stride_vt",
         "stride_vh"}


def compile_kernel(kernel, ptr_types: dict[str, str], consts: dict, target=HOPPER, num_warps=4, num_stages=2):
    fn = JITFunction(kernel.fn)  # a fresh compiled-mode handle, whatever mode the module was imported in
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
            if name in DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def attention_ptrs(dtype: str) -> dict[str, str]:
    t = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype]
    return {"q_ptr": t, "k_ptr": t, "v_ptr": t, "out_ptr": t, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32", "seq_ids_ptr": "*i32", "part_ptr": "*fp32", "lse_ptr": "*fp32"}


def vector_loads_16b(ptx: str) -> int:
    return len(re.findall(r"cp\.async\.c[ga]\.shared\.global[^\n]*0x10", ptx)) + len(
        re.findall(r"ld\.global[.\w]*\.v4\.b32", ptx))


def ptxas_usage(ptx: str, arch: int, tmp_path) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that ptxas reports for the kernel."""
    path = tmp_path / "kernel.ptx"
    path.write_text(ptx)
    res = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v",
                          str(path), "-o", str(tmp_path / "kernel.cubin")], capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    assert regs and spills, res.stderr
    return int(regs.group(1)), int(spills.group(1))


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DECODE_CASES = [  # dtype, G, D, BS, launch (block_n, warps, stages; None: the default), DIRECT
    ("bf16", 4, 128, 16, None, False),
    ("fp16", 3, 64, 8, None, True),
    ("bf16", 8, 128, 32, (128, 8, 4), False),
    ("fp32", 8, 128, 64, None, False),
    ("bf16", 2, 256, 16, None, False),
]


@pytest.mark.parametrize("dtype,g,d,bs,launch,direct", DECODE_CASES)
def test_decode_kernel_compiles_vectorized_on_tensor_cores(dtype, g, d, bs, launch, direct, tmp_path):
    if launch is None:
        dl = paged_decode.default_launch(TORCH_DTYPES[dtype], d)
        launch = (dl.block_n, dl.num_warps, dl.num_stages)
    block_n, warps, stages = launch
    consts = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=d, BS=bs, BLOCK_N=block_n,
                  DIRECT=direct, F32_DOT=dtype == "fp32")
    k = compile_kernel(paged_decode._decode_split_kernel, attention_ptrs(dtype), consts, num_warps=warps,
                       num_stages=stages)
    ptx = k.asm["ptx"]
    assert k.metadata.shared <= MAX_SHARED
    assert vector_loads_16b(ptx) >= 2, "K and V rows must load as 16-byte vectors"
    assert ".local" not in ptx
    if dtype != "fp32":
        assert "mma" in ptx, "16-bit products must run on tensor cores"
    regs, spills = ptxas_usage(ptx, 90, tmp_path)
    assert spills == 0 and regs <= 128, (regs, spills)


def test_decode_kernel_compiles_for_ampere():
    consts = dict(G=4, BLOCK_G=16, D=128, BLOCK_D=128, BS=16, BLOCK_N=64, DIRECT=False, F32_DOT=False)
    k = compile_kernel(paged_decode._decode_split_kernel, attention_ptrs("fp16"), consts, target=AMPERE)
    assert k.metadata.shared <= 163 * 1024 and "mma" in k.asm["ptx"]


def test_reduce_kernel_compiles():
    k = compile_kernel(paged_decode._decode_reduce_kernel, attention_ptrs("bf16"),
                       dict(D=128, BLOCK_D=128, BLOCK_S=16))
    assert "ld.global" in k.asm["ptx"]


@pytest.mark.parametrize("dtype,g,d", [("bf16", 4, 128), ("fp32", 1, 128), ("fp16", 2, 80), ("bf16", 1, 256)])
def test_extend_kernel_compiles(dtype, g, d, tmp_path):
    block_m, block_n, warps = extend_attention.extend_launch(TORCH_DTYPES[dtype], d)
    consts = dict(G=g, D=d, BLOCK_D=triton.next_power_of_2(d), BS=16, BLOCK_M=block_m, BLOCK_N=block_n,
                  F32_DOT=dtype == "fp32")
    k = compile_kernel(extend_attention._extend_kernel, attention_ptrs(dtype), consts, num_warps=warps)
    assert k.metadata.shared <= MAX_SHARED
    if dtype != "fp32":
        assert "mma" in k.asm["ptx"]
    assert ptxas_usage(k.asm["ptx"], 90, tmp_path)[1] == 0, "no register spills"


def test_kv_write_kernel_compiles_vectorized():
    ptrs = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
            "slot_ptr": "*i64"}
    k = compile_kernel(kv_write._kv_write_kernel, ptrs, dict(HKV=8, D=128, BLOCK_H=8, BLOCK_D=128))
    ptx = k.asm["ptx"]
    assert re.search(r"st\.global[.\w]*\.v[24]\.b32", ptx), "cache rows must be stored as vectors"
