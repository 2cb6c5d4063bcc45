"""Persistent inputs of decode-only steps: device buffers filled in place, not rebuilt per step.

A decode step gives every scheduled sequence one new token. Its inputs live in buffers allocated once
for max_num_seqs rows: token ids, sequence lengths and block tables are written into host mirrors
(pinned memory on CUDA) and sent with non-blocking copies; positions and slots are derived from them
on the device. A row's block table is written only where it changed: a row that holds the same
sequence as in the last decode step gets only its newly allocated blocks; any other row is rewritten
(also when its last known block changed: copy-on-write replaced it). After a step that was not decode-only, every row
is rewritten (a preempted sequence comes back through a prefill, with new blocks).

Rows past the batch (padding up to a CUDA-graph bucket) have length 0: no KV write (slot -1), no
attention read. The host mirrors are rewritten only after the previous step's results were read on the
host (the sampled tokens), which waits for the device, so no copy is still reading them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.attention.metadata import AttentionMetadata
from engine.scheduler import ScheduledSeq


class DecodeInputs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        if max_num_seqs < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_blocks_per_seq ({max_blocks_per_seq}) "
                             "must be >= 1")
        self.max_num_seqs, self.max_blocks, self.block_size, self.device = (
            max_num_seqs, max_blocks_per_seq, block_size, device)
        pin = device.type == "cuda"
        n, w = max_num_seqs, max_blocks_per_seq

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self._ids_h, self._lens_h, self._bt_h = host(n, torch.long), host(n, torch.int32), host((n, w), torch.int32)
        self._ids_np, self._lens_np, self._bt_np = self._ids_h.numpy(), self._lens_h.numpy(), self._bt_h.numpy()
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, w), dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._row_seq: list[int | None] = [None] * n  # seq_id whose table row i holds
        self._row_blocks = [0] * n  # how many of its blocks are written
        self.rows_rewritten = 0  # counters, for tests
        self.blocks_written = 0

    def fits(self, scheduled: Seq[ScheduledSeq]) -> bool:
        """Whether the buffers hold this step (forked sequences can outnumber max_num_seqs for a while)."""
        return len(scheduled) <= self.max_num_seqs and all(len(it.seq.block_table) <= self.max_blocks
                                                           for it in scheduled)

    def invalidate(self) -> None:
        """Forget what the rows hold (after a step that was not decode-only)."""
        self._row_seq = [None] * self.max_num_seqs

    def fill(self, scheduled: Seq[ScheduledSeq], padded: int | None = None) -> tuple[int, int]:
        """Write one decode step's inputs for `scheduled` (rows 0..n-1), rows n..padded-1 as padding; returns
        (the longest sequence length, the most blocks of one sequence). Only host mirrors are written and
        copied: no device synchronisation."""
        n = len(scheduled)
        padded = padded or n
        if padded > self.max_num_seqs:
            raise ValueError(f"a decode step of {padded} sequences exceeds max_num_seqs {self.max_num_seqs}")
        bt, width, longest = self._bt_np, 0, 0
        for i, item in enumerate(scheduled):
            seq = item.seq
            c = seq.num_computed_tokens
            self._ids_np[i] = seq.token_ids[c]
            self._lens_np[i] = c + 1
            longest = max(longest, c + 1)
            table = seq.block_table
            nb = len(table)
            if nb > self.max_blocks:
                raise ValueError(f"sequence {seq.seq_id} holds {nb} blocks, more than max_blocks_per_seq "
                                 f"{self.max_blocks}")
            known = self._row_blocks[i] if self._row_seq[i] == seq.seq_id else 0
            if known > nb or (known and bt[i, known - 1] != table[known - 1]):
                known = 0
            if known == 0:
                self.rows_rewritten += 1
            if nb > known:
                bt[i, known:nb] = table[known:nb]
                self.blocks_written += nb - known
            self._row_seq[i], self._row_blocks[i] = seq.seq_id, nb
            width = max(width, nb)
        if padded > n:
            self._lens_np[n:padded] = 0
        self.input_ids[:padded].copy_(self._ids_h[:padded], non_blocking=True)
        self.seq_lens[:padded].copy_(self._lens_h[:padded], non_blocking=True)
        self.block_tables[:n, :width].copy_(self._bt_h[:n, :width], non_blocking=True)
        return longest, width

    def derive(self, padded: int) -> None:
        """positions = seq_lens - 1 and each token's cache slot, on the device, into the persistent buffers
        (also inside a CUDA graph: it reads only device buffers). Padding rows (length 0) get slot -1."""
        lens = self.seq_lens[:padded].long()
        pos = self.positions[:padded]
        torch.clamp(lens - 1, min=0, out=pos)
        blk = self.block_tables[:padded].gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1).long()
        slot = (blk * self.block_size + pos % self.block_size).masked_fill_(lens == 0, -1)
        self.slot_mapping[:padded].copy_(slot)

    def metadata(self, padded: int, longest: int, width: int | None = None) -> AttentionMetadata:
        """The step's AttentionMetadata over rows 0..padded-1 (views of the persistent buffers; the host
        lengths come from the host mirror, for backends that plan on the host)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded], query_start_loc=self.query_start_loc[:padded + 1],
            seq_lens=self.seq_lens[:padded], block_tables=self.block_tables[:padded, :width or self.max_blocks],
            max_query_len=1, max_seq_len=longest, query_lens_host=(1,) * padded,
            seq_lens_host=tuple(self._lens_np[:padded].tolist()))
