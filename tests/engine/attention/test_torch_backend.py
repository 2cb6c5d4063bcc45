"""The torch attention backend against a plain token-by-token reference, and the backend selector."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention import torch_backend as tb
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention_cases import assert_close, check_write_kv, make_batch, reference_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKEND = TorchAttentionBackend()


def lens_for(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 300]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim",
                         [(8, 2, 1, 64), (16, 1, 3, 64), (32, 2, 4, 128), (16, 1, 8, 128)])
def test_decode_batch_matches_reference(dtype, block_size, num_kv_heads, group, head_dim):
    specs = [(1, sl) for sl in lens_for(block_size)]
    b = make_batch(specs, block_size, num_kv_heads, group, head_dim, dtype, seed=block_size + group)
    out = BACKEND.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.shape == b.q.shape and out.dtype == dtype
    assert_close(out, reference_attention(b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group", [(8, 1), (16, 4), (32, 3)])
def test_prefill_extend_and_mixed_batch_matches_reference(dtype, block_size, group):
    bs = block_size
    specs = [
        (1, 5),                  # decode
        (bs + 1, bs + 1),        # fresh prefill spanning two blocks
        (7, 3 * bs + 2),         # chunk over a cached prefix, not block aligned
        (1, 300),                # long decode
        (bs, 2 * bs),            # chunk starting at a block boundary
        (40, 40),                # fresh prefill
        (2, 2),                  # tiny prefill
    ]
    b = make_batch(specs, block_size, 2, group, 64, dtype, seed=7 * bs + group)
    out = BACKEND.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert_close(out, reference_attention(b), dtype)


def test_decode_groups_under_memory_bound_give_same_result(monkeypatch):
    specs = [(1, sl) for sl in (3, 200, 17, 64, 129, 1, 90)]
    b = make_batch(specs, 16, 2, 2, 64, torch.float32, seed=3)
    whole = BACKEND.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    monkeypatch.setattr(tb, "_DECODE_GATHER_ELEMENTS", 2 * 208 * 2 * 64)
    groups = tb._decode_groups(b.seq_lens, 16, 2 * 64)
    assert len(groups) > 2 and sorted(itertools.chain(*groups)) == list(range(len(specs)))
    split = BACKEND.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert_close(split, reference_attention(b), torch.float32)
    assert_close(split, whole, torch.float32)


def test_metadata_without_host_copies():
    b = make_batch([(3, 10), (1, 4)], 8, 1, 2, 64, torch.float32)
    meta = AttentionMetadata(b.meta.slot_mapping, b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables,
                             b.meta.max_query_len, b.meta.max_seq_len)
    assert_close(BACKEND.forward(b.q, b.k_cache, b.v_cache, meta, b.scale), reference_attention(b), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_and_skips_negative_slots(dtype):
    check_write_kv(BACKEND, dtype)


def test_write_then_attend_equals_attention_over_the_new_keys():
    """A fresh prefill written through write_kv attends exactly like causal attention over key/value."""
    torch.manual_seed(0)
    t, hkv, g, d = 13, 2, 3, 64
    k_cache, v_cache = torch.full((4, 8, hkv, d), float("nan")), torch.full((4, 8, hkv, d), float("nan"))
    table = torch.tensor([[3, 0]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // 8]) * 8 + p % 8 for p in range(t)])
    key, value, q = torch.randn(t, hkv, d), torch.randn(t, hkv, d), torch.randn(t, hkv * g, d)
    BACKEND.write_kv(key, value, k_cache, v_cache, slots)
    meta = AttentionMetadata(slots, torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                             table, t, t)
    out = BACKEND.forward(q, k_cache, v_cache, meta, 1 / math.sqrt(d))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), key.repeat_interleave(g, 1).transpose(0, 1), value.repeat_interleave(g, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    assert_close(out, expected, torch.float32)


def test_bad_inputs_name_the_field():
    b = make_batch([(1, 4)], 8, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="q dtype"):
        BACKEND.forward(b.q.half(), b.k_cache, b.v_cache, b.meta, b.scale)
    with pytest.raises(ValueError, match="not a multiple"):
        BACKEND.forward(b.q[:, :3], b.k_cache, b.v_cache, b.meta, b.scale)
    with pytest.raises(ValueError, match="v_cache"):
        BACKEND.forward(b.q, b.k_cache, b.v_cache[:2], b.meta, b.scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        BACKEND.write_kv(b.q[:, :2], b.q[:, :2], b.k_cache, b.v_cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="key must be"):
        BACKEND.write_kv(b.q, b.q, b.k_cache, b.v_cache, torch.tensor([1]))
    too_long = AttentionMetadata(b.meta.slot_mapping, b.meta.query_start_loc, torch.tensor([100], dtype=torch.int32),
                                 b.meta.block_tables, 1, 100)
    with pytest.raises(ValueError, match="seq_len 100"):
        BACKEND.forward(b.q, b.k_cache, b.v_cache, too_long, b.scale)


def test_selector():
    assert get_attention_backend().name == "torch"
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="attention backend 'flash' is unknown"):
        get_attention_backend("flash")


def test_selector_refuses_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")


def test_workspace_reuse_across_sizes_and_dtypes():
    backend = TorchAttentionBackend()
    for specs, dtype in [([(1, 300)] * 4, torch.float32), ([(1, 3), (5, 9)], torch.float32),
                         ([(1, 40), (17, 17)], torch.bfloat16), ([(1, 200)] * 3, torch.float32)]:
        b = make_batch(specs, 16, 2, 2, 64, dtype, seed=len(specs))
        assert_close(backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale), reference_attention(b), dtype)
