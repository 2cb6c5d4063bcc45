"""Triton paged decode attention: one query token per sequence over its paged KV cache.

One program handles one sequence, one KV head and one split of the context: the G query heads that
share that KV head are a [G, D] tile (padded to 16 rows) so K/V are read once for all of them and
both products run on tl.dot. The context is split across programs for long sequences (split-KV): the
grid's split dimension depends on the batch size only, and each sequence takes as many of those
splits as its own length calls for (decided on the device, so one long sequence among short ones does
not straggle and the launch needs no host-side lengths); each split writes its normalized partial
output and log-sum-exp into a reused workspace, and a second kernel merges them.
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
def _seq_splits(seq_len, grid_splits, min_tokens, BLOCK_N: tl.constexpr):
    """(splits, tokens per split) of one sequence: splits of at least min_tokens, at most grid_splits,
    each a multiple of BLOCK_N tokens. Computed on the device from the sequence's own length."""
    n = tl.minimum(tl.maximum((seq_len + min_tokens - 1) // min_tokens, 1), grid_splits)
    per = (seq_len + n - 1) // n
    per = tl.maximum((per + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N
    n = tl.maximum((seq_len + per - 1) // per, 1)
    return n, per


@triton.jit(do_not_specialize=["grid_splits", "min_tokens"])
def _plan_kernel(seq_lens_ptr, seq_ids_ptr, splits_ptr, per_ptr, grid_splits, min_tokens, BLOCK_N: tl.constexpr):
    """The split plan as the kernels compute it, written out (tests and benchmarks read it)."""
    pid = tl.program_id(0)
    n, per = _seq_splits(tl.load(seq_lens_ptr + tl.load(seq_ids_ptr + pid)), grid_splits, min_tokens, BLOCK_N)
    tl.store(splits_ptr + pid, n)
    tl.store(per_ptr + pid, per)


@triton.jit(do_not_specialize=["grid_splits", "min_tokens", "stride_qt", "stride_bt", "stride_pb", "stride_ot"])
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr,
                         part_ptr, lse_ptr, out_ptr,
                         scale_log2, grid_splits, min_tokens,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                         stride_pb, stride_ph, stride_ot, stride_oh,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + pid)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits, tokens_per_split = _seq_splits(seq_len, grid_splits, min_tokens, BLOCK_N)
    if split >= num_splits:
        return
    row = tl.load(qsl_ptr + seq).to(tl.int64)
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
    if num_splits == 1:  # the whole context in this program: straight to the output
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        base = pid.to(tl.int64) * stride_pb + heads * stride_ph + split * BLOCK_D
        tl.store(part_ptr + base[:, None] + offs_d[None, :], o, mask=gmask[:, None] & dmask[None, :])
        lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        # lse is [num, Hq, grid_splits] laid out like part [num, Hq, grid_splits, BLOCK_D] without the last dim
        tl.store(lse_ptr + base // BLOCK_D, lse, mask=gmask)


@triton.jit(do_not_specialize=["grid_splits", "min_tokens", "stride_pb", "stride_ot"])
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, grid_splits, min_tokens,
                          stride_pb, stride_ph, stride_ot, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + pid)
    num_splits, _ = _seq_splits(tl.load(seq_lens_ptr + seq), grid_splits, min_tokens, BLOCK_N)
    if num_splits == 1:  # written directly by the split kernel
        return
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    base = pid.to(tl.int64) * stride_pb + head * stride_ph + offs_s * BLOCK_D
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


def split_meta(group: int, head_dim: int, block_size: int, f32: bool, launch: DecodeLaunch) -> dict:
    """The split kernel's compile-time constants and launch options (paged_decode's and
    engine/kernels/variants.py's): the G query heads of a KV head padded to >= 16 rows for tl.dot."""
    return dict(G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_D=block_d_of(head_dim),
                BS=block_size, BLOCK_N=launch.block_n, F32_DOT=f32, num_warps=launch.num_warps,
                num_stages=launch.num_stages)


def reduce_meta(head_dim: int, block_n: int) -> dict:
    """The merge kernel's constants: one variant for every split count, so nothing compiles per batch size."""
    return dict(D=head_dim, BLOCK_D=block_d_of(head_dim), BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
                BLOCK_N=block_n, num_warps=4)


def block_d_of(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def grid_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The decode grid's split dimension for a batch of num_seqs: enough programs to give every SM about
    four (decode is memory-bound: it needs many loads in flight), at most 64. It depends on the batch
    size only, never on the lengths, so a captured CUDA graph stays valid; each sequence then takes
    min(this, its length / min_tokens) splits, computed on the device."""
    return max(1, min(triton.cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads)), MAX_SPLITS))


def seq_splits(seq_len: int, grid: int, min_tokens: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split) of one sequence, exactly as the kernels compute them on the device."""
    n = min(max(triton.cdiv(seq_len, min_tokens), 1), grid)
    per = max(triton.cdiv(triton.cdiv(seq_len, n), block_n), 1) * block_n
    return max(triton.cdiv(seq_len, per), 1), per


class DecodeWorkspace:
    """Float32 partial outputs and log-sum-exps of split sequences, allocated once and reused by every
    layer and step (grown only when a bigger batch arrives; `reserve` sizes it up front)."""

    def __init__(self) -> None:
        self._part: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    def get(self, num: int, hq: int, grid: int, block_d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        need = num * hq * grid
        if self._lse is None or self._lse.numel() < need or self._lse.device != device:
            self._lse = torch.empty(need, dtype=torch.float32, device=device)
            self._part = torch.empty(need * block_d, dtype=torch.float32, device=device)
        return self._part, self._lse


def plan_splits(seq_lens: torch.Tensor, seq_ids: torch.Tensor, grid: int, min_tokens: int = MIN_TOKENS_PER_SPLIT,
                block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(splits, tokens per split) per sequence in seq_ids, computed by the kernels' own device code."""
    num = seq_ids.shape[0]
    splits = torch.empty(num, dtype=torch.int32, device=seq_lens.device)
    per = torch.empty(num, dtype=torch.int32, device=seq_lens.device)
    if num:
        _plan_kernel[(num,)](seq_lens, seq_ids, splits, per, grid, min_tokens, BLOCK_N=block_n)
    return splits, per


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_ids: torch.Tensor, scale: float, num_splits: int, launch: DecodeLaunch | None = None,
                 workspace: DecodeWorkspace | None = None, min_tokens: int = MIN_TOKENS_PER_SPLIT) -> None:
    """out[query_start_loc[s]] = attention of q[query_start_loc[s]] for every sequence s in seq_ids.

    num_splits is the grid's split dimension (grid_splits); each sequence uses min(num_splits,
    ceil(len / min_tokens)) of them, decided on the device. No host synchronisation, no length read on
    the host: the launch depends on the batch size and shapes only (safe to capture in a CUDA graph)."""
    num = seq_ids.shape[0]
    if num == 0:
        return
    _, block_size, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    block_d = block_d_of(d)
    launch = launch or default_launch(q.dtype, d)
    block_n = launch.block_n
    if num_splits > 1:
        part, lse = (workspace or DecodeWorkspace()).get(num, hq, num_splits, block_d, q.device)
    else:
        part = lse = out  # unused: every sequence is written directly
    stride_ph = num_splits * block_d
    stride_pb = hq * stride_ph
    _decode_split_kernel[(num, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, part, lse, out,
        scale * LOG2E, num_splits, min_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        stride_pb, stride_ph, out.stride(0), out.stride(1), **split_meta(group, d, block_size, f32_dot(q), launch))
    if num_splits > 1:
        _decode_reduce_kernel[(num, hq)](
            part, lse, out, seq_lens, query_start_loc, seq_ids, num_splits, min_tokens, stride_pb, stride_ph,
            out.stride(0), out.stride(1), **reduce_meta(d, block_n))
