"""The Triton layer kernels (engine/kernels/fused_layers.py) against the torch modules of engine/model/llama.py.

On CPU they run in Triton's interpreter; small shapes by default, the real 8B/7B widths marked slow
(loadtest/gpu_check.sh runs those compiled). The residual add and SiLU x up round where torch rounds,
so they are compared bit for bit; the norm and rotation round once from float32 (tolerance in 16-bit).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.llama import ModelConfig, QKRotary, RMSNorm, RotaryEmbedding, SiluAndMul
from tests.engine.attention_cases import TOLERANCE
from tests.engine.triton_setup import COMPILED, DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

K = load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")
FL = K["fused_layers"]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal, except bfloat16 under the interpreter, whose float32 -> bfloat16 conversion truncates
    instead of rounding to nearest (compiled kernels round): there, at most one unit in the last place."""
    if COMPILED or got.dtype != BF16:
        assert torch.equal(got, want)
    else:
        ulp = torch.finfo(BF16).eps * want.float().abs().clamp_min(torch.finfo(BF16).tiny)
        assert ((got.float() - want.float()).abs() <= ulp).all()


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = TOLERANCE[dtype] * scale
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol)


def check_add_rms_norm(t: int, n: int, dtype: torch.dtype, seed: int) -> None:
    norm = RMSNorm(n, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(rand(n, dtype=F32, seed=seed + 9) * 0.5 + 1)
    norm = norm.to(dtype)
    x, res = rand(t, n, dtype=dtype, seed=seed), rand(t, n, dtype=dtype, seed=seed + 1)
    want_h, want_r = norm(x.clone(), res.clone())
    first_h, first_r = norm(x.clone(), None)
    xk, rk = x.clone(), res.clone()
    got_h, got_r = FL.add_rms_norm_(xk, rk, norm.weight, norm.eps)
    assert got_h.data_ptr() == xk.data_ptr() and got_r.data_ptr() == rk.data_ptr()  # in place
    rounded_alike(got_r, want_r)  # the residual add rounds like torch
    close(got_h, want_h, dtype)
    x0 = x.clone()
    got_h0, got_r0 = FL.add_rms_norm_(x0, None, norm.weight, norm.eps)
    assert got_r0 is x0 and torch.equal(x0, x)  # first layer: x is the stream, the norm is new
    close(got_h0, first_h, dtype)
    assert torch.equal(got_r0, first_r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 64), (5, 96), (3, 200)])
def test_add_rms_norm_matches_torch(t, n, dtype):
    check_add_rms_norm(t, n, dtype, seed=t * 31 + n)


def check_silu_and_mul(t: int, n: int, dtype: torch.dtype, seed: int) -> None:
    x = rand(t, 2 * n, dtype=dtype, seed=seed) * 3
    want = SiluAndMul()(x)
    got = FL.silu_and_mul(x)
    if dtype == F32:
        close(got, want, dtype)
    else:  # the same two roundings as torch; only exp's last bits in float32 may differ
        assert ((got.float() - want.float()).abs() <= 2 * torch.finfo(dtype).eps * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 64), (4, 1500)])
def test_silu_and_mul_matches_torch(t, n, dtype):
    check_silu_and_mul(t, n, dtype, seed=n + t)


def rope_config(head_dim: int, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)


def check_rotary_kv_write(t: int, heads: int, kv_heads: int, d: int, block_size: int, dtype: torch.dtype,
                          seed: int) -> None:
    cfg = rope_config(d, heads, kv_heads)
    rope = RotaryEmbedding(cfg, 4096).to(DEVICE)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    qkv = rand(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=seed)
    num_blocks = t + 2
    k_cache = rand(num_blocks, block_size, kv_heads, d, dtype=dtype, seed=seed + 1)
    v_cache = rand(num_blocks, block_size, kv_heads, d, dtype=dtype, seed=seed + 2)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(seed))[:t]
    if t > 2:
        slots[1] = -1  # not written
    slots = slots.to(DEVICE)

    want_q, want_k, want_v = QKRotary(heads, kv_heads, d)(qkv.clone(), rope(positions, dtype))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().write_kv(want_k, want_v, k_ref, v_ref, slots)

    half = d // 2
    cos_sin = torch.cat((rope.cos[:, :half], rope.sin[:, :half]), dim=1).float().contiguous()
    qkv_k = qkv.clone()
    got_q = FL.rotary_kv_write(qkv_k, positions, cos_sin, heads, kv_heads, k_cache, v_cache, slots)
    assert got_q.data_ptr() == qkv_k.data_ptr()  # q rotated in place
    close(got_q, want_q, dtype, scale=2)
    close(k_cache, k_ref, dtype, scale=2)
    assert torch.equal(v_cache, v_ref)  # v is copied, bit for bit
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(k_cache.view(-1, kv_heads, d)[untouched.to(DEVICE)],
                       k_ref.view(-1, kv_heads, d)[untouched.to(DEVICE)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,kv_heads,d,block_size", [(1, 4, 1, 64, 16), (5, 6, 2, 32, 8), (4, 3, 3, 16, 4)])
def test_rotary_kv_write_matches_torch(t, heads, kv_heads, d, block_size, dtype):
    check_rotary_kv_write(t, heads, kv_heads, d, block_size, dtype, seed=t + heads + d)


def test_bad_inputs_name_the_argument():
    x = rand(2, 8, dtype=F32, seed=0)
    with pytest.raises(ValueError, match="residual"):
        FL.add_rms_norm_(x, rand(2, 4, dtype=F32, seed=1), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        FL.silu_and_mul(rand(2, 7, dtype=F32, seed=0))
    kc = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        FL.rotary_kv_write(rand(1, 40, dtype=F32, seed=0), torch.zeros(1, dtype=torch.long, device=DEVICE),
                           torch.zeros(8, 16, device=DEVICE), 1, 1, kc, kc.clone(),
                           torch.zeros(1, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="cos_sin"):
        FL.rotary_kv_write(rand(1, 48, dtype=F32, seed=0), torch.zeros(1, dtype=torch.long, device=DEVICE),
                           torch.zeros(8, 16, dtype=F16, device=DEVICE), 1, 1, kc, kc.clone(),
                           torch.zeros(1, dtype=torch.long, device=DEVICE))


# Llama-3-8B (hidden 4096, 32/8 heads, FFN 14336) and Qwen2.5-7B (hidden 3584, 28/4 heads, FFN 18944) widths.
REAL = [("llama8b", 4096, 32, 8, 14336), ("qwen7b", 3584, 28, 4, 18944)]


@pytest.mark.slow
@pytest.mark.parametrize("name,hidden,heads,kv_heads,ffn", REAL, ids=[r[0] for r in REAL])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_real_widths(name, hidden, heads, kv_heads, ffn, dtype):
    t = 7
    check_add_rms_norm(t, hidden, dtype, seed=1)
    check_silu_and_mul(t, ffn, dtype, seed=2)
    check_rotary_kv_write(t, heads, kv_heads, 128, 16, dtype, seed=3)
