"""Sampler: exact kept sets on hand-built logits, penalties by hand, seeds across batch compositions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import (
    Sampler,
    SamplerOutput,
    process_logits,
    seeded_uniform,
    warp_logits,
)
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.sequence import Sequence

NEG = float("-inf")


def seq(prompt=(1, 2, 3), output=(), **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params))
    for t in output:
        s.append_token(t)
    return s


def sampled_set(logits_row, draws=3000, eos=None, **params) -> set[int]:
    """Every token a sampling row produced over `draws` identical rows (one batched call)."""
    logits = torch.tensor([logits_row], dtype=torch.float32).repeat(draws, 1)
    out = Sampler(seed=1)(logits, [seq(**params)] * draws, eos)
    return set(out.token_ids)


def test_greedy_is_argmax_and_leaves_logits_alone():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0], [-3.0, -2.0, -1.0, -1.5]])
    before = logits.clone()
    out = Sampler()(logits, [seq(temperature=0.0) for _ in range(3)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == [1, 0, 2]
    assert out.logprobs == [None, None, None]
    assert torch.equal(logits, before)


def test_greedy_rows_mixed_with_sampling_rows_stay_argmax():
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2]] * 6)
    seqs = [seq(temperature=0.0) if i % 2 == 0 else seq(temperature=1.0) for i in range(6)]
    for _ in range(20):
        out = Sampler()(logits, seqs)
        assert out.token_ids[0::2] == [1, 1, 1]


def test_temperature_sampling_can_reach_every_token():
    assert sampled_set([0.0, 0.5, 1.0, -0.5, 0.2], temperature=1.0) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("width", [5, 49152])  # one level, and the two-level search of wide rows
def test_a_row_with_nothing_to_draw_from_gets_its_best_token_and_the_others_sample(width):
    """A sampling row whose softmax is not a distribution (every token -inf, a +inf logit, a NaN) took the
    engine down once (an index past the last block); it now gets its best token, its neighbours still sample."""
    rows = torch.randn(4, width)
    rows[0] = NEG  # everything excluded: token 0
    rows[1, 3] = float("inf")
    rows[2, 1], rows[2, 4] = float("nan"), 50.0
    seqs = [seq(temperature=1.0, seed=i) for i in range(4)]
    out = Sampler(seed=3)(rows, seqs)
    assert out.token_ids[:3] == [0, 3, 4]
    assert 0 <= out.token_ids[3] < width


def test_negligible_temperature_is_greedy():
    assert sampled_set([0.0, 0.5, 1.0, 0.99], draws=500, temperature=1e-6) == {2}


def test_top_k_keeps_exactly_the_k_best():
    row = [0.3, 2.0, -1.0, 1.5, 0.9, 1.4, 0.0]
    assert sampled_set(row, top_k=1) == {1}
    assert sampled_set(row, top_k=3) == {1, 3, 5}
    assert sampled_set(row, top_k=-1) == set(range(7))
    assert sampled_set(row, top_k=100) == set(range(7))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.05, 0.4, 0.3, 0.15, 0.1]
    row = [math.log(p) for p in probs]
    assert sampled_set(row, top_p=0.35) == {1}
    assert sampled_set(row, top_p=0.65) == {1, 2}
    assert sampled_set(row, top_p=0.75) == {1, 2, 3}
    assert sampled_set(row, top_p=0.9) == {1, 2, 3, 4}
    assert sampled_set(row, top_p=0.97) == {0, 1, 2, 3, 4}


def test_top_p_renormalizes_after_top_k():
    row = [math.log(p) for p in [0.05, 0.4, 0.3, 0.15, 0.1]]
    # top-k 2 leaves {1: 0.4/0.7 = 0.57, 2: 0.3/0.7}: token 1 alone reaches 0.55 but not 0.6
    assert sampled_set(row, top_k=2, top_p=0.55) == {1}
    assert sampled_set(row, top_k=2, top_p=0.6) == {1, 2}


def test_min_p_keeps_tokens_at_least_min_p_of_the_best():
    row = [math.log(p) for p in [0.5, 0.2, 0.26, 0.04]]
    assert sampled_set(row, min_p=0.5) == {0, 2}
    assert sampled_set(row, min_p=0.3) == {0, 1, 2}
    assert sampled_set(row, min_p=1.0) == {0}


def test_temperature_sharpens_before_min_p():
    # probabilities 0.5 and 0.3 (ratio 0.6); at temperature 0.5 the ratio becomes 0.36 < min_p 0.5
    row = [math.log(0.5), math.log(0.3), math.log(0.2)]
    assert sampled_set(row, min_p=0.5) == {0, 1}
    assert sampled_set(row, min_p=0.5, temperature=0.5) == {0}


def test_top_p_on_a_flat_large_vocabulary():
    """The kept set extends far beyond the first candidates: still exact."""
    vocab = 5000
    logits = torch.zeros(1, vocab)
    logits[0, :10] = 2.0  # 10 strong tokens, the rest flat
    mass_strong = 10 * math.e ** 2 / (10 * math.e ** 2 + vocab - 10)
    top_p = mass_strong + 700.5 / (10 * math.e ** 2 + vocab - 10)  # + 700.5 flat tokens' mass
    seqs = [seq(top_p=top_p)] * 400
    kept = warp_logits(logits, [SamplingParams(top_p=top_p)])[0]
    allowed = set(torch.nonzero(kept > NEG).flatten().tolist())
    assert len(allowed) == 10 + 701
    assert set(range(10)) <= allowed
    out = Sampler(seed=3)(logits.repeat(400, 1), seqs)
    assert set(out.token_ids) <= allowed


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.05, 0.25])
    n = 20000
    out = Sampler(seed=7)(probs.log().repeat(n, 1), [seq()] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    s = seq(prompt=[0, 1], output=[2], repetition_penalty=2.0, temperature=0.0, logprobs=5)
    x = process_logits(logits, [s], [s.params], ())
    assert x.tolist() == [[1.0, -2.0, 0.25, -0.5, 1.0, 3.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]]


def test_repetition_penalty_agrees_with_hugging_face():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    seqs = [seq(prompt=[1, 5, 7, 7], output=[9, 1], repetition_penalty=1.3),
            seq(prompt=[40, 2], output=[], repetition_penalty=0.7),
            seq(prompt=[3], output=[3, 3, 49], repetition_penalty=1.0)]
    x = process_logits(logits, seqs, [s.params for s in seqs], ())
    for i, s in enumerate(seqs):
        ref = RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty)(
            torch.tensor([s.token_ids]), logits[i:i + 1].clone())
        assert torch.allclose(x[i:i + 1], ref), i


def test_frequency_and_presence_penalties_match_hand_computation():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    s = seq(prompt=[4, 4, 4], output=[0, 0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25)
    x = process_logits(logits, [s], [s.params], ())
    # token 0: 1 - 0.5*3 - 0.25 = -0.75; token 2: 1 - 0.5 - 0.25 = 0.25; prompt-only token 4 untouched
    assert x.tolist() == [[-0.75, 1.0, 0.25, 1.0, 1.0]]


def test_negative_presence_penalty_encourages_repeats():
    logits = torch.tensor([[1.0, 1.2]])
    s = seq(output=[0], presence_penalty=-0.5, temperature=0.0)
    assert Sampler()(logits, [s]).token_ids == [0]


def test_penalties_apply_only_to_their_rows():
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 2)
    seqs = [seq(output=[0], frequency_penalty=2.0, temperature=0.0), seq(output=[0], temperature=0.0)]
    assert Sampler()(logits, seqs).token_ids == [1, 0]


def test_logit_bias_shifts_logits():
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    seqs = [seq(temperature=0.0, logit_bias={0: 1.5}), seq(temperature=0.0, logit_bias={1: -100.0, 2: 0.5})]
    assert Sampler()(logits, seqs).token_ids == [0, 0]
    assert sampled_set([0.0, 0.0, 0.0], draws=500, logit_bias={1: -100.0, 2: -100.0}) == {0}


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])  # eos=1, stop token 2 are the best two
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, [seq(output=[], **params)], eos_token_id=1).token_ids == [3]
    assert Sampler()(logits, [seq(output=[4], **params)], eos_token_id=1).token_ids == [3]
    assert Sampler()(logits, [seq(output=[4, 4], **params)], eos_token_id=1).token_ids == [1]
    # several EOS ids (Llama 3 lists more than one)
    assert Sampler()(logits, [seq(output=[], **params)], eos_token_id=[1, 3]).token_ids == [4]
    # sampling rows never draw a masked token either
    assert sampled_set([0.0, 5.0, 4.0, 3.0, 1.0], draws=500, eos=1, min_tokens=1,
                       stop_token_ids=[2, 3]) == {0, 4}


def test_ignore_eos_does_not_mask_eos():
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    s = seq(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, [s], eos_token_id=1).token_ids == [1]


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g) * 3
    seqs = [seq(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=3, seed=1),
            seq(temperature=0.0, logprobs=0), seq(temperature=0.0)]
    out = Sampler()(logits, seqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert out.logprobs[2] is None
    assert lp0.token_id == out.token_ids[0]
    assert abs(lp0.logprob - ref[0, lp0.token_id].item()) < 1e-5
    best = ref[0].topk(3)
    assert [t for t, _ in lp0.top] == best.indices.tolist()
    assert all(abs(v - r) < 1e-5 for (_, v), r in zip(lp0.top, best.values.tolist(), strict=True))
    assert lp1.top == [] and lp1.token_id == int(ref[1].argmax())
    assert abs(lp1.logprob - ref[1].max().item()) < 1e-5


def test_seeded_rows_reproduce_across_batches_and_orders():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(5, 300, generator=g)
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_p=0.9, seed=12),
              SamplingParams(temperature=1.2, top_k=40, seed=11), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, min_p=0.05, seed=99)]

    def run(order, steps=30):
        seqs = {i: Sequence(f"r{i}", [1, 2], params[i], index=i % 2) for i in order}
        got = {i: [] for i in order}
        sampler = Sampler()
        for _ in range(steps):
            out = sampler(rows[list(order)], [seqs[i] for i in order])
            for i, t in zip(order, out.token_ids, strict=True):
                seqs[i].append_token(t)
                got[i].append(t)
        return got

    alone = {i: run([i])[i] for i in (0, 1, 2, 4)}
    together = run([4, 3, 2, 1, 0])
    shuffled = run([1, 3, 0, 4, 2])
    for i in (0, 1, 2, 4):
        assert together[i] == alone[i] == shuffled[i], i
    assert alone[0] != alone[2]  # same seed, other index (n > 1 children differ)
    assert len(set(alone[0])) > 5


def test_seeded_draws_follow_the_distribution():
    # one seeded request over many positions: uniforms are spread, so frequencies match the probabilities
    us = [seeded_uniform(1234, 0, pos) for pos in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us)
    hist = torch.histc(torch.tensor(us), bins=10, min=0.0, max=1.0) / len(us)
    assert torch.allclose(hist, torch.full((10,), 0.1), atol=0.01)
    assert seeded_uniform(1234, 0, 5) == seeded_uniform(1234, 0, 5) != seeded_uniform(1234, 1, 5)
    assert seeded_uniform(-1, 0, 0) != seeded_uniform(1, 0, 0)


def test_bad_logits_shape_is_an_error():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), [seq()])


def test_warpers_agree_with_hugging_face_on_random_logits():
    """Same kept set as transformers' temperature → top-k → top-p → min-p chain (its generate order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    g = torch.Generator().manual_seed(5)
    vocab = 700  # > the first candidate window, so top-p's candidate growth is exercised
    for trial in range(20):
        rows = 12
        logits = torch.randn(rows, vocab, generator=g) * float(torch.empty(1).uniform_(0.5, 6, generator=g))
        params = []
        for _ in range(rows):
            r = torch.rand(4, generator=g).tolist()
            params.append(SamplingParams(
                temperature=0.3 + 1.5 * r[0],
                top_k=[0, 1, 5, 50, 400][int(r[1] * 5)],
                top_p=1.0 if r[2] < 0.3 else 0.05 + 0.94 * r[2],
                min_p=0.0 if r[3] < 0.5 else 0.5 * r[3]))
        got = warp_logits(logits, params) > NEG
        for i, p in enumerate(params):
            ref = logits[i:i + 1].clone()
            ids = torch.zeros(1, 1, dtype=torch.long)
            ref = TemperatureLogitsWarper(p.temperature)(ids, ref)
            if p.top_k > 0:
                ref = TopKLogitsWarper(p.top_k)(ids, ref)
            if p.top_p < 1.0:
                ref = TopPLogitsWarper(p.top_p)(ids, ref)
            if p.min_p > 0:
                ref = MinPLogitsWarper(p.min_p)(ids, ref)
            assert torch.equal(got[i], (ref > NEG)[0]), (trial, i, p)


def test_inverse_cdf_never_picks_an_excluded_token():
    from engine.sampler import _inverse_cdf
    x = torch.tensor([[NEG, 0.0, 1.0, NEG, NEG], [2.0, NEG, NEG, NEG, NEG]])
    for u in (0.0, 0.5, 1.0 - 2 ** -53):
        picked = _inverse_cdf(x, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert picked[0] in (1, 2) and picked[1] == 0
    assert _inverse_cdf(x, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1, 0]
    assert _inverse_cdf(x, torch.tensor([1.0 - 2 ** -53] * 2, dtype=torch.float64)).tolist() == [2, 0]


def test_empty_batch_and_half_precision_logits():
    assert Sampler()(torch.zeros(0, 10), []) == SamplerOutput([], [])
    logits = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, [seq(temperature=0.0, logprobs=1)])
    assert out.token_ids == [1] and out.logprobs[0].top[0][0] == 1


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_seeded_row_ignores_its_companions(data):
    """The token a seeded request gets depends only on its logits, its params and its position."""
    vocab = 64
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    params_st = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
                          top_k=st.sampled_from([0, 3, 20]), top_p=st.sampled_from([1.0, 0.9, 0.5]),
                          min_p=st.sampled_from([0.0, 0.1]), seed=st.one_of(st.none(), st.integers(0, 2 ** 40)),
                          repetition_penalty=st.sampled_from([1.0, 1.3]),
                          frequency_penalty=st.sampled_from([0.0, 0.5]))
    mine = SamplingParams(temperature=data.draw(st.sampled_from([0.6, 1.0, 1.5])),
                          top_p=data.draw(st.sampled_from([1.0, 0.8])), seed=data.draw(st.integers(0, 2 ** 63)))
    me = Sequence("me", [1, 2, 3], mine, index=data.draw(st.integers(0, 3)))
    for t in data.draw(st.lists(st.integers(0, vocab - 1), max_size=5)):
        me.append_token(t)
    my_logits = torch.randn(1, vocab, generator=g)
    others = [Sequence("o", [4, 5], p) for p in data.draw(st.lists(params_st, max_size=6))]
    pos = data.draw(st.integers(0, len(others)))
    batch = others[:pos] + [me] + others[pos:]
    logits = torch.cat([torch.randn(pos, vocab, generator=g), my_logits,
                        torch.randn(len(others) - pos, vocab, generator=g)])
    alone = Sampler()(my_logits, [me]).token_ids[0]
    assert Sampler()(logits, batch).token_ids[pos] == alone


def test_wide_rows_sample_the_distribution_in_two_levels():
    """Vocabulary wider than the block sum path (and not a multiple of its block): exact support, right odds."""
    from engine.sampler import _inverse_cdf
    vocab = 3001
    x = torch.full((1, vocab), NEG)
    chosen = {5: 0.3, 255: 0.1, 256: 0.2, 1800: 0.15, 3000: 0.25}  # block edges and the padded last block
    for t, p in chosen.items():
        x[0, t] = math.log(p)
    n = 6000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    picked = _inverse_cdf(x.repeat(n, 1), u)
    counts = torch.bincount(picked, minlength=vocab)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(chosen)
    for t, p in chosen.items():
        assert abs(counts[t].item() / n - p) < 0.025, t
    edges = torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)
    assert _inverse_cdf(x.repeat(2, 1), edges).tolist() == [5, 3000]
    # the same draws from a one-level CDF over the same logits pick the same tokens
    from engine.sampler import _search
    one_level = _search(torch.softmax(x, -1).repeat(n, 1).cumsum(-1, dtype=torch.float64), u)
    assert (one_level != picked).sum().item() <= 2  # only float rounding at a boundary may differ


def test_filtered_rows_follow_the_renormalized_distribution():
    """top-k / top-p / min-p rows draw from the kept tokens with their renormalized odds."""
    probs = torch.tensor([0.05, 0.35, 0.1, 0.3, 0.2])
    n = 12000
    cases = [(dict(top_k=3), {1: 0.35, 3: 0.3, 4: 0.2}), (dict(top_p=0.6), {1: 0.35, 3: 0.3}),
             (dict(min_p=0.5), {1: 0.35, 3: 0.3, 4: 0.2}), (dict(top_k=4, temperature=0.5), None)]
    for params, kept in cases:
        out = Sampler(seed=11)(probs.log().repeat(n, 1), [seq(**params)] * n)
        freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).double() / n
        if kept is None:  # temperature 0.5 squares the odds: p^2 over the 4 best
            kept = {t: probs[t].item() ** 2 for t in (1, 2, 3, 4)}
        total = sum(kept.values())
        for t in range(5):
            want = kept.get(t, 0.0) / total
            assert abs(freq[t].item() - want) < 0.02, (params, t, freq.tolist())


def test_top_p_that_rounds_to_zero_keeps_the_best_token():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    seqs = [Sequence("a", [1, 2, 3], SamplingParams(top_p=1e-300)),
            Sequence("b", [1, 2, 3], SamplingParams(top_p=1e-300, top_k=5))]
    out = Sampler(seed=0)(logits, seqs, 2)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_repetition_penalty_below_the_floor_is_refused():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(repetition_penalty=2.2e-308)
    assert err.value.param == "repetition_penalty"
