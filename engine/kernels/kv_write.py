"""Triton kernel: scatter the new tokens' K and V into the paged cache at their slots (-1 = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    src_k = key_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, hkv, d = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous for the triton backend")
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _kv_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), hkv * d, d,
        **kv_write_meta(hkv, d))


def kv_write_meta(num_kv_heads: int, head_dim: int) -> dict:
    """The kernel's compile-time constants and launch options (kv_write's and engine/kernels/variants.py's)."""
    return dict(HKV=num_kv_heads, D=head_dim, BLOCK_H=max(2, triton.next_power_of_2(num_kv_heads)),
                BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if num_kv_heads * head_dim <= 512 else 4)
