"""Exact group-quantized weights: find them in float32 checkpoint tensors and pack them for the CPU kernels.

GGUF checkpoints store weights in groups of 32 inputs with float16 scales: Q4_1 as w = s * q + m with
q in 0..15 (Q4_0 groups too where their values span all 16 levels), Q8_0 as w = d * q with q in
-128..127. Dequantized to float32 (what the GGUF converter writes), each value is exactly that
expression rounded once. `find_q4` / `find_q8` recover (q, scales) from such a tensor and accept them
only if they reproduce every float32 value bit for bit; any other tensor (a float checkpoint) yields
None. `pack_q4` / `pack_q8` lay them out for `q4_linear` / `q8_linear` (engine/kernels/quant_gemm.cpp),
which read 0.625 / 1.03 bytes per weight instead of bf16's 2 and dequantize to exactly the bf16 weights
the model holds.
"""

from __future__ import annotations

import torch

GROUP = 32
COLS = 16


def _groups(weight: torch.Tensor) -> torch.Tensor | None:
    """weight as [N, K/32, 32] if it is a float32 matrix of whole 16-row blocks and 32-input groups."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if k % GROUP or n % COLS or n == 0:
        return None
    return weight.view(n, k // GROUP, GROUP)


def _exact_scales(scale: torch.Tensor, fit) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per group, the float16 `scale` or one of its two neighbours for which fit(scale as float32 [.., 1])
    -> (q, exact per group) reproduces the group exactly: (q, scale) once every group is, else None."""
    best_q, best_s, ok = None, None, None
    for cand in (scale, torch.nextafter(scale, torch.full_like(scale, float("inf"))),
                 torch.nextafter(scale, torch.zeros_like(scale))):
        q, exact = fit(cand.float()[..., None])
        if best_q is None:
            best_q, best_s, ok = q, cand.clone(), exact
        else:
            take = exact & ~ok
            best_q = torch.where(take[..., None], q, best_q)
            best_s = torch.where(take, cand, best_s)
            ok = ok | exact
        if bool(ok.all()):
            return best_q, best_s
    return None


def find_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K], s float16 [N, K/32], m float16 [N, K/32]) with s * q + m == weight exactly, else None."""
    g = _groups(weight)
    if g is None:
        return None
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.half()
    if not torch.equal(m.float(), lo):  # the group minimum is m itself (q = 0 is always used)
        return None

    def fit(sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round((g - lo[..., None]) / torch.where(sf > 0, sf, 1.0)).clamp_(0, 15)
        return q, ((q * sf + lo[..., None]) == g).all(-1)

    found = _exact_scales(((hi - lo) / 15).half(), fit)  # s nearest (max - min) / 15, or a neighbour
    return None if found is None else (found[0].view(weight.shape).to(torch.uint8), found[1], m)


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


def find_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [N, K], d float16 [N, K/32]) with d * q == weight exactly, else None."""
    g = _groups(weight)
    if g is None:
        return None

    def fit(df: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round(g / torch.where(df > 0, df, 1.0)).clamp_(-128, 127)
        return q, ((q * df) == g).all(-1)

    found = _exact_scales((g.abs().amax(-1) / 127).half(), fit)  # the largest magnitude is 127 d (Q8_0's rounding)
    return None if found is None else (found[0].view(weight.shape).to(torch.int8), found[1])


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [N/16, K/32, 16, 32], scales float16 [N/16, K/32, 16]) in the kernel's layout."""
    n, k = q.shape
    nb, kc = n // COLS, k // GROUP
    # [nb, col, kc, pair row r, input of the pair] -> [nb, kc, r, col, pair]: element e = col * 2 + pair
    qweight = q.view(nb, COLS, kc, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(nb, kc, 16, 32).contiguous()
    scales = d.view(nb, COLS, kc).permute(0, 2, 1).contiguous()
    return qweight, scales


def dequant_reference_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d * q, the values find_q8 reproduces."""
    n, k = q.shape
    return (q.view(n, k // GROUP, GROUP).float() * d.float()[..., None]).view(n, k)
