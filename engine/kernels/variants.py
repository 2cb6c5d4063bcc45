"""Every Triton kernel variant an engine compiles on CUDA, enumerated from its shapes.

A variant is one kernel with one set of compile-time constants and launch options, and one specialization
of its runtime arguments: the dtype behind every pointer, and for every integer Triton specializes on
whether it is 1 or a multiple of 16. Triton compiles one binary per variant on first launch. The constants
come from each launcher's own helper (`split_meta`, `extend_meta`, `rotary_meta`, ... which the launchers
call themselves); the arguments are the engine's tensors' dtypes and strides at these shapes.

`engine_variants` is what ModelRunner.warm_up compiles on CUDA before its warm-up passes (and then checks
that those passes compiled nothing else), and what `python -m loadtest.gpu_compile` compiles for Hopper and
Blackwell on a machine without a GPU, reading registers, spills, shared memory and tensor-core use from the
compiler's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels.common import f32_dot_for
from engine.kernels.paged_decode import MIN_TOKENS_PER_SPLIT, DecodeLaunch, default_launch, grid_splits

logger = logging.getLogger(__name__)

I32, I64, F32 = torch.int32, torch.int64, torch.float32


@dataclass(frozen=True)
class Variant:
    kernel: str  # launcher-level name: paged_decode_split, extend, rotary_kv_write, ...
    fn: Any  # the @triton.jit function
    args: tuple  # runtime arguments in order: a torch.dtype for a pointer, an int or float for a scalar
    meta: dict = field(hash=False)  # constexprs and launch options (num_warps, num_stages), as the launcher passes
    note: str = ""  # what in the engine launches it

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: its first 16-bit pointer, else float32."""
        return next((a for a in self.args if a in (torch.bfloat16, torch.float16)), F32)

    @property
    def label(self) -> str:
        """Kernel and its constants, e.g. `paged_decode_split bf16 G=4 BLOCK_G=16 D=128 ... w4 s2`."""
        consts = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.meta.items()
                          if k not in ("num_warps", "num_stages"))
        return (f"{self.kernel} {_short(self.dtype)} {consts} w{self.meta.get('num_warps', 4)} "
                f"s{self.meta.get('num_stages', 3)}{' ' + self.note if self.note else ''}")

    def key(self) -> tuple:
        """Equal for two variants Triton compiles to the same binary."""
        spec = tuple(_short(a) if isinstance(a, torch.dtype) else
                     (a == 1, a % 16 == 0) if isinstance(a, int) else "f" for a in self.args)
        return self.fn.__name__, spec, tuple(sorted(self.meta.items()))


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", I32: "i32", I64: "i64"}[dtype]


def engine_variants(cfg, dtype: torch.dtype, block_size: int, split_counts: set[int], lora_rank: int = 0,
                    decode_launch: DecodeLaunch | None = None) -> list[Variant]:
    """The kernel variants an engine serving a model of config `cfg` (engine/model/llama.py's ModelConfig) in
    `dtype` on the triton backend compiles: the layer kernels, paged decode at each of `split_counts` (the
    decode grid's split dimensions its batches take: decode_split_counts), extend/prefill attention, and with
    lora_rank > 0 the gathered LoRA product (stacks padded to that rank). Duplicates removed, in launch order."""
    from engine.kernels import extend_attention, fused_layers, paged_decode

    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv_width = (h + 2 * hkv) * d
    kv_tok = hkv * d  # stride between cache slots
    f32 = f32_dot_for(dtype, "cuda")
    out: list[Variant] = []
    for has_res in (False, True):  # the first layer's norm starts the residual stream
        out.append(Variant("add_rms_norm", fused_layers._add_rms_norm_kernel,
                           (dtype, dtype, dtype, dtype, cfg.hidden_size, cfg.hidden_size if has_res else 0,
                            cfg.hidden_size, 1e-5), fused_layers.rms_norm_meta(cfg.hidden_size, has_res),
                           "" if has_res else "first layer"))
    out.append(Variant("rotary_kv_write", fused_layers._rotary_kv_write_kernel,
                       (dtype, I64, F32, I64, dtype, dtype, qkv_width, kv_tok),
                       fused_layers.rotary_meta(h, hkv, d)))
    out.append(Variant("silu_and_mul", fused_layers._silu_and_mul_kernel,
                       (dtype, dtype, 2 * cfg.intermediate_size, cfg.intermediate_size),
                       fused_layers.silu_meta(cfg.intermediate_size)))
    launch = decode_launch or default_launch(dtype, d)
    block_d = paged_decode.block_d_of(d)
    q_args = (dtype, dtype, dtype, I32, I32, I32, I32)  # q, k_cache, v_cache, block table, lens, starts, ids
    strides = (qkv_width, d, block_size * kv_tok, kv_tok, d, 64)  # q rows are views of the fused qkv rows
    many = max((n for n in split_counts if n > 1), default=0)
    for split in [n for n in (many, 1) if n in split_counts]:
        ws = F32 if split > 1 else dtype  # one split: the output tensor stands in for the unused workspace
        out.append(Variant("paged_decode_split", paged_decode._decode_split_kernel,
                           q_args + (ws, ws, dtype, 0.1, split, MIN_TOKENS_PER_SPLIT) + strides
                           + (h * split * block_d, split * block_d, h * d, d),
                           paged_decode.split_meta(h // hkv, d, block_size, f32, launch),
                           "split context" if split > 1 else "whole context"))
    if many:
        out.append(Variant("paged_decode_reduce", paged_decode._decode_reduce_kernel,
                           (F32, F32, dtype, I32, I32, I32, many, MIN_TOKENS_PER_SPLIT,
                            h * many * block_d, many * block_d, h * d, d),
                           paged_decode.reduce_meta(d, launch.block_n)))
    out.append(Variant("extend", extend_attention._extend_kernel,
                       q_args[:3] + (dtype, I32, I32, I32, I32, 0.1) + strides[:5] + (64, h * d, d),
                       extend_attention.extend_meta(h // hkv, d, block_size, dtype, f32)))
    if lora_rank > 0:
        out += lora_variants(cfg, dtype, lora_rank)
    return dedupe(out)


def decode_split_counts(max_num_seqs: int, num_kv_heads: int, num_sms: int, forced: int | None = None) -> set[int]:
    """The decode grid's split dimensions over batches of 1..max_num_seqs decodes (mixed steps take any)."""
    return {forced or grid_splits(n, num_kv_heads, num_sms) for n in range(1, max_num_seqs + 1)}


def kv_write_variants(cfg, dtype: torch.dtype) -> list[Variant]:
    """The backend's own KV write (write_kv): used by models without the Triton layer kernels, whose
    rotary_kv_write stores K and V itself."""
    from engine.kernels import kv_write

    hkv, d = cfg.num_kv_heads, cfg.head_dim
    q_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    return [Variant("kv_write", kv_write._kv_write_kernel,
                    (dtype, dtype, dtype, dtype, I64, q_width, d, q_width, d, hkv * d, d),
                    kv_write.kv_write_meta(hkv, d))]


def lora_variants(cfg, dtype: torch.dtype, rank: int) -> list[Variant]:
    """One gathered LoRA launch per part of every wrapped projection (engine/lora/layers.py)."""
    from engine.kernels import lora
    from engine.kernels.lora_shapes import LORA_PROJECTIONS, fan_in, part_sizes

    out = []
    for name in LORA_PROJECTIONS:
        sizes = part_sizes(cfg, name)
        k = fan_in(cfg, name)
        for n in sizes:  # y is a column slice of the fused projection's output
            out.append(Variant("lora", lora._lora_kernel, (dtype, dtype, dtype, dtype, I32, sum(sizes), k),
                               lora.lora_meta(k, n, rank), name))
    return dedupe(out)


def dedupe(variants: list[Variant]) -> list[Variant]:
    seen: set = set()
    out = []
    for v in variants:
        if v.key() not in seen:
            seen.add(v.key())
            out.append(v)
    return out


def precompile(variants: list[Variant]) -> int:
    """Compile every variant for the current CUDA device now (Triton's warmup: nothing runs); returns how
    many compiled. A variant that fails is logged and left to its first launch, which raises the error."""
    done = 0
    for v in variants:
        try:
            v.fn.warmup(*v.args, grid=(1,), **v.meta)
            done += 1
        except Exception as e:  # the warm-up passes that follow launch it and fail loudly
            logger.warning("Triton variant %s did not compile ahead: %s: %s", v.label, type(e).__name__, e)
    return done


def compiled_counts(variants: list[Variant]) -> dict[str, int]:
    """Binaries Triton holds for each kernel of `variants` on the current device (-1: unknown)."""
    counts: dict[str, int] = {}
    for v in variants:
        name = v.fn.__name__
        if name in counts:
            continue
        try:
            caches = v.fn.device_caches[torch.cuda.current_device()]
            counts[name] = len(caches[0])
        except Exception:  # Triton's cache layout is internal: report unknown rather than fail the start
            counts[name] = -1
    return counts


def unexpected_compiles(variants: list[Variant], before: dict[str, int]) -> list[str]:
    """Kernels that compiled more binaries since `before` than `variants` holds for them: the enumeration
    missed a variant the engine launches (each costs a compile inside some request's step)."""
    expected: dict[str, int] = {}
    for v in variants:
        expected[v.fn.__name__] = expected.get(v.fn.__name__, 0) + 1
    after = compiled_counts(variants)
    return [f"{name}: {after[name] - before[name]} compiled, {expected[name]} enumerated" for name in after
            if min(after[name], before.get(name, -1)) >= 0 and after[name] - before[name] > expected[name]]
