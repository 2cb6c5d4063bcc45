"""Random paged-attention batches and a plain reference, shared by the attention and kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    q_lens: list[int]
    seq_lens: list[int]


def make_batch(specs: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, seed: int = 0, extra_blocks: int = 3, device: str = "cpu") -> Batch:
    """specs: (q_len, seq_len) per sequence. Physical blocks are shuffled; the whole cache is random."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(sl / block_size) for _, sl in specs]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)[: sum(need)].tolist()
    max_blocks = max(need) + 1  # one padding column, as a real table has
    tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    total = sum(ql for ql, _ in specs)
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    q_lens = [ql for ql, _ in specs]
    seq_lens = [sl for _, sl in specs]
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    slots = []
    for i, (ql, sl) in enumerate(specs):
        for pos in range(sl - ql, sl):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=tuple(q_lens), seq_lens_host=tuple(seq_lens))
    return Batch(q.to(device), k_cache.to(device), v_cache.to(device), meta, 1.0 / math.sqrt(head_dim),
                 q_lens, seq_lens)


def reference_attention(b: Batch) -> torch.Tensor:
    """Token by token, in float64: K/V read position by position through the block table."""
    bs, hkv = b.k_cache.shape[1], b.k_cache.shape[2]
    group = b.q.shape[1] // hkv
    kc, vc, q = b.k_cache.double().cpu(), b.v_cache.double().cpu(), b.q.double().cpu()
    tables = b.meta.block_tables.cpu().tolist()
    out = torch.empty_like(q)
    row = 0
    for i, (ql, sl) in enumerate(zip(b.q_lens, b.seq_lens, strict=True)):
        k = torch.stack([kc[tables[i][p // bs], p % bs] for p in range(sl)]).repeat_interleave(group, dim=1)
        v = torch.stack([vc[tables[i][p // bs], p % bs] for p in range(sl)]).repeat_interleave(group, dim=1)
        for t in range(ql):
            visible = sl - ql + t + 1
            scores = torch.einsum("hd,shd->hs", q[row], k[:visible]) * b.scale
            out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:visible])
            row += 1
    return out.to(b.q.dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    actual, expected = actual.cpu().double(), expected.cpu().double()
    assert torch.isfinite(actual).all(), "output has non-finite elements (unwritten or overflow)"
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def check_write_kv(backend, dtype: torch.dtype, qkv_views: bool = False) -> None:
    """backend.write_kv stores each token's K/V at its slot, skips slot -1 and leaves every other slot alone.
    qkv_views: key and value are head slices of one fused qkv tensor (row stride > Hkv * D), as in the model."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 8, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(6, 8, 2, 16, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, -1, 0, 47, 5, -1], dtype=torch.int64)
    if qkv_views:
        qkv = torch.randn(6, 8, 16, generator=gen).to(dtype)  # 4 q heads, 2 k heads, 2 v heads per row
        key, value = qkv[:, 4:6], qkv[:, 6:8]
    else:
        key = torch.randn(6, 2, 16, generator=gen).to(dtype)
        value = torch.randn(6, 2, 16, generator=gen).to(dtype)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    k_exp, v_exp = k_before.view(-1, 2, 16).clone(), v_before.view(-1, 2, 16).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_exp[s], v_exp[s] = key[t], value[t]
    assert torch.equal(k_cache.view(-1, 2, 16), k_exp) and torch.equal(v_cache.view(-1, 2, 16), v_exp)
