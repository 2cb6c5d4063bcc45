"""The attention backend interface the model calls, and the input checks every backend shares.

A backend does two things per layer and step: write the new tokens' K/V into the paged cache
(`write_kv`), then attend every new query token to its sequence's cached context (`forward`). The
batch layout and the cache layout are described in `engine/attention/metadata.py`.
"""

from __future__ import annotations

import abc

import torch

from engine.attention.metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class AttentionBackend(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store key/value [T, Hkv, D] at cache slots slot_mapping[T] (-1: skip that token)."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D] in q's dtype.

        `out`, when given, is a [T, Hq, D] tensor of q's dtype that receives the result (and is returned).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if k_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"k_cache dtype {k_cache.dtype} is not supported (use one of {SUPPORTED_DTYPES})")


def check_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    check_cache(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (hkv, d):
        raise ValueError(f"key must be [num_tokens, {hkv}, {d}] to match the cache, got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] (one slot per token), "
                         f"got {tuple(slot_mapping.shape)}")


def check_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> None:
    check_cache(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [num_tokens, num_heads, {d}], got {tuple(q.shape)}")
    if q.shape[1] % hkv != 0:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {hkv} KV heads")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if meta.query_start_loc.shape[0] != meta.num_seqs + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {meta.num_seqs + 1} entries, "
                         f"got {meta.query_start_loc.shape[0]}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != meta.num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={meta.num_seqs}, max_blocks], "
                         f"got {tuple(meta.block_tables.shape)}")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device} with unit last stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def host_lens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Per-sequence (query_lens, seq_lens) as Python ints, from the host copies when present."""
    if meta.query_lens_host and meta.seq_lens_host:
        return list(meta.query_lens_host), list(meta.seq_lens_host)
    qsl = meta.query_start_loc.tolist()
    return [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)], meta.seq_lens.tolist()


def check_lens(q_lens: list[int], seq_lens: list[int], num_tokens: int, block_size: int,
               max_blocks: int) -> None:
    if len(q_lens) != len(seq_lens):
        raise ValueError(f"query_start_loc describes {len(q_lens)} sequences but seq_lens has {len(seq_lens)}")
    if sum(q_lens) != num_tokens:
        raise ValueError(f"query_start_loc covers {sum(q_lens)} tokens but q has {num_tokens}")
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if ql < 0 or ql > sl:
            raise ValueError(f"sequence {i}: query length {ql} must be within 0..seq_len ({sl})")
        if sl > max_blocks * block_size:
            raise ValueError(f"sequence {i}: seq_len {sl} needs more than the block table's "
                             f"{max_blocks} blocks of {block_size}")
