"""SpecDecoder: who gets drafts (and how many), the back-off, and keeping the longest agreeing run. Pure."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import DraftView, SpecDecoder, grammar_prefix

CFG = SpeculativeConfig("ngram", 3, 1, 2, disable_by_batch_size=4)


def decoding(prompt=(1, 2, 3, 1, 2), output=(3,), **params) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


def test_drafts_for_a_decoding_sequence_capped_by_max_tokens_and_max_model_len():
    spec = SpecDecoder(CFG, max_model_len=64, gated=False)
    assert spec.propose(decoding(), 1) == [1, 2, 3]  # "2 3" occurred at 1..2
    assert spec.propose(decoding(max_tokens=3), 1) == [1]  # 1 output so far: 2 more at most, the last one sampled
    assert spec.propose(decoding(max_tokens=2), 1) == []
    assert SpecDecoder(CFG, max_model_len=8, gated=False).propose(decoding(), 1) == [1, 2]  # positions 5..7


def test_no_drafts_for_first_tokens_or_large_batches_and_lora_gets_them():
    spec = SpecDecoder(CFG, max_model_len=64, gated=False)
    seq = decoding()
    assert spec.propose(seq, 4) == [1, 2, 3] and spec.propose(seq, 5) == []  # disable_by_batch_size 4
    lora = decoding()
    lora.lora = object()
    assert spec.propose(lora, 1) == [1, 2, 3]  # each verifying row carries its sequence's adapter
    assert spec.propose(decoding(output=()), 1) == []  # the prompt's last token: the first output comes next


# A toy vocabulary for a real grammar matcher: tokens a, b, c and the stop token </s>.
A, B, C, STOP = 0, 1, 2, 3


def matcher(grammar: str = 'root ::= "abab" "c"'):
    import xgrammar as xgr

    info = xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[STOP])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar))


def allowed(m) -> list[int]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, 4)
    m.fill_next_token_bitmask(bitmask, 0)
    return [t for t in range(4) if int(bitmask[0, 0]) >> t & 1]


def test_grammar_drafts_stop_before_a_refused_token_or_the_grammars_end():
    m = matcher()
    assert grammar_prefix(m, [A, B, A, B, C, STOP]) == [A, B, A, B, C]  # the stop token would end the grammar
    assert grammar_prefix(m, [A, B, B, A]) == [A, B]  # "abb" is refused: nothing from there on
    assert grammar_prefix(m, [C]) == []
    assert allowed(m) == [A]  # the sequence's own matcher did not move
    done = matcher('root ::= "a"')
    done.accept_token(A)
    done.accept_token(STOP)
    assert grammar_prefix(done, [A]) == []


def test_a_constrained_sequence_gets_drafts_its_grammar_accepts_and_rows_masked_at_each_position():
    spec = SpecDecoder(CFG, max_model_len=64, gated=False)
    seq = decoding(prompt=(A, B, A, B), output=(A,))
    seq.matcher = matcher('root ::= "a" "bab"*')
    seq.matcher.accept_token(A)
    assert spec.propose(seq, 1) == [B, A, B]  # "a" occurred at 0 and 2: b a b followed (a repeating tail)
    seq.matcher = matcher('root ::= "ab" "c"')
    seq.matcher.accept_token(A)
    assert spec.propose(seq, 1) == [B]  # the grammar refuses the second draft (a after "ab")
    rows = spec.sampling_rows([seq, seq], {seq.seq_id: [B]})
    assert rows[0] is seq and allowed(rows[0].matcher) == [B] and allowed(rows[1].matcher) == [C]
    assert allowed(seq.matcher) == [B]  # rows read forks: the engine advances the matcher by the kept tokens


def test_a_sequence_whose_drafts_all_fail_backs_off_doubling():
    spec = SpecDecoder(CFG, max_model_len=1024, gated=False)
    seq = decoding()
    pattern = []
    for _ in range(20):
        d = spec.propose(seq, 1)
        pattern.append(len(d) > 0)
        if d:
            spec.accept([seq] * (len(d) + 1), [0] * (len(d) + 1), [None] * (len(d) + 1), {seq.seq_id: d})
    # proposes, skips 1, proposes, skips 2, proposes, skips 4, proposes, skips 8, proposes
    assert pattern == [True, False, True, False, False, True, False, False, False, False, True] + [False] * 8 + [True]


def test_a_kept_draft_resets_the_back_off():
    spec = SpecDecoder(CFG, max_model_len=1024, gated=False)
    seq = decoding()
    d = spec.propose(seq, 1)
    spec.accept([seq] * 4, [9, 9, 9, 9], [None] * 4, {seq.seq_id: d})  # all rejected
    assert spec.propose(seq, 1) == []  # skips one step
    d = spec.propose(seq, 1)
    spec.accept([seq] * 4, [d[0], 9, 9, 9], [None] * 4, {seq.seq_id: d})  # one kept
    assert spec.propose(seq, 1) == d


def test_rows_and_the_longest_agreeing_run():
    spec = SpecDecoder(CFG, max_model_len=64, gated=False)
    a, b, c = decoding(), decoding(output=(3, 7)), decoding(output=(3, 8))
    drafts = {a.seq_id: [1, 2, 3], c.seq_id: [5]}
    seqs = [a] * 4 + [b] + [c] * 2
    rows = spec.sampling_rows(seqs, drafts)
    assert rows[0] is a and rows[4] is b and rows[5] is c
    assert [r.token_ids[-2:] for r in rows[1:4]] == [[3, 1], [1, 2], [2, 3]]
    assert isinstance(rows[6], DraftView) and rows[6].num_output_tokens == 3 and rows[6].num_tokens == 8
    assert rows[6].output_token_ids == [3, 8, 5] and rows[6].matcher is None and rows[6].index == c.index
    sampled = [1, 2, 9, 4, 11, 6, 12]  # a: 1 and 2 kept, 9 instead of 3; b: 11; c: 6 instead of 5
    lps = list("abcdefg")
    out = spec.accept(seqs, sampled, lps, drafts)
    assert [(s is x, t, lp, k) for (s, t, lp, k), x in zip(out, (a, b, c), strict=True)] == [
        (True, [1, 2, 9], ["a", "b", "c"], 3), (True, [11], ["e"], 0), (True, [6], ["f"], 1)]
    st = spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos) == (2, 4, 2, [1, 1, 0])
    spec.accept([a] * 4, [1, 2, 3, 4], [None] * 4, {a.seq_id: [1, 2, 3]})  # all kept, plus the bonus token
    assert spec.stats.accepted_per_pos == [2, 2, 1] and spec.stats.num_accepted_tokens == 5


def test_the_gate_decides_each_step_for_prompt_lookup_too():
    """ngram and suffix draft only in steps the gate allows (engine/spec/draft_gate.py): a control step first, then
    drafts; drafts that cost more than they gain close it, and a closed gate's probe drafts for PROBE_SEQS."""
    from types import SimpleNamespace

    from engine.spec.draft_gate import MIN_PROBE_EVERY, PROBE_SEQS
    from engine.step_time import StepShape

    spec = SpecDecoder(SpeculativeConfig("ngram", 3, 1, 2), max_model_len=64)
    seqs = [decoding() for _ in range(PROBE_SEQS + 2)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1

    def step(step_s: float) -> list[list[int]]:
        spec.begin_step(seqs)
        drafts = [spec.propose(s, len(seqs)) for s in seqs]
        rows, sampled = [], []
        for s, d in zip(seqs, drafts, strict=True):  # the first draft kept, the next one not
            rows += [s] * (len(d) + 1)
            sampled += ([d[0]] + [9] * len(d)) if d else [9]
        spec.accept(rows, sampled, [None] * len(rows), {s.seq_id: d for s, d in zip(seqs, drafts, strict=True)})
        verify = sum(len(d) + 1 for d in drafts if d)
        shape = StepShape(verify, sum(not d for d in drafts), 50 * len(seqs))
        spec.end_step(step_s, SimpleNamespace(shape=shape, scheduled=[SimpleNamespace(spec_token_ids=d)
                                                                          for d in drafts]))
        return drafts

    assert step(0.010) == [[]] * len(seqs)  # no baseline yet: a control step, measured
    assert step(0.040) == [[1, 2, 3]] * len(seqs)  # open: every sequence drafts
    gate = spec.gate
    assert not gate.open and gate.speedup == pytest.approx(0.5)  # twice the tokens in 4x the time
    for _ in range(MIN_PROBE_EVERY - 1):
        assert step(0.010) == [[]] * len(seqs)
    probe = step(0.030)
    assert sum(bool(d) for d in probe) == PROBE_SEQS  # a probe: the first PROBE_SEQS that find a draft
    assert spec.stats.num_drafts == len(seqs) + PROBE_SEQS
