"""Triton prefill/extend attention: a chunk of new tokens over its sequence's paged KV cache.

The new tokens of a sequence sit at positions seq_len - q_len .. seq_len - 1; they attend fully to
the cached prefix and causally to each other, all read through the block table (their own K/V were
written to the cache first). One program handles BLOCK_M query rows of one head of one sequence
and streams the keys it may see in BLOCK_N tiles with an online softmax in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import f32_dot

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes from step to step: no recompiles
def _extend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, scale_log2,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.load(seq_ids_ptr + tl.program_id(1))
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    kvh = head // G

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < q_len
    dmask = offs_d < D
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        blk = tl.load(bt_row + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        kv_off = blk * stride_kb + (offs_n % BS) * stride_ks + kvh * stride_kh
        if BLOCK_D == D:  # no head-dim mask: lets the compiler vectorize the K/V row loads
            kv_mask = nmask[:, None]
        else:
            kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = nmask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if F32_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    o = acc / l_sum[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def extend_launch(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 64x64 tiles on 4 warps for 16-bit heads up to 128; fp32 (FMA
    products) and wider heads take 32x32 tiles on 8 warps, clear of register spills on sm_80/sm_90."""
    if dtype == torch.float32 or triton.next_power_of_2(head_dim) > 128:
        return 32, 32, 8
    return 64, 64, 4


def extend_meta(group: int, head_dim: int, block_size: int, dtype: torch.dtype, f32: bool) -> dict:
    """The kernel's compile-time constants and launch options (extend_attention's and engine/kernels/variants.py's)."""
    block_m, block_n, num_warps = extend_launch(dtype, head_dim)
    return dict(G=group, D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
                BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=f32, num_warps=num_warps, num_stages=2)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_ids: torch.Tensor, max_query_len: int, scale: float) -> None:
    """Causal attention of every sequence in seq_ids' new tokens over its cached context."""
    num = seq_ids.shape[0]
    if num == 0:
        return
    _, block_size, hkv, d = k_cache.shape
    hq = q.shape[1]
    meta = extend_meta(hq // hkv, d, block_size, q.dtype, f32_dot(q))
    grid = (triton.cdiv(max_query_len, meta["BLOCK_M"]), num, hq)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, seq_ids, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), **meta)
