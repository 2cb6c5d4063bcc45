"""Exact 4-bit group weights: find them in a float32 checkpoint tensor and pack them for `q4_linear`.

GGUF Q4_1 checkpoints store every projection as w = s * q + m with q in 0..15 and one float16
s and m per 32 inputs (Q4_0 groups too where their values span all 16 levels). Dequantized to float32 (what the GGUF converter writes), each
value is exactly s * q + m rounded once. `find_q4` recovers (q, s, m) from such a tensor and accepts
them only if they reproduce every float32 value bit for bit; any other tensor (a float checkpoint)
yields None. `pack_q4` lays them out for the CPU kernel (engine/kernels/q4_gemm.cpp), which reads 0.625
bytes per weight instead of bf16's 2 and dequantizes to exactly the bf16 weights the model holds.
"""

from __future__ import annotations

import torch

GROUP = 32
COLS = 16


def find_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K], s float16 [N, K/32], m float16 [N, K/32]) with s * q + m == weight exactly, else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if k % GROUP or n % COLS or n == 0:
        return None
    g = weight.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.half()
    if not torch.equal(m.float(), lo):  # the group minimum is m itself (q = 0 is always used)
        return None
    s = ((hi - lo) / 15).half()
    best_q, best_s, ok = None, None, None
    # the float16 s nearest (max - min) / 15, or one of its neighbours, reproduces the group exactly
    for cand in (s, torch.nextafter(s, torch.full_like(s, float("inf"))), torch.nextafter(s, torch.zeros_like(s))):
        sf = cand.float()[..., None]
        q = torch.round((g - lo[..., None]) / torch.where(sf > 0, sf, 1.0)).clamp_(0, 15)
        exact = ((q * sf + lo[..., None]) == g).all(-1)
        if best_q is None:
            best_q, best_s, ok = q, cand.clone(), exact
        else:
            take = exact & ~ok
            best_q = torch.where(take[..., None], q, best_q)
            best_s = torch.where(take, cand, best_s)
            ok = ok | exact
        if bool(ok.all()):
            return best_q.view(n, k).to(torch.uint8), best_s, m
    return None


def pack_q4(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N/16, K/32, 16, 16], scales float16 [N/16, K/32, 2, 16]) in the kernel's layout."""
    n, k = q.shape
    nb, kc = n // COLS, k // GROUP
    # [nb, col, kc, pair row r, input of the pair] -> [nb, kc, r, col, pair]
    q5 = q.view(nb, COLS, kc, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    lo = q5[:, :, :, : COLS // 2].reshape(nb, kc, 16, 16)  # byte i: column i/2, input 2r + i%2
    hi = q5[:, :, :, COLS // 2:].reshape(nb, kc, 16, 16)  # columns 8 + i/2
    qweight = (lo | (hi << 4)).contiguous()
    scales = torch.stack([s.view(nb, COLS, kc), m.view(nb, COLS, kc)], dim=1).permute(0, 3, 1, 2).contiguous()
    return qweight, scales


def dequant_reference(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: s * q + m, the values find_q4 reproduces."""
    n, k = q.shape
    g = q.view(n, k // GROUP, GROUP).float()
    return (g * s.float()[..., None] + m.float()[..., None]).view(n, k)
