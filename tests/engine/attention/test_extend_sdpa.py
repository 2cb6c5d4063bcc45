"""The two-pass extend attention equals one masked scaled_dot_product_attention (float32: to rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import extend_sdpa
from engine.attention.extend_sdpa import extend_attention


def _case(q_len: int, seq_len: int, heads: int, kv_heads: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(q_len * 7919 + seq_len)
    # the engine's layouts: K/V gathered as [seq, kv_heads, d] and transposed, q a slice of [tokens, heads, d]
    k = torch.randn(seq_len, kv_heads, 64, generator=g).to(dtype).transpose(0, 1)[None]
    v = torch.randn(seq_len, kv_heads, 64, generator=g).to(dtype).transpose(0, 1)[None]
    q = torch.randn(q_len + 3, heads, 64, generator=g).to(dtype)[2:2 + q_len].transpose(0, 1)[None]
    pos = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= pos[:, None]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                         enable_gqa=heads != kv_heads)
    return q, k, v, ref


@pytest.mark.parametrize("q_len,seq_len,heads,kv_heads", [
    (300, 1000, 9, 3),  # SmolLM2's grouped heads, a chunk over a cached prefix
    (513, 2049, 8, 8),  # no grouping, lengths off the block size
    (2, 40, 4, 1),  # a tiny extend, one KV head
    (64, 64, 9, 3),  # no prefix: plain causal
])
def test_equals_the_masked_call(q_len, seq_len, heads, kv_heads):
    q, k, v, ref = _case(q_len, seq_len, heads, kv_heads)
    got = extend_attention(q, k, v, 0.125)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


def test_bfloat16_stays_within_bfloat16_rounding():
    q, k, v, ref = _case(256, 1024, 9, 3, torch.bfloat16)
    got = extend_attention(q, k, v, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_without_the_flash_operator_the_masked_call_gives_the_same(monkeypatch):
    q, k, v, ref = _case(100, 400, 9, 3)
    monkeypatch.setattr(extend_sdpa, "_FLASH", None)
    torch.testing.assert_close(extend_attention(q, k, v, 0.125), ref, atol=2e-6, rtol=2e-5)
