"""Our flash kernel for long bf16 prefill chunks (engine/kernels/prefill_attention.cpp) against a float32
reference: query t of a chunk sees its cached prefix and the chunk's keys up to itself. Its error is that of
bf16 attention (no larger than PyTorch's own bf16 flash attention's on the same inputs, within a margin) for
chunks with and without a prefix, ragged tile edges, grouped-query heads 1/3/4 per KV head, head dims 64 and
128, and q read in place from the fused qkv rows. Bad arguments are refused naming what is wrong. On a real
SmolLM2 engine, a long prompt prefilled in chunks through it gives float32's greedy tokens as closely as the
plain bf16 path does."""

from __future__ import annotations

import pytest
import torch

from engine.attention.extend_sdpa import extend_attention
from engine.kernels import cpu_ops

if not cpu_ops.load():
    pytest.skip("the fused CPU kernels did not build here", allow_module_level=True)
OPS = cpu_ops.ops()
if not OPS.prefill_attention_available():
    pytest.skip("this CPU lacks AVX512_BF16: prefill_attention_ is not built (PyTorch's flash attention serves)",
                allow_module_level=True)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    t, h, _ = q.shape
    s, hkv, _ = k.shape
    g = h // hkv
    qf = q.float().transpose(0, 1)
    kf, vf = (x.float().repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
    scores = (qf @ kf.transpose(1, 2)) * scale
    visible = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vf).transpose(0, 1)


def inputs(t: int, prefix: int, h: int, hkv: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).bfloat16()  # q read in place from the fused rows
    q = qkv[:, : h * d].view(t, h, d)
    k = torch.randn(t + prefix, hkv, d, generator=gen).bfloat16()
    v = torch.randn(t + prefix, hkv, d, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("t, prefix, h, hkv, d", [
    (1, 0, 9, 3, 64), (5, 0, 9, 3, 64), (37, 0, 9, 3, 64), (64, 0, 9, 3, 64), (100, 13, 9, 3, 64),
    (300, 700, 9, 3, 64), (129, 64, 8, 8, 64), (70, 190, 16, 4, 64), (257, 0, 8, 2, 128), (33, 500, 4, 4, 128),
    (1024, 1024, 9, 3, 64),
])
def test_matches_float32_as_closely_as_torch_bf16(t, prefix, h, hkv, d):
    q, k, v = inputs(t, prefix, h, hkv, d, seed=t * 31 + prefix)
    scale = d ** -0.5
    out = torch.full((t, h, d), float("nan"), dtype=torch.bfloat16)
    OPS.prefill_attention_(out, q, k, v, scale)
    ref = reference(q, k, v, scale)
    theirs = extend_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
    err = (out.float() - ref).abs().max().item()
    torch_err = (theirs[0].transpose(0, 1).float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 2e-3, (err, torch_err)
    assert (out.float() - ref).abs().mean().item() < 2e-3


def test_bad_arguments_are_refused_naming_the_problem():
    q, k, v = inputs(8, 8, 9, 3, 64, seed=1)
    out = torch.empty(8, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        OPS.prefill_attention_(out, q.float(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="context must hold the chunk"):
        OPS.prefill_attention_(out, q, k[:4], v[:4], 0.125)
    with pytest.raises(RuntimeError, match="H a multiple of Hkv"):
        OPS.prefill_attention_(out[:, :8], q[:, :8], k[:, :3], v[:, :3], 0.125)
    q32, k32, v32 = inputs(8, 8, 9, 3, 32, seed=2)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        OPS.prefill_attention_(torch.empty(8, 9, 32, dtype=torch.bfloat16), q32, k32, v32, 0.125)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        OPS.prefill_attention_(out, q, k.transpose(0, 1).contiguous().transpose(0, 1), v, 0.125)
    with pytest.raises(RuntimeError, match="out must have q's shape"):
        OPS.prefill_attention_(out[:4], q, k, v, 0.125)


@pytest.mark.model
@pytest.mark.slow  # 28-41 s on 2 cores: the kernels' exact tests beside it stay in the default run
def test_a_long_prompt_in_chunks_keeps_float32s_greedy_tokens_as_the_plain_bf16_path_does():
    """1,300 prompt tokens in 512-token chunks: the second and third chunks attend over a cached prefix, all of
    them in the kernel (long extends). Compared with float32 like test_cpu_kernels' whole-model check."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    words = "harbour ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon".split()
    prompt = "Summarise the log. " + " ".join(words[(i * 7 + i * i) % len(words)] for i in range(1250))
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    runs = {}
    for name, dtype, backend in (("f32", "float32", "torch"), ("cpu", "bfloat16", "cpu"),
                                 ("torch", "bfloat16", "torch")):
        llm = LLM("smollm2", dtype=dtype, attention_backend=backend, num_blocks=256, max_num_batched_tokens=512)
        out = llm.generate(prompt, params)[0]
        assert len(out.prompt_token_ids) > 1024
        runs[name] = out.outputs[0]
    err = {}
    for name in ("cpu", "torch"):
        ref, got = runs["f32"], runs[name]
        n = next((i for i, (x, y) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)) if x != y),
                 len(ref.token_ids))
        assert n >= 4, (name, ref.token_ids, got.token_ids)
        err[name] = sum(abs(a.logprob - b.logprob) for a, b in zip(ref.logprobs[:n], got.logprobs[:n], strict=True)) / n
    assert err["cpu"] <= 1.5 * err["torch"] + 0.01, err
