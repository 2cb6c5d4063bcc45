"""The CPU bitmask apply masks exactly what xgrammar's own apply masks (random bitmasks, whole batch and a
subset of rows, a vocabulary that does not fill the last 32-bit word)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from engine.structured.bitmask import apply_bitmask_cpu


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [1, 4], [5]])
def test_cpu_apply_equals_xgrammar(rows):
    gen = torch.Generator().manual_seed(len(rows))
    vocab = 1000  # 31.25 words: the last word is partly padding
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = xgr.allocate_token_bitmask(6, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask_cpu(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    assert torch.equal(ours, theirs)
    masked = torch.isinf(ours).sum(dim=1)
    assert all(masked[i] > 0 for i in rows) and all(masked[i] == 0 for i in range(6) if i not in rows)
