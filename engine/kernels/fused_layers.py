"""Triton kernels for a decoder layer's glue, one launch each instead of several torch ops:

- `add_rms_norm_`: residual += x, then x = RMSNorm(residual) * weight, in place (one read, two writes);
- `rotary_kv_write`: rotate q in place in the fused qkv rows, rotate k and store it with v into the paged
  KV cache at the token's slot (-1: skip), one program per token;
- `silu_and_mul`: silu(gate) * up of the fused gate/up rows.

Arithmetic follows the torch modules of engine/model/llama.py: the residual add and the SiLU x up
product are rounded to the input dtype exactly where torch rounds them (so those are bit-exact); the
norm and the rotation compute in float32 from a float32 table and round once, so in 16-bit dtypes they
can differ from torch in the last bit. Integer arguments that change from step to step (token counts,
strides of fresh tensors) are not specialized on, so a new batch size never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_x", "stride_r", "stride_o"])
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the stream is kept in the input dtype
        tl.store(res_ptr + row * stride_r + offs, s, mask=mask)
    else:
        s = x
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (sf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) for x, residual [T, N]. With a residual both are updated in place
    (x receives the norm, residual the sum); without one, the norm goes to a new tensor and x is the stream."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a [num_tokens, hidden] tensor with unit last stride, got {tuple(x.shape)}")
    t, n = x.shape
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    out = x if residual is not None else torch.empty_like(x)
    if t:
        _add_rms_norm_kernel[(t,)](x, residual if residual is not None else x, weight, out, x.stride(0),
                                   residual.stride(0) if residual is not None else 0, out.stride(0), eps,
                                   **rms_norm_meta(n, residual is not None))
    return out, (residual if residual is not None else x)


def rms_norm_meta(hidden: int, has_residual: bool) -> dict:
    """_add_rms_norm_kernel's constants and launch options (add_rms_norm_'s and engine/kernels/variants.py's)."""
    block = triton.next_power_of_2(hidden)
    return dict(N=hidden, BLOCK=block, HAS_RES=has_residual, num_warps=min(16, max(1, block // 512)))


@triton.jit(do_not_specialize=["stride_t", "stride_cs"])
def _rotary_kv_write_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                            stride_t, stride_cs,
                            H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_HALF)
    fmask = offs_f < HALF
    cos = tl.load(cos_sin_ptr + pos * D + offs_f, mask=fmask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * D + HALF + offs_f, mask=fmask, other=0.0)[None, :]
    row = qkv_ptr + t * stride_t

    # q heads: rotated in place
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & fmask[None, :]
    p1 = row + offs_h[:, None] * D + offs_f[None, :]
    x1 = tl.load(p1, mask=m, other=0.0)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=m)
    tl.store(p1 + HALF, (b * cos + a * sin).to(x1.dtype), mask=m)

    # k heads: rotated into the cache; v heads: copied into the cache
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs_k = tl.arange(0, BLOCK_KV)
        mk = (offs_k[:, None] < HKV) & fmask[None, :]
        pk = row + (H + offs_k[:, None]) * D + offs_f[None, :]
        k1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
        dst = slot.to(tl.int64) * stride_cs + offs_k[:, None] * D + offs_f[None, :]
        ety = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, (k1 * cos - k2 * sin).to(ety), mask=mk)
        tl.store(k_cache_ptr + dst + HALF, (k2 * cos + k1 * sin).to(ety), mask=mk)
        pv = row + (H + HKV + offs_k[:, None]) * D + offs_f[None, :]
        tl.store(v_cache_ptr + dst, tl.load(pv, mask=mk, other=0.0).to(ety), mask=mk)
        tl.store(v_cache_ptr + dst + HALF, tl.load(pv + HALF, mask=mk, other=0.0).to(ety), mask=mk)


def rotary_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] (rows contiguous): q rotated in place, rotated k and v stored into the
    cache [num_blocks, block_size, Hkv, D] at slot_mapping[T]; returns q as a [T, H, D] view of qkv.
    cos_sin [max_len, D] float32: the cos halves then the sin halves of HF's rotate_half tables."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [num_tokens, {(num_heads + 2 * num_kv_heads) * d}] with unit last stride, "
                         f"got {tuple(qkv.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k_cache/v_cache must be contiguous [num_blocks, block_size, {num_kv_heads}, {d}]")
    if cos_sin.dtype != torch.float32 or cos_sin.shape[-1] != d or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin must be a contiguous float32 [max_len, {d}] table, got {tuple(cos_sin.shape)} "
                         f"{cos_sin.dtype}")
    if t:
        _rotary_kv_write_kernel[(t,)](
            qkv, positions, cos_sin, slot_mapping, k_cache, v_cache, qkv.stride(0), num_kv_heads * d,
            **rotary_meta(num_heads, num_kv_heads, d))
    return qkv.view(t, num_heads + 2 * num_kv_heads, d)[:, :num_heads]


def rotary_meta(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """_rotary_kv_write_kernel's constants and launch options (rotary_kv_write's and engine/kernels/variants.py's)."""
    return dict(H=num_heads, HKV=num_kv_heads, D=head_dim, HALF=head_dim // 2,
                BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
                BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=4)


@triton.jit(do_not_specialize=["stride_x", "stride_o"])
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch rounds silu(gate) before the product
    tl.store(out_ptr + row * stride_o + offs, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2 I] with unit last stride; a new [T, I] tensor."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate] with unit last stride, got {tuple(x.shape)}")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        meta = silu_meta(n)
        _silu_and_mul_kernel[(t, triton.cdiv(n, meta["BLOCK"]))](x, out, x.stride(0), out.stride(0), **meta)
    return out


def silu_meta(intermediate: int) -> dict:
    """_silu_and_mul_kernel's constants and launch options (silu_and_mul's and engine/kernels/variants.py's)."""
    return dict(N=intermediate, BLOCK=min(1024, triton.next_power_of_2(intermediate)), num_warps=4)
