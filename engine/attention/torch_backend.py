"""Paged attention in plain PyTorch: the CPU production path and the reference for the kernels.

Decode sequences (one new token) are handled together, vectorized: their blocks are gathered into
[B, L, Hkv, D], positions past each seq_len are masked, and grouped-query attention folds the
query heads to [B, Hkv, G, D] so K/V are never repeated. Sequences with several new tokens
(prefill chunks, possibly over a cached prefix) run one scaled_dot_product_attention each, with the
causal mask shifted by the prefix length. Reduced-precision inputs accumulate in float32 inside SDPA.
Gathered blocks land in a workspace reused across layers and steps (no page faults on fresh buffers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import (
    AttentionBackend,
    check_forward,
    check_lens,
    check_write,
    host_lens,
    output_for,
)
from engine.attention.metadata import AttentionMetadata

# Upper bound on the K (and again V) elements gathered at once for a group of decode sequences,
# so a large batch with long contexts is processed in a few vectorized groups, not one huge copy.
_DECODE_GATHER_ELEMENTS = 1 << 23


class _Workspace:
    """Two growable flat buffers (K and V) that gathered blocks are copied into."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]

    def gather(self, cache: torch.Tensor, ids: torch.Tensor, which: int) -> torch.Tensor:
        """cache[ids] ([n, block_size, Hkv, D]) in workspace buffer `which` (valid until the next gather)."""
        shape = (ids.numel(),) + tuple(cache.shape[1:])
        need = ids.numel() * cache[0].numel()
        buf = self._bufs[which]
        if buf is None or buf.numel() < need or buf.dtype != cache.dtype or buf.device != cache.device:
            grown = need if buf is None or buf.dtype != cache.dtype else max(need, buf.numel() * 5 // 4)
            buf = self._bufs[which] = torch.empty(grown, dtype=cache.dtype, device=cache.device)
        return torch.index_select(cache, 0, ids, out=buf[:need].view(shape))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._ws = _Workspace()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        check_write(key, value, k_cache, v_cache, slot_mapping)
        if key.shape[0] == 0:
            return
        _, _, hkv, d = k_cache.shape
        slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        k_cache.view(-1, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        check_forward(q, k_cache, v_cache, meta)
        q_lens, seq_lens = host_lens(meta)
        block_size = k_cache.shape[1]
        check_lens(q_lens, seq_lens, q.shape[0], block_size, meta.block_tables.shape[1])
        out = output_for(q, out)
        if q.shape[0] == 0:
            return out
        if all(ql == 1 for ql in q_lens):
            self._decode(q, k_cache, v_cache, meta.block_tables, seq_lens, scale, out)
            return out
        starts = meta.query_start_loc.tolist()
        decode = [i for i, ql in enumerate(q_lens) if ql == 1]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=q.device)
            tables = meta.block_tables[torch.tensor(decode, device=q.device)]
            res = torch.empty((len(decode),) + tuple(q.shape[1:]), dtype=q.dtype, device=q.device)
            self._decode(q[rows], k_cache, v_cache, tables, [seq_lens[i] for i in decode], scale, res)
            out[rows] = res
        for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
            if ql > 1:
                s = starts[i]
                out[s:s + ql] = self._extend_one(q[s:s + ql], k_cache, v_cache, meta.block_tables[i], sl, scale)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: list[int], scale: float, out: torch.Tensor) -> None:
        """One query token per sequence: out[b] = attention of q[b] ([B, Hq, D]) over seq_lens[b] tokens."""
        _, block_size, hkv, d = k_cache.shape
        groups = _decode_groups(seq_lens, block_size, hkv * d)
        if len(groups) == 1:
            out.copy_(self._decode_group(q, k_cache, v_cache, block_tables, seq_lens, scale))
            return
        for group in groups:
            idx = torch.tensor(group, device=q.device)
            out[idx] = self._decode_group(q[idx], k_cache, v_cache, block_tables[idx],
                                          [seq_lens[b] for b in group], scale)

    def _decode_group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
        b, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        nblk = -(-max(seq_lens) // block_size)
        length = nblk * block_size
        ids = block_tables[:, :nblk].reshape(-1).to(torch.long)
        k = self._ws.gather(k_cache, ids, 0).view(b, length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        v = self._ws.gather(v_cache, ids, 1).view(b, length, hkv, d).transpose(1, 2)
        lens = torch.tensor(seq_lens, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] < lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k, v,
                                           attn_mask=mask[:, None, None, :], scale=scale)  # [B, Hkv, G, D]
        return o.reshape(b, hq, d)

    def _extend_one(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        """q [ql, Hq, D] are positions seq_len-ql .. seq_len-1; query i sees keys 0 .. seq_len-ql+i."""
        ql, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        ids = block_table[: -(-seq_len // block_size)].to(torch.long)
        k = self._ws.gather(k_cache, ids, 0).view(-1, hkv, d)[:seq_len].transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = self._ws.gather(v_cache, ids, 1).view(-1, hkv, d)[:seq_len].transpose(0, 1)[None]
        mask = None
        if ql != seq_len:
            pos = torch.arange(seq_len - ql, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                           is_causal=ql == seq_len, scale=scale, enable_gqa=hq != hkv)
        return o[0].transpose(0, 1)


def _decode_groups(seq_lens: list[int], block_size: int, elems_per_token: int) -> list[list[int]]:
    """Split decode sequences (longest first) into groups whose padded gather stays under the bound."""
    longest = -(-max(seq_lens) // block_size) * block_size
    if len(seq_lens) * longest * elems_per_token <= _DECODE_GATHER_ELEMENTS:
        return [list(range(len(seq_lens)))]
    order = sorted(range(len(seq_lens)), key=lambda b: -seq_lens[b])
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_len = 0
    for b in order:
        if not cur:
            cur_len = -(-seq_lens[b] // block_size) * block_size
        elif (len(cur) + 1) * cur_len * elems_per_token > _DECODE_GATHER_ELEMENTS:
            groups.append(cur)
            cur, cur_len = [], -(-seq_lens[b] // block_size) * block_size
        cur.append(b)
    if cur:
        groups.append(cur)
    return groups
