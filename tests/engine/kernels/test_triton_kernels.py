"""Triton kernels against the torch backend (itself checked against a plain reference).

On CPU the kernels run in Triton's interpreter, so the default cases are a covering sample: every pair
of (block size, GQA ratio) appears, each with both head dims and dtypes spread over the pairs, and
each batch holds the sequence lengths 1, bs-1, bs, bs+1 and a few hundred. The full product is marked
slow. Outputs are poisoned with NaN first, so an element a kernel forgets to write fails the test.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention_cases import assert_close, make_batch
from tests.engine.triton_setup import DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

K = load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")
TritonAttentionBackend = K["triton_backend"].TritonAttentionBackend
TORCH = TorchAttentionBackend()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (block_size, num_kv_heads, group, head_dim, dtype): all 12 (block size, group) pairs; every
# (block size | group, head dim | dtype) pair and every (head dim, dtype) pair appears too.
SAMPLE = [
    (8, 2, 1, 64, F32), (8, 1, 3, 128, F16), (8, 1, 4, 64, F16), (8, 1, 8, 128, F32),
    (16, 1, 1, 128, F16), (16, 2, 3, 64, F32), (16, 1, 4, 128, F32), (16, 1, 8, 64, F16),
    (32, 2, 1, 128, F32), (32, 1, 3, 64, F16), (32, 1, 4, 128, F16), (32, 1, 8, 64, F32),
    (16, 2, 4, 64, BF16),
]
FULL = [(bs, 2 if g == 1 else 1, g, d, dt)
        for bs, g, d, dt in itertools.product((8, 16, 32, 64), (1, 3, 4, 8), (64, 128), (F32, F16, BF16))]
slow_full = pytest.mark.parametrize("case", FULL, ids=lambda c: f"bs{c[0]}-g{c[2]}-d{c[3]}-{str(c[4])[6:]}")
sample = pytest.mark.parametrize("case", SAMPLE, ids=lambda c: f"bs{c[0]}-g{c[2]}-d{c[3]}-{str(c[4])[6:]}")


def seed_of(case) -> int:
    return zlib.crc32(repr(case).encode()) % 10_000  # stable across runs (hash() of a dtype is not)


def decode_specs(bs: int) -> list[tuple[int, int]]:
    return [(1, n) for n in (1, bs - 1, bs, bs + 1, 300)]


def extend_specs(bs: int) -> list[tuple[int, int]]:
    return [
        (bs + 1, bs + 1),        # fresh prefill over two blocks
        (bs - 1, 3 * bs + 2),    # chunk over a cached prefix, unaligned on both ends
        (1, 5),                  # a decode token mixed in
        (70, 300),               # long chunk over a long prefix, several query tiles
        (bs, 2 * bs),            # chunk starting at a block boundary
        (2, 2),
    ]


def run_decode(case, splits: int, seed: int) -> None:
    bs, hkv, g, d, dtype = case
    b = make_batch(decode_specs(bs), bs, hkv, g, d, dtype, seed=seed, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    out = torch.full_like(b.q, float("nan"))
    # splits of >= 16 tokens: in one batch some sequences are split (into as many as their length asks for)
    # and some written directly
    backend = TritonAttentionBackend(num_splits=splits, min_tokens_per_split=16)
    backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert_close(out, expected, dtype)


def run_extend(case, seed: int) -> None:
    bs, hkv, g, d, dtype = case
    b = make_batch(extend_specs(bs), bs, hkv, g, d, dtype, seed=seed, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    out = torch.full_like(b.q, float("nan"))
    TritonAttentionBackend().forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert_close(out, expected, dtype)


@sample
def test_paged_decode_direct_and_split(case):
    run_decode(case, splits=1, seed=seed_of(case))
    run_decode(case, splits=5, seed=seed_of(case) + 1)  # short sequences leave splits empty


@sample
def test_extend_over_cached_prefix_in_mixed_batch(case):
    run_extend(case, seed=seed_of(case) + 2)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("block_size,hkv,d", [(8, 1, 64), (16, 4, 128), (32, 3, 80)])
def test_kv_write_matches_torch_bitwise(dtype, block_size, hkv, d):
    gen = torch.Generator().manual_seed(block_size)
    shape = (7, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(7 * block_size, generator=gen)[:11]
    slots[[2, 7]] = -1
    # key as a strided view of a fused qkv projection, as the model produces it
    qkv = torch.randn(11, 3 * hkv, d, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    TORCH.write_kv(key, value, k_ref, v_ref, slots.to(DEVICE))
    TritonAttentionBackend().write_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_auto_split_count_matches_forced():
    case = (16, 1, 4, 64, F32)
    b = make_batch([(1, 700), (1, 3)], 16, 1, 4, 64, F32, seed=5, device=DEVICE)
    outs = [TritonAttentionBackend(num_splits=s).forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
            for s in (None, 1, 3)]
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    for out in outs:
        assert_close(out, expected, case[4])


@pytest.mark.parametrize("dtype", [F32, F16])
def test_long_context_many_splits_and_long_prefix(dtype):
    """Decodes of 5000 and 4100 tokens merged from 8 splits (auto) next to a 40-token chunk over a 3000-token prefix."""
    b = make_batch([(1, 5000), (40, 3040), (1, 4100)], 16, 1, 2, 64, dtype, seed=11, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    out = torch.full_like(b.q, float("nan"))
    backend = TritonAttentionBackend()
    backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert DEVICE == "cuda" or backend._plan.num_splits == 8
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("head_dim", [8, 80])
def test_head_dims_that_are_small_or_not_powers_of_two(head_dim):
    run_decode((16, 1, 2, head_dim, F32), splits=3, seed=head_dim)
    run_extend((16, 1, 2, head_dim, F32), seed=head_dim)


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 2, 1), (128, 8, 3)])
def test_decode_result_does_not_depend_on_launch_shape(block_n, num_warps, num_stages):
    launch = K["paged_decode"].DecodeLaunch(block_n, num_warps, num_stages)
    b = make_batch(decode_specs(16), 16, 2, 4, 64, F16, seed=block_n, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    for splits in (1, 3):
        out = torch.full_like(b.q, float("nan"))
        backend = TritonAttentionBackend(num_splits=splits, decode_launch=launch)
        backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
        assert_close(out, expected, F16)
    with pytest.raises(ValueError, match="block_n"):
        K["paged_decode"].DecodeLaunch(24)


def test_grid_splits():
    grid = K["paged_decode"].grid_splits
    assert grid(1, 8, 132) == 64  # one sequence: as many splits as fill the GPU (capped)
    assert grid(256, 8, 132) == 1  # a big batch fills it already
    assert grid(16, 8, 132) == 5
    assert grid(1, 1, 10_000) == 64  # capped


def test_split_plan_on_device_matches_python_and_follows_each_length():
    """The kernels' device-side plan equals seq_splits; in one batch a long sequence takes many splits while
    short ones take one (before, every sequence was cut at the longest one's split length)."""
    pd = K["paged_decode"]
    lens = [1, 15, 16, 17, 255, 256, 257, 700, 5000, 0]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ids = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    for grid, min_tokens, block_n in [(8, 256, 64), (5, 16, 16), (64, 256, 32), (1, 256, 64)]:
        splits, per = pd.plan_splits(seq_lens, ids, grid, min_tokens, block_n)
        want = [pd.seq_splits(n, grid, min_tokens, block_n) for n in lens]
        assert list(zip(splits.tolist(), per.tolist(), strict=True)) == want
        for (n, p), length in zip(want, lens, strict=True):
            assert 1 <= n <= grid and p % block_n == 0 and (n - 1) * p < max(length, 1) <= n * p
    assert pd.seq_splits(5000, 8, 256, 64) == (8, 640) and pd.seq_splits(300, 8, 256, 64) == (2, 192)
    assert pd.seq_splits(100, 8, 256, 64) == (1, 128)


def test_one_long_sequence_among_short_ones():
    b = make_batch([(1, 40)] * 6 + [(1, 2000)], 16, 1, 4, 64, F32, seed=3, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    out = torch.full_like(b.q, float("nan"))
    TritonAttentionBackend(num_splits=8).forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert_close(out, expected, F32)


def test_decode_only_step_reads_no_host_lengths(monkeypatch):
    """A decode-only batch is planned from shapes alone (what a CUDA graph capture needs)."""
    b = make_batch([(1, 9), (1, 700), (1, 33)], 8, 1, 2, 64, F32, seed=2, device=DEVICE)
    expected = TORCH.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)

    def no_host(*_):
        raise AssertionError("host lengths read in a decode-only step")

    monkeypatch.setattr(K["triton_backend"], "host_lens", no_host)
    monkeypatch.setattr(K["triton_backend"], "check_lens", no_host)
    backend = TritonAttentionBackend()
    backend.reserve(8, 2, 1, 64, DEVICE)
    out = torch.full_like(b.q, float("nan"))
    backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert_close(out, expected, F32)
    # the grid follows the batch's shape alone: ceil(SMs x 4 / (3 sequences x 1 KV head)), at most 64; under the
    # interpreter the backend pretends 4 SMs (6 splits), on an H200 132 (64)
    sms = backend._sms(torch.device(DEVICE))
    assert backend._plan.num_splits == min(-(-sms * 4 // 3), 64)
    assert sms != 4 or backend._plan.num_splits == 6


def test_plan_is_reused_for_the_same_metadata_and_rebuilt_for_new():
    backend = TritonAttentionBackend()
    b = make_batch([(1, 9), (4, 4)], 8, 1, 1, 64, F32, seed=1, device=DEVICE)
    backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    plan = backend._plan
    backend.forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert backend._plan is plan
    c = make_batch([(1, 9)], 8, 1, 1, 64, F32, seed=1, device=DEVICE)
    backend.forward(c.q, c.k_cache, c.v_cache, c.meta, c.scale)
    assert backend._plan is not plan and backend._plan.extend_ids.numel() == 0


def test_bad_inputs_name_the_field():
    b = make_batch([(1, 4)], 8, 2, 2, 64, F32, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits"):
        TritonAttentionBackend(num_splits=0)
    with pytest.raises(ValueError, match="out must be"):
        TritonAttentionBackend().forward(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=b.q[:, :2])
    with pytest.raises(ValueError, match="contiguous"):
        TritonAttentionBackend().forward(b.q, b.k_cache.transpose(1, 2).contiguous().transpose(1, 2),
                                         b.v_cache, b.meta, b.scale)


@pytest.mark.slow
@slow_full
def test_full_matrix_decode(case):
    run_decode(case, splits=1, seed=7)
    run_decode(case, splits=5, seed=8)


@pytest.mark.slow
@slow_full
def test_full_matrix_extend(case):
    run_extend(case, seed=9)
