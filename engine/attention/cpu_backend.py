"""Paged attention on CPUs with the fused C++ kernels (`engine/kernels/attention_ops.cpp`).

Decode tokens (one new token per sequence) are attended by one kernel call per layer that reads each
sequence's K/V straight from its cache blocks (no gather into a padded copy, no mask); grouped-query
heads share every K/V row they read. Short prefills and extends ride in the same call: query j of an
extend is a decode over the first seq_len - q_len + j + 1 keys of its blocks. Long ones run over their
gathered context in our flash kernel (`prefill_attention.cpp`, AVX-512 BF16 dot products: 2.4-10x
PyTorch's flash attention on a 2-core AMD EPYC without AMX) for bf16 where the CPU has those instructions,
else in scaled_dot_product_attention's (over a cached prefix in two unmasked passes,
engine/attention/extend_sdpa.py). The KV write
is one call that copies each token's heads to its slot.

Under --deterministic (`CpuAttentionBackend(deterministic=True)`) every query row, prefill and extend rows too,
is a decode row of the same kernel, and each context is split at fixed places (runs of DETERMINISTIC_SPLIT_TOKENS
keys from the first) whatever the batch: a token attends in one way whether it is decoded, prefilled cold or
prefilled over a cached prefix, alone or beside any other rows.

Everything that depends only on the step's metadata (validation, which rows decode, their block tables,
each extend's block ids) is worked out once per step, not once per layer: the plan is kept for
as long as the same AttentionMetadata object comes back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import check_forward, check_lens, check_write, host_lens, output_for
from engine.attention.extend_sdpa import extend_attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu_ops

KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels read; float16 takes the torch path
# extends at most this big (query rows x context, and context) run in the decode kernel; larger ones in SDPA
KERNEL_EXTEND_WORK = 64 * 1024
KERNEL_EXTEND_CONTEXT = 1024
# where our prefill kernel runs (bf16, AVX-512 BF16), an extend runs as decode rows only below these: one of
# 64 new tokens with its gather is 1.4x faster there, 32 over a 512-token prefix 1.3x, 16 over 512 0.95x
OWN_EXTEND_MIN_Q = 20
OWN_EXTEND_WORK = 2048
PREFILL_HEAD_DIMS = (64, 128)  # what prefill_attention_ is built for
DETERMINISTIC_SPLIT_TOKENS = 256  # --deterministic: each context's keys in runs of this many (whole blocks)


@dataclass(frozen=True)
class _Extend:
    start: int  # first query row
    q_len: int
    seq_len: int
    block_ids: torch.Tensor  # int64, the blocks holding its context


@dataclass(frozen=True)
class _Plan:
    decode_rows: slice | torch.Tensor | None  # rows the kernel attends; None: none, slice: rows 0..n-1
    decode_tables: torch.Tensor | None  # int32 contiguous [n, max_blocks], each row's sequence's table
    decode_lens: torch.Tensor | None  # int32 [n], the keys each row sees
    extends: tuple[_Extend, ...]
    split_blocks: int  # paged_decode_'s runs: 0, split by threads; > 0, fixed (--deterministic)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, deterministic: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        ops = cpu_ops.ops()
        self._write_kv, self._paged_decode_ = ops.write_kv, ops.paged_decode_
        # long bf16 extends: our flash kernel on AVX-512 BF16 where the CPU has it (prefill_attention.cpp)
        self._prefill_kernel = bool(ops.prefill_attention_available())
        self._prefill_attention_ = ops.prefill_attention_
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None
        self._plan_key: tuple = ()
        self._write_key: tuple = ()
        self._write_slots: torch.Tensor | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # every layer of a step writes the same shapes at the same slots: check them once per step
        write_key = (key.shape, key.dtype, value.shape, value.dtype, k_cache.shape, k_cache.dtype,
                     v_cache.shape, v_cache.dtype)
        if slot_mapping is not self._write_slots or write_key != self._write_key:
            check_write(key, value, k_cache, v_cache, slot_mapping)
            self._write_slots, self._write_key = slot_mapping, write_key
        if k_cache.dtype not in KERNEL_DTYPES or key.dtype != k_cache.dtype or value.dtype != k_cache.dtype \
                or key.stride(-1) != 1 or value.stride(-1) != 1:
            return super().write_kv(key, value, k_cache, v_cache, slot_mapping)
        self._write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.long))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] == 0 or q.dtype not in KERNEL_DTYPES:
            if self.deterministic and q.shape[0]:
                raise ValueError(f"--deterministic attends {KERNEL_DTYPES} on CPUs, not {q.dtype}")
            return super().forward(q, k_cache, v_cache, meta, scale, out)
        plan = self._plan_for(q, k_cache, v_cache, meta)
        out = output_for(q, out)
        rows = plan.decode_rows
        if isinstance(rows, slice):
            dst = out[rows]
            direct = dst.is_contiguous()
            res = dst if direct else torch.empty_like(dst, memory_format=torch.contiguous_format)
            self._paged_decode_(res, q[rows], k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale,
                                plan.split_blocks)
            if not direct:
                dst.copy_(res)
        elif rows is not None:
            res = torch.empty((rows.numel(),) + tuple(q.shape[1:]), dtype=q.dtype)
            self._paged_decode_(res, q.index_select(0, rows), k_cache, v_cache, plan.decode_tables, plan.decode_lens,
                                scale, plan.split_blocks)
            out.index_copy_(0, rows, res)
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        own_kernel = self._own_kernel(q, d) and out.is_contiguous()
        for e in plan.extends:
            k = self._ws.gather(k_cache, e.block_ids, 0).view(-1, hkv, d)[: e.seq_len]
            v = self._ws.gather(v_cache, e.block_ids, 1).view(-1, hkv, d)[: e.seq_len]
            if own_kernel:
                self._prefill_attention_(out[e.start:e.start + e.q_len], q[e.start:e.start + e.q_len], k, v, scale)
                continue
            qe = q[e.start:e.start + e.q_len].transpose(0, 1)[None]
            o = extend_attention(qe, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
            out[e.start:e.start + e.q_len] = o[0].transpose(0, 1)
        return out

    def decode_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, num_tokens: int,
                    num_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a caller that runs a step's layers itself (engine/model/cpu_decode_stack.py): where forward() would
        attend every one of the step's rows as a decode row of paged_decode_ (decodes, speculative verification,
        short extends), the block tables, key counts and split it would pass, validated once; else None."""
        if self.deterministic or dtype not in KERNEL_DTYPES or num_tokens == 0:
            return None
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        # strided like the layers' q (a view of the fused qkv rows), so their forward() finds this plan kept
        q = torch.empty((num_tokens, num_heads + 2 * hkv, d), dtype=dtype)[:, :num_heads]
        plan = self._plan_for(q, k_cache, v_cache, meta)
        if not isinstance(plan.decode_rows, slice) or plan.decode_rows != slice(0, num_tokens) or plan.extends:
            return None
        return plan.decode_tables, plan.decode_lens, plan.split_blocks

    def _own_kernel(self, q: torch.Tensor, head_dim: int) -> bool:
        return self._prefill_kernel and q.dtype == torch.bfloat16 and head_dim in PREFILL_HEAD_DIMS \
            and q.stride(1) == head_dim

    def _plan_for(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> _Plan:
        key = (q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype)
        if meta is self._plan_meta and key == self._plan_key and self._plan is not None:
            return self._plan  # every layer of a step: same metadata, same shapes
        check_forward(q, k_cache, v_cache, meta)
        q_lens, seq_lens = host_lens(meta)
        block_size = k_cache.shape[1]
        check_lens(q_lens, seq_lens, q.shape[0], block_size, meta.block_tables.shape[1])
        # Rows the kernel attends: every decode token, and every token of a short extend (query j of a
        # sequence sees keys 0 .. seq_len - q_len + j: a decode with that length over the same blocks).
        # Long extends go to our prefill kernel, or SDPA, whose matrix products win there.
        own = self._own_kernel(q, k_cache.shape[3])
        seq_of_row: list[int] = []
        row_lens: list[int] = []
        extends = []
        start = 0
        for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
            if self.deterministic or _small(ql, sl, own):
                seq_of_row.extend([i] * ql)
                row_lens.extend(range(sl - ql + 1, sl + 1))
            elif ql > 1:
                ids = meta.block_tables[i, : -(-sl // block_size)].to(torch.long)
                extends.append(_Extend(start, ql, sl, ids))
            start += ql
        rows = tables = lens = None
        if seq_of_row:
            n = len(seq_of_row)
            lens = torch.tensor(row_lens, dtype=torch.int32)
            if n == len(q_lens) and n == q.shape[0]:  # decode only: one row per sequence, in order
                rows, tables = slice(0, n), _int32(meta.block_tables)
            else:
                row_ids = [r for r, (i, _) in enumerate(_rows_of(q_lens))
                           if self.deterministic or _small(q_lens[i], seq_lens[i], own)]
                tables = _int32(meta.block_tables[torch.tensor(seq_of_row)])
                rows = slice(0, n) if row_ids == list(range(n)) else torch.tensor(row_ids)
        split = max(1, DETERMINISTIC_SPLIT_TOKENS // block_size) if self.deterministic else 0
        self._plan_meta, self._plan_key, self._plan = meta, key, _Plan(rows, tables, lens, tuple(extends), split)
        return self._plan


def _small(q_len: int, seq_len: int, own_kernel: bool) -> bool:
    """Whether an extend runs as decode rows (else through the prefill kernel, or SDPA without it)."""
    if own_kernel:
        return q_len < OWN_EXTEND_MIN_Q or q_len * seq_len <= OWN_EXTEND_WORK
    return q_len == 1 or (q_len * seq_len <= KERNEL_EXTEND_WORK and seq_len <= KERNEL_EXTEND_CONTEXT)


def _rows_of(q_lens: list[int]):
    """(sequence, j) for every query row of the flattened batch, in order."""
    for i, ql in enumerate(q_lens):
        for j in range(ql):
            yield i, j


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
