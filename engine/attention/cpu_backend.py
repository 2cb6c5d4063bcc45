"""Paged attention on CPUs with the fused C++ kernels (`engine/kernels/cpu_ops.cpp`).

Decode tokens (one new token per sequence) are attended by one kernel call per layer that reads each
sequence's K/V straight from its cache blocks (no gather into a padded copy, no mask); grouped-query
heads share every K/V row they read. The KV write is one call that copies each token's heads to its
slot. Prefill and extend rows (several new tokens) keep the torch backend's scaled_dot_product_attention,
which is already efficient for them.
"""

from __future__ import annotations

import torch

from engine.attention.backend import check_forward, check_write, output_for
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels read; float16 takes the torch path


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        check_write(key, value, k_cache, v_cache, slot_mapping)
        if k_cache.dtype not in KERNEL_DTYPES or key.dtype != k_cache.dtype or value.dtype != k_cache.dtype \
                or key.stride(-1) != 1 or value.stride(-1) != 1:
            return super().write_kv(key, value, k_cache, v_cache, slot_mapping)
        torch.ops.kvfleet_cpu.write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.long))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        if meta.max_query_len != 1 or q.shape[0] == 0 or q.dtype not in KERNEL_DTYPES:
            return super().forward(q, k_cache, v_cache, meta, scale, out)
        check_forward(q, k_cache, v_cache, meta)
        if q.shape[0] != meta.num_seqs:
            raise ValueError(f"a decode batch has one query row per sequence: {q.shape[0]} rows, "
                             f"{meta.num_seqs} sequences")
        out = output_for(q, out)
        dst = out if out.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
        torch.ops.kvfleet_cpu.paged_decode_(dst, q, k_cache, v_cache, _int32(meta.block_tables),
                                            _int32(meta.seq_lens), scale)
        if dst is not out:
            out.copy_(dst)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: list[int], scale: float, out: torch.Tensor) -> None:
        """The decode rows of a mixed batch (called by the torch backend's forward)."""
        if q.dtype not in KERNEL_DTYPES:
            return super()._decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        res = torch.empty_like(q, memory_format=torch.contiguous_format)
        torch.ops.kvfleet_cpu.paged_decode_(res, q.contiguous(), k_cache, v_cache, _int32(block_tables), lens, scale)
        out.copy_(res)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()

