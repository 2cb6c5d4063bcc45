"""What one forward pass tells the attention backend about the flattened batch.

The batch is flattened: the new tokens of every scheduled sequence, one after another (prefill
chunks and single decode tokens mixed). Sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1]; its new tokens sit at positions
seq_lens[i] - q_len_i .. seq_lens[i] - 1 and attend causally to every earlier position of the same
sequence, which the backend reads from the paged cache through block_tables[i] (K/V of the new
tokens are written into the cache first, at slot_mapping).

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim];
slot s is block s // block_size, offset s % block_size. slot_mapping -1 means "do not write".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host copies, so backends can plan without device syncs
    query_lens_host: tuple[int, ...] = ()
    seq_lens_host: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
