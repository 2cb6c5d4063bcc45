"""The GPU attention backend: Triton kernels for the KV write, paged decode and prefill/extend.

Per step the batch is split once (the plan is cached for the metadata object shared by all layers):
sequences with one new token go to the split-KV paged decode kernel, sequences with several new
tokens to the extend kernel; both write straight into the output rows of their tokens. A decode-only
step reads nothing on the host (the split count per sequence is decided on the device, the partial
results go to a workspace reused across layers and steps), so it can be captured in a CUDA graph.
On CPU tensors it runs only under the Triton interpreter (TRITON_INTERPRET=1), for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import (
    AttentionBackend,
    check_forward,
    check_lens,
    check_write,
    host_lens,
    output_for,
)
from engine.attention.metadata import AttentionMetadata
from engine.kernels.extend_attention import extend_attention
from engine.kernels.kv_write import kv_write
from engine.kernels.paged_decode import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    DecodeLaunch,
    DecodeWorkspace,
    grid_splits,
    paged_decode,
)

_INTERPRETER_SMS = 4  # pretend SM count under the interpreter, so long contexts exercise split-KV


@dataclass(frozen=True)
class _Plan:
    decode_ids: torch.Tensor  # [num_decode] int32 sequence indices with one new token
    extend_ids: torch.Tensor  # [num_extend] int32 sequence indices with several new tokens
    extend_max_query_len: int
    num_kv_heads: int
    num_splits: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None, decode_launch: DecodeLaunch | None = None,
                 min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT):
        """num_splits fixes the decode grid's split dimension and decode_launch the decode kernel's launch
        shape (tests, benchmarks); None picks them per batch size. A sequence is split only into pieces
        of at least min_tokens_per_split tokens."""
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        if min_tokens_per_split < 1:
            raise ValueError(f"min_tokens_per_split must be >= 1, got {min_tokens_per_split}")
        self._forced_splits = num_splits
        self._decode_launch = decode_launch
        self._min_tokens = min_tokens_per_split
        self._workspace = DecodeWorkspace()
        self._arange: torch.Tensor | None = None
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None
        self._num_sms: dict[torch.device, int] = {}

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        check_write(key, value, k_cache, v_cache, slot_mapping)
        kv_write(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        check_forward(q, k_cache, v_cache, meta)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("k_cache and v_cache must be contiguous for the triton backend")
        plan = self._plan_for(meta, q, k_cache)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = output_for(q, out)
        tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
        paged_decode(q, k_cache, v_cache, out, tables, meta.seq_lens, meta.query_start_loc, plan.decode_ids,
                     scale, plan.num_splits, self._decode_launch, self._workspace, self._min_tokens)
        extend_attention(q, k_cache, v_cache, out, tables, meta.seq_lens, meta.query_start_loc, plan.extend_ids,
                         plan.extend_max_query_len, scale)
        return out

    def _plan_for(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> _Plan:
        hkv = k_cache.shape[2]
        if meta is self._meta and self._plan is not None and self._plan.num_kv_heads == hkv:
            return self._plan
        dev = q.device
        num_seqs = meta.num_seqs
        if meta.is_decode_only:  # nothing read on the host: graph-safe
            decode_ids, extend_ids, num_decode, extend_max = self._seq_range(num_seqs, dev), self._seq_range(0, dev), num_seqs, 0
        else:
            q_lens, seq_lens = host_lens(meta)
            check_lens(q_lens, seq_lens, q.shape[0], k_cache.shape[1], meta.block_tables.shape[1])
            decode = [i for i, ql in enumerate(q_lens) if ql == 1]
            extend = [i for i, ql in enumerate(q_lens) if ql > 1]
            decode_ids = torch.tensor(decode, dtype=torch.int32, device=dev)
            extend_ids = torch.tensor(extend, dtype=torch.int32, device=dev)
            num_decode, extend_max = len(decode), max((q_lens[i] for i in extend), default=0)
        splits = self._forced_splits or grid_splits(num_decode, hkv, self._sms(dev))
        plan = _Plan(decode_ids, extend_ids, extend_max, hkv, splits)
        self._meta, self._plan = meta, plan
        return plan

    def _seq_range(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n) as int32, a view of one tensor kept for the backend's life (a stable address)."""
        if self._arange is None or self._arange.numel() < n or self._arange.device != device:
            self._arange = torch.arange(max(n, 256), dtype=torch.int32, device=device)
        return self._arange[:n]

    def reserve(self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                device: torch.device | str) -> None:
        """Allocate the decode workspace and sequence index for up to max_num_seqs decodes now, so no later
        step (or CUDA-graph capture) allocates."""
        import triton

        dev = torch.device(device)
        self._seq_range(max_num_seqs, dev)
        block_d = max(16, triton.next_power_of_2(head_dim))
        worst = max(range(1, max_num_seqs + 1),
                    key=lambda n: n * (self._forced_splits or grid_splits(n, num_kv_heads, self._sms(dev))))
        grid = self._forced_splits or grid_splits(worst, num_kv_heads, self._sms(dev))
        self._workspace.get(worst, num_heads, grid, block_d, dev)

    def kernel_variants(self, config, dtype: torch.dtype, block_size: int, max_num_seqs: int,
                        device: torch.device | str, lora_rank: int = 0) -> list:
        """Every Triton kernel variant an engine on this backend compiles (engine/kernels/variants.py), for
        batches of up to max_num_seqs decodes on `device` under this backend's split policy and launch."""
        from engine.kernels.variants import decode_split_counts, engine_variants

        counts = decode_split_counts(max_num_seqs, config.num_kv_heads, self._sms(torch.device(device)),
                                     self._forced_splits)
        return engine_variants(config, dtype, block_size, counts, lora_rank, self._decode_launch)

    def _sms(self, device: torch.device) -> int:
        if device.type != "cuda":
            return _INTERPRETER_SMS
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]
