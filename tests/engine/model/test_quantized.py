"""Exact group-quantized weights: finding Q4 and Q8 groups in float32 checkpoint values, packing them, and
the `q4_linear` / `q8_linear` kernels (AMX tiles or AVX-512 BF16 dot products where the CPU has them,
portable loops everywhere) against a float64 reference."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import cpu_ops
from engine.model import cpu_linear
from engine.model.cpu_linear import OneDnnHead, OneDnnLinear, Q4Linear, Q8Head
from engine.model.invariant_linear import pack_tiles_bf16
from engine.model.quantized import dequant_reference, dequant_reference_q8, find_q4, find_q8, pack_q4, pack_q8

if os.environ.get(cpu_ops.ENV) == "torch":
    pytest.skip("fused CPU kernels turned off", allow_module_level=True)

assert cpu_ops.load(), f"the fused CPU kernels must build here: {cpu_ops.unavailable_reason()}"
OPS = cpu_ops.ops()
PATH = OPS.quant_path()  # "amx", "avx512_bf16" or "portable"
AMX = PATH == "amx"
FAST = [True, False] if PATH != "portable" else [False]  # the op's `fast` flag: False runs the portable loops


def q4_1_tensor(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """float32 values as a GGUF Q4_1 tensor dequantizes: fp32(s * q) + m, s and m float16, min and max used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 3], q[..., 17] = 0, 15
    s = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-(7.0 + torch.rand(n, k // 32, 1, generator=g)) * s).half().float()
    return (q * s + m).view(n, k)


def test_find_q4_recovers_the_groups_exactly():
    w = q4_1_tensor(48, 96)
    found = find_q4(w)
    assert found is not None
    q, s, m = found
    assert q.dtype == torch.uint8 and s.dtype == m.dtype == torch.float16
    assert q.shape == (48, 96) and s.shape == m.shape == (48, 3)
    assert int(q.max()) == 15
    assert torch.equal(dequant_reference(q, s, m), w)


def test_constant_groups_have_zero_scale():
    w = q4_1_tensor(16, 64)
    w[2, :32] = 0.125
    q, s, m = find_q4(w)
    assert s[2, 0] == 0 and m[2, 0] == 0.125 and torch.equal(dequant_reference(q, s, m), w)


@pytest.mark.parametrize("case", ["float weights", "bf16 tensor", "one value off the grid", "inputs not whole groups",
                                  "rows not whole blocks", "minimum not float16"])
def test_anything_but_exact_4bit_groups_is_refused(case):
    w = q4_1_tensor(32, 64)
    if case == "float weights":
        w = torch.randn(32, 64)
    elif case == "bf16 tensor":
        w = w.bfloat16()
    elif case == "one value off the grid":
        w[5, 40] += 0.4 * (w[5, 32:64].max() - w[5, 32:64].min()) / 15
    elif case == "inputs not whole groups":
        w = w[:, :48].contiguous()
    elif case == "rows not whole blocks":
        w = w[:24].contiguous()
    elif case == "minimum not float16":
        w[0, :32] += 1e-6
    assert find_q4(w) is None


def test_kernel_dequantizes_to_the_bf16_weights_bit_for_bit():
    w = q4_1_tensor(64, 160, seed=1)
    qweight, scales = pack_q4(*find_q4(w))
    assert qweight.shape == (4, 5, 16, 16) and scales.shape == (4, 5, 2, 16)
    assert torch.equal(OPS.q4_dequant(qweight, scales), w.bfloat16())


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("rows,n,k", [(1, 32, 64), (5, 48, 96), (16, 64, 64), (17, 64, 1536), (33, 96, 128),
                                      (64, 80, 576), (130, 32, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_matches_a_float64_reference(fast, rows, n, k, bias):
    w = q4_1_tensor(n, k, seed=rows + n)
    qweight, scales = pack_q4(*find_q4(w))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    want = x.double() @ w.bfloat16().double().T + (b.double() if bias else 0)
    got = OPS.q4_linear(x, qweight, scales, b, fast)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums, one bf16 rounding of the result
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
def test_a_rows_result_is_the_same_bits_in_any_batch(kind):
    """Each row's result depends on its own row alone, bit for bit: steps of 1-8 rows (on AVX-512 BF16, the fused
    path that dequantizes in registers) give the bits of the same rows inside 9- and 40-row steps (dequantized
    once into a buffer), across the n-blocks' groupings (4, 2 and a lone last one: 23 n-blocks of 16)."""
    n, k = 16 * 23, 96
    if kind == "q4":
        weights: tuple = pack_q4(*find_q4(q4_1_tensor(n, k, seed=3)))
        op = OPS.q4_linear
    elif kind == "q8":
        weights = pack_q8(*find_q8(q8_0_tensor(n, k, seed=3)))
        op = OPS.q8_linear
    else:
        weights = (pack_tiles_bf16(torch.randn(n, k, generator=torch.Generator().manual_seed(3)).bfloat16()),)
        op = OPS.bf16_linear
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).bfloat16()
    for float_out in (False, True):
        whole = op(x, *weights, bias, True, float_out)
        assert torch.equal(op(x[:9], *weights, bias, True, float_out), whole[:9])
        for m in range(1, 9):
            for i in range(0, 17 - m, 3):
                assert torch.equal(op(x[i:i + m], *weights, bias, True, float_out), whole[i:i + m]), (m, i)


def test_q4_linear_reads_strided_rows_and_empty_batches():
    w = q4_1_tensor(32, 64)
    qweight, scales = pack_q4(*find_q4(w))
    x = torch.randn(20, 128).bfloat16()[:, ::2]  # not contiguous
    assert torch.allclose(OPS.q4_linear(x, qweight, scales).float(), OPS.q4_linear(x.contiguous(), qweight, scales).float())
    assert OPS.q4_linear(torch.zeros(0, 64, dtype=torch.bfloat16), qweight, scales).shape == (0, 32)


def test_q4_linear_bad_inputs_are_clear_errors():
    qweight, scales = pack_q4(*find_q4(q4_1_tensor(32, 64)))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        OPS.q4_linear(torch.zeros(2, 64), qweight, scales)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        OPS.q4_linear(torch.zeros(2, 32, dtype=torch.bfloat16), qweight, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        OPS.q4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), qweight, scales.float())
    with pytest.raises(RuntimeError, match="bias must be bf16"):
        OPS.q4_linear(torch.zeros(2, 64, dtype=torch.bfloat16), qweight, scales, torch.zeros(31, dtype=torch.bfloat16))


def test_linear_with_q4_equals_the_bf16_linear():
    w = q4_1_tensor(64, 128, seed=3)
    lin = torch.nn.Linear(128, 64, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(torch.randn(64))
    x = torch.randn(7, 128).bfloat16()
    plain = lin(x).double()
    q4 = Q4Linear(lin, pack_q4(*find_q4(w)))
    assert torch.allclose(q4(x).double(), plain, rtol=2 ** -7, atol=1e-3 * plain.abs().max().item())


@pytest.mark.slow  # 28-41 s on 2 cores: the kernels' exact tests beside it stay in the default run
def test_smollm2_projections_run_4bit_on_the_same_bf16_weights():
    """Every projection is packed from the GGUF's exact Q4_1 groups; where the CPU runs the packed kernel
    (AMX or AVX-512 BF16), steps beyond a few rows multiply through them (elsewhere the copies stay unused)."""
    from engine.llm import LLM

    model = LLM("smollm2", dtype="bfloat16", num_blocks=64).engine.model
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, Q4Linear) or (isinstance(m, OneDnnLinear) and not name.endswith(".large"))]
    assert len(linears) == 4 * model.config.num_layers  # qkv, o, gate_up, down
    for name, module in linears:
        assert module.q4_packed is not None, name
        assert torch.equal(OPS.q4_dequant(*module.q4_packed), module.weight), name
    assert cpu_linear.q4_projections(model) == (0 if PATH == "portable" else len(linears))
    if PATH != "portable":
        assert {m.max_rows for _, m in linears} == {None if AMX else cpu_linear.Q4_AVX512_MAX_ROWS}


def test_a_q4_projection_with_a_row_limit_hands_larger_steps_to_onednn():
    """With the AVX-512 BF16 path's limit (past Q4_AVX512_MAX_ROWS rows oneDNN is as fast), larger steps go to
    the packed bf16 weight, bit for bit what OneDnnLinear returns; smaller ones through the 4-bit kernel."""
    w = q4_1_tensor(64, 128, seed=4)
    lin = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    dnn = OneDnnLinear(lin)
    q4 = Q4Linear(dnn, pack_q4(*find_q4(w)), cpu_linear.Q4_AVX512_MAX_ROWS)
    big = torch.randn(cpu_linear.Q4_AVX512_MAX_ROWS + 1, 128).bfloat16()
    assert torch.equal(q4(big), dnn(big))
    small = big[:cpu_linear.Q4_AVX512_MAX_ROWS]
    assert torch.equal(q4(small), OPS.q4_linear(small, *q4.q4_packed))
    assert torch.allclose(q4(small).double(), small.double() @ w.bfloat16().double().T, rtol=2 ** -7, atol=1e-2)


# ---- 8-bit (Q8_0) --------------------------------------------------------------------------------

def q8_0_tensor(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """float32 values as a GGUF Q8_0 tensor dequantizes: d * q, d float16, q in -127..127 with +-127 used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 5] = 127 * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1.0, 1.0)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.002 + 1e-5).half().float()
    return (q * d).view(n, k)


def test_find_q8_recovers_the_groups_exactly_and_refuses_others():
    w = q8_0_tensor(32, 96)
    q, d = find_q8(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (32, 3)
    assert torch.equal(dequant_reference_q8(q, d), w)
    assert find_q8(torch.randn(32, 96)) is None
    assert find_q8(w.bfloat16()) is None
    w[3, 7] += 0.3 * d[3, 0].float()
    assert find_q8(w) is None


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("rows", [1, 4, 16, 19, 40])
def test_q8_linear_matches_a_float64_reference_on_the_exact_bf16_weights(fast, rows):
    w = q8_0_tensor(48, 160, seed=rows)
    qweight, scales = pack_q8(*find_q8(w))
    assert torch.equal(OPS.q8_dequant(qweight, scales), w.bfloat16())
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
    b = torch.randn(48).bfloat16()
    want = x.double() @ w.bfloat16().double().T + b.double()
    got = OPS.q8_linear(x, qweight, scales, b, fast)
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def test_q8_linear_bad_packing_is_a_clear_error():
    qweight, scales = pack_q8(*find_q8(q8_0_tensor(16, 64)))
    with pytest.raises(RuntimeError, match="qweight must be contiguous int8"):
        OPS.q8_linear(torch.zeros(1, 64, dtype=torch.bfloat16), qweight.view(torch.uint8), scales)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float16 \[N/16, K/32, 16\]"):
        OPS.q8_linear(torch.zeros(1, 64, dtype=torch.bfloat16), qweight, scales.float())


@pytest.mark.slow  # ~20 s on 2 cores: the q8 kernel's exact tests beside it stay in the default run
def test_smollm2_head_runs_8bit_on_the_same_bf16_weights():
    from engine.llm import LLM

    model = LLM("smollm2", dtype="bfloat16", num_blocks=64).engine.model
    head = model.output_head
    assert isinstance(head, Q8Head if PATH != "portable" else OneDnnHead)
    assert head.q8_packed is not None  # the GGUF's Q8_0 embedding, recovered exactly
    assert torch.equal(OPS.q8_dequant(*head.q8_packed), model.lm_head_weight)
    assert cpu_linear.q8_head(model) == (PATH != "portable")
    if PATH != "portable":  # AMX multiplies more rows per step through the 8-bit head than AVX-512 BF16
        assert head.max_rows == (cpu_linear.Q8_HEAD_MAX_ROWS if AMX else cpu_linear.Q8_AVX512_HEAD_MAX_ROWS)


@pytest.mark.parametrize("fast", FAST)
def test_float_out_returns_the_unrounded_sums(fast):
    """The output head asks for float32 logits: bf16 ones (spacing 0.125 at 16-32) tie close tokens."""
    w = q8_0_tensor(32, 128, seed=9)
    qweight, scales = pack_q8(*find_q8(w))
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    full = OPS.q8_linear(x, qweight, scales, None, fast, True)
    assert full.dtype == torch.float32
    assert torch.equal(full.bfloat16(), OPS.q8_linear(x, qweight, scales, None, fast))
    want = x.double() @ w.bfloat16().double().T
    assert (full.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    q4w = q4_1_tensor(32, 128, seed=9)
    packed = pack_q4(*find_q4(q4w))
    assert torch.equal(OPS.q4_linear(x, *packed, None, fast, True).bfloat16(), OPS.q4_linear(x, *packed, None, fast))
