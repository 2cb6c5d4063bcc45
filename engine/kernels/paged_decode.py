"""Triton paged decode attention: one query token per sequence over its paged KV cache.

One program handles one sequence, one KV head and one split of the context: the G query heads that
share that KV head are a [G, D] tile (padded to 16 rows) so K/V are read once for all of them and
both products run on tl.dot. The context is split across programs for long sequences (split-KV);
each split writes its normalized partial output and log-sum-exp, and a second kernel merges them.
Online softmax in float32 (base-2 exponentials); fp16/bf16/fp32 inputs; any block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import f32_dot

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr,
                         part_ptr, lse_ptr, out_ptr,
                         scale_log2, tokens_per_split,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                         stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + pid)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
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
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
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

    has = l_sum > 0
    o = acc / tl.where(has, l_sum, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        base = pid.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_ptr + base[:, None] + offs_d[None, :], o, mask=gmask[:, None] & dmask[None, :])
        lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        # lse is [num, Hq, splits] laid out like part [num, Hq, splits, BLOCK_D] without the last dim
        tl.store(lse_ptr + base // BLOCK_D, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, qsl_ptr, seq_ids_ptr, num_splits,
                          stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + pid)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    base = pid.to(tl.int64) * stride_pb + head * stride_ph + offs_s * stride_ps
    lse = tl.load(lse_ptr + base // BLOCK_D, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + base[:, None] + offs_d[None, :], mask=smask[:, None] & (offs_d[None, :] < D),
                   other=0.0)
    o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch shape of the split kernel (loadtest/bench_paged_decode.py --sweep compares them on a GPU)."""

    block_n: int  # tokens per loop iteration: a power of two >= 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be 1/2/4/8/16 and num_stages >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


def default_launch(dtype: torch.dtype, head_dim: int) -> DecodeLaunch:
    """64-token tiles on 4 warps for 16-bit heads up to 128; fp32 (FMA products) and wider heads take
    32-token tiles on 8 warps, which keeps them clear of register spills on sm_80/sm_90."""
    if dtype == torch.float32 or triton.next_power_of_2(head_dim) > 128:
        return DecodeLaunch(32, num_warps=8)
    return DecodeLaunch(64)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits to give every SM about four programs (decode is memory-bound: it needs many loads
    in flight), never splits shorter than 256 tokens, at most 64."""
    by_len = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_ids: torch.Tensor, max_seq_len: int, scale: float, num_splits: int,
                 launch: DecodeLaunch | None = None) -> None:
    """out[query_start_loc[s]] = attention of q[query_start_loc[s]] for every sequence s in seq_ids."""
    num = seq_ids.shape[0]
    if num == 0:
        return
    _, block_size, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    launch = launch or default_launch(q.dtype, d)
    block_n = launch.block_n
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), tokens_per_split)
    direct = num_splits == 1
    if direct:
        part = lse = out  # unused by the kernel
        sp = (0, 0, 0)
    else:
        part = torch.empty((num, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        lse = torch.empty((num, hq, num_splits), dtype=torch.float32, device=q.device)
        sp = part.stride()[:3]
    common = dict(G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=d, BLOCK_D=block_d,
                  BS=block_size, BLOCK_N=block_n, DIRECT=direct, F32_DOT=f32_dot(q))
    _decode_split_kernel[(num, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, part, lse, out,
        scale * LOG2E, tokens_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        sp[0], sp[1], sp[2], out.stride(0), out.stride(1), num_warps=launch.num_warps,
        num_stages=launch.num_stages, **common)
    if not direct:
        _decode_reduce_kernel[(num, hq)](
            part, lse, out, query_start_loc, seq_ids, num_splits, sp[0], sp[1], sp[2],
            out.stride(0), out.stride(1), D=d, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4)
