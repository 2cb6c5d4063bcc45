"""The attention kernels at real model shapes in bfloat16, against torch SDPA and a float32 reference.

Llama-3-8B (32 query / 8 KV heads, GQA 4) and Qwen2.5-7B (28 / 4, GQA 7), head_dim 128, block size 16,
contexts up to 5000 tokens. Marked slow: in Triton's interpreter these take minutes; loadtest/gpu_check.sh
runs them compiled on a GPU. SDPA gets the same K/V gathered into contiguous tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention_cases import make_batch
from tests.engine.triton_setup import DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

K = load_kernels()
pytestmark = [pytest.mark.usefixtures("triton_mode"), pytest.mark.slow]
TritonAttentionBackend = K["triton_backend"].TritonAttentionBackend
SHAPES = {"llama3-8b": (8, 4), "qwen2.5-7b": (4, 7)}  # (KV heads, GQA group)
BF16_TOL = 2e-2


def sdpa(b) -> torch.Tensor:
    """Each sequence's new tokens over its context with F.scaled_dot_product_attention (causal within)."""
    bs, hkv, d = b.k_cache.shape[1], b.k_cache.shape[2], b.k_cache.shape[3]
    out = torch.empty_like(b.q)
    row = 0
    for i, (ql, sl) in enumerate(zip(b.q_lens, b.seq_lens, strict=True)):
        ids = b.meta.block_tables[i, : -(-sl // bs)].long()
        k = b.k_cache[ids].reshape(-1, hkv, d)[:sl].transpose(0, 1)[None]
        v = b.v_cache[ids].reshape(-1, hkv, d)[:sl].transpose(0, 1)[None]
        q = b.q[row:row + ql].transpose(0, 1)[None]
        mask = torch.arange(sl, device=q.device)[None, :] <= torch.arange(sl - ql, sl, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale, enable_gqa=True)
        out[row:row + ql] = o[0].transpose(0, 1)
        row += ql
    return out


def float32_reference(b) -> torch.Tensor:
    return TorchAttentionBackend().forward(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, b.scale)


def check(specs, shape: str, seed: int) -> None:
    hkv, group = SHAPES[shape]
    b = make_batch(specs, 16, hkv, group, 128, torch.bfloat16, seed=seed, device=DEVICE)
    out = torch.full_like(b.q, float("nan"))
    TritonAttentionBackend().forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert not out.isnan().any()
    ref32 = float32_reference(b)
    torch.testing.assert_close(out.float(), ref32, atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(out.float(), sdpa(b).float(), atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_mixed_lengths(shape):
    """One long sequence among short ones (per-sequence splits), block-boundary lengths."""
    check([(1, n) for n in (1, 15, 16, 17, 300, 2100, 5000, 40, 40, 40)], shape, seed=1)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_batch_64(shape):
    check([(1, 64 + 37 * i) for i in range(64)], shape, seed=2)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_extend_and_decode_mixed(shape):
    check([(300, 300), (128, 1128), (1, 2000), (17, 17), (1, 1)], shape, seed=3)
