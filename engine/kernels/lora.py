"""The gathered LoRA product in one Triton launch (the BGMV idea of Punica / S-LoRA): y[t] += B[s] (A[s] x[t])
for every row t of a flattened batch, with s = row_slots[t] the row's adapter slot (-1: the base model, row
untouched). The slot stacks are zero-padded to the largest rank, so one launch serves every adapter and rank
of a step. One program per (row, block of outputs): it computes the row's rank-R "shrink" x A^T in float32
(K in blocks), then its block of the "expand" B (x A^T), and adds it to y in y's dtype. Prefill rows and
decode rows are alike; the step's slots and ranks are data, never compile-time constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_y", "stride_x"])
def _lora_kernel(y_ptr, x_ptr, a_ptr, b_ptr, slot_ptr, stride_y, stride_x,
                 K: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = tl.where(slot >= 0, 1, 0)  # 0 for a base-model row: every mask below is empty
    s = tl.maximum(slot, 0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R * live
    xa = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K * live
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * R * K + offs_r[:, None] * K + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        xa += tl.sum(a * x[None, :], axis=1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N * live
    b = tl.load(b_ptr + s * N * R + offs_n[:, None] * R + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * xa[None, :], axis=1)
    y = tl.load(y_ptr + row * stride_y + offs_n, mask=mask_n, other=0.0)
    tl.store(y_ptr + row * stride_y + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def lora_gathered_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor
                   ) -> torch.Tensor:
    """y[t] += b[s] @ (a[s] @ x[t]) in place, s = row_slots[t] (-1: skip the row). y [T, N] (a column slice of a
    fused projection's output is fine: unit last stride), x [T, K], a [S, R, K], b [S, N, R] contiguous,
    row_slots [T] int32. Returns y."""
    t, k = x.shape
    n = y.shape[1]
    if a.dim() != 3 or b.dim() != 3 or a.shape[2] != k or b.shape[1] != n or b.shape[2] != a.shape[1] \
            or a.shape[0] != b.shape[0]:
        raise ValueError(f"stacks a {tuple(a.shape)} and b {tuple(b.shape)} do not fit x {tuple(x.shape)} and "
                         f"y {tuple(y.shape)}: expected a [S, R, {k}] and b [S, {n}, R]")
    if y.shape[0] != t or row_slots.shape != (t,) or y.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("y, x and row_slots must have one row per token, y and x with unit last stride")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("the slot stacks must be contiguous")
    if t:
        meta = lora_meta(k, n, a.shape[1])
        _lora_kernel[(t, triton.cdiv(n, meta["BLOCK_N"]))](y, x, a, b, row_slots, y.stride(0), x.stride(0), **meta)
    return y


def lora_meta(fan_in: int, fan_out: int, rank: int) -> dict:
    """The kernel's constants and launch options for y [T, fan_out] += B (A x), stacks zero-padded to rank
    (lora_gathered_'s and engine/kernels/variants.py's)."""
    return dict(K=fan_in, N=fan_out, R=rank, BLOCK_K=min(128, triton.next_power_of_2(fan_in)),
                BLOCK_N=min(128, triton.next_power_of_2(fan_out)), BLOCK_R=max(16, triton.next_power_of_2(rank)),
                num_warps=4)
