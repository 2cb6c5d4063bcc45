"""`"method": "draft_model"` on the bundled SmolLM2: drafts from a second model on its own paged KV.

Under --deterministic the output is the output without speculation, bit for bit; with the model as its own draft
every draft is kept (the draft's caches are right after rejections, chunked prompts, prefix hits and forks); the
draft's pool gives blocks back when sequences end or must make room; a draft checkpoint that cannot serve is an
error naming the flag's field."""

from __future__ import annotations

import pytest
import torch

from contract.errors import ConfigError
from engine import LLM, SamplingParams
from engine.attention import get_attention_backend
from engine.model.fast_paths import use_fast_paths
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.sequence import Sequence
from engine.spec.draft_model import DraftModel
from loadtest.layer_draft import write_layer_draft
from tests.engine._tiny_llama import make_tiny_llama
from tests.engine.spec.test_spec_engine import assert_nothing_held, greedy_params, prompts, run

MAX_LEN = 512


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model("smollm2"), torch.bfloat16, "cpu", MAX_LEN)


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory):
    """The bundled model's first 4 layers, embeddings, norm and head: an untrained draft that rarely agrees."""
    return write_layer_draft("smollm2", 4, str(tmp_path_factory.mktemp("draft4")))


def engine(model, draft: str | None, k: int = 4, **kw) -> LLM:
    """With a draft, its gate is off (engine/spec/draft_gate.py): every step drafts, whatever drafting gains here."""
    args = dict(dtype="bfloat16", max_model_len=MAX_LEN, num_blocks=400, num_threads=2, max_num_seqs=8,
                max_num_batched_tokens=64, deterministic=True)
    args.update(kw)
    spec = None if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    llm = LLM("smollm2", loaded_model=model, speculative_config=spec, **args)
    if draft is not None:
        llm.engine.spec.gate = None
    return llm


def assert_draft_pool_free(llm: LLM) -> None:
    draft = llm.engine.spec.draft
    assert draft.kv.num_free_blocks == draft.kv.num_blocks and draft.num_tracked == 0


def compare(model, draft: str, num_prompts: int, max_tokens: int) -> LLM:
    base_llm = engine(model, None)
    toks = prompts(base_llm)[:num_prompts]
    base = run(base_llm, toks, greedy_params(len(toks), max_tokens))
    llm = engine(model, draft)
    spec = run(llm, toks, greedy_params(len(toks), max_tokens))
    assert spec == base  # tokens, logprobs (with their top 2), text and finish reason of every completion
    assert_nothing_held(llm)
    assert_draft_pool_free(llm)
    return llm


def test_the_model_as_its_own_draft_has_every_draft_kept(model):
    """Eight prompts (one n=2, one a prefix hit), prefilled in 64-token steps beside the drafts: the output is the
    output without speculation, and a draft that computes what the target computes is never rejected."""
    llm = compare(model, "smollm2", 8, 40)
    st = llm.engine.spec.stats
    assert st.num_drafts > 20 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.accepted_per_pos[0] == st.num_drafts


def test_a_draft_that_rarely_agrees_keeps_the_greedy_and_seeded_outputs(model, cut_draft):
    llm = compare(model, cut_draft, 5, 32)
    st = llm.engine.spec.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens < st.num_draft_tokens
    toks = prompts(llm)[:4]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=5 + i, max_tokens=24, ignore_eos=True, logprobs=0)
              for i in range(len(toks))]
    assert run(llm, toks, seeded) == run(engine(model, None), toks, seeded)
    assert_nothing_held(llm)
    assert_draft_pool_free(llm)


def test_drafts_from_kept_caches_equal_drafts_from_scratch(model):
    """One DraftModel whose pool holds two sequences' blocks, proposing as the target moves on (some drafts kept,
    then another token), against a fresh DraftModel per call: the same drafts; a sequence that finds no room while
    the others are proposed for gets none, and makes room by evicting them when proposed for alone."""
    det = use_fast_paths(model[0], "cpu", torch.bfloat16, deterministic=True)
    backend = get_attention_backend("cpu", torch.device("cpu"), torch.bfloat16, True)

    def draft_model(num_blocks: int) -> DraftModel:
        return DraftModel(det, backend, num_blocks, 16, max_model_len=MAX_LEN)

    seqs = [Sequence(f"r{i}", list(range(100 + 7 * i, 130 + 16 * i))) for i in range(3)]  # 30, 39, 48 tokens
    kept = draft_model(8)  # 16-token blocks: the first two take 5-7, the third needs 4
    for round_ in range(4):
        got = kept.propose([(s, 3) for s in seqs])
        assert sorted(got) == sorted(s.seq_id for s in seqs[:2])
        for s in seqs[:2]:
            assert got[s.seq_id] == draft_model(64).propose([(s, 3)])[s.seq_id]
            kept_drafts, own = [(0, True), (1, True), (2, False), (0, True)][round_]
            for tok in got[s.seq_id][:kept_drafts]:  # the target keeps some drafts, then samples its own token,
                s.append_token(tok)  # or (a verification cut short) its token is the next draft, K/V already kept
            if own:
                s.append_token(1000 + round_)
    assert kept.kv.num_free_blocks < 4
    alone = kept.propose([(seqs[2], 3)])
    assert alone[seqs[2].seq_id] == draft_model(64).propose([(seqs[2], 3)])[seqs[2].seq_id]
    assert kept._seqs[seqs[0].seq_id].block_table == []  # the longest idle gave its blocks back
    for s in seqs:
        kept.finished(s)
    assert kept.kv.num_free_blocks == 8 and kept.num_tracked == 0


def test_draft_checkpoints_that_cannot_serve_are_errors_naming_the_field(model, tmp_path):
    with pytest.raises(ConfigError) as e:
        engine(model, str(tmp_path / "missing"))
    assert e.value.field == "--speculative-config"
    assert str(e.value).startswith(f"--speculative-config: model '{tmp_path / 'missing'}'")
    other = make_tiny_llama(str(tmp_path / "tiny"), vocab_size=1000)
    with pytest.raises(ConfigError, match="its vocabulary has 1000 tokens, the model's 49152"):
        engine(model, other)


def test_the_gate_stops_drafts_that_do_not_pay_and_keeps_those_that_do(model, cut_draft):
    """Served as configured (the gate on): a draft that rarely agrees stops drafting within a few steps and then
    drafts only in probe steps; the output is the same either way."""
    toks = prompts(engine(model, None))[:3]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True) for _ in toks]
    base = run(engine(model, None), toks, params)
    llm = LLM("smollm2", loaded_model=model, dtype="bfloat16", max_model_len=MAX_LEN, num_blocks=400, num_threads=2,
              deterministic=True, speculative_config={"method": "draft_model", "model": cut_draft,
                                                      "num_speculative_tokens": 4})
    assert run(llm, toks, params) == base
    gate = llm.engine.spec.gate
    assert not gate.open and gate.speedup < 1 and gate.num_closed_steps > 20
    assert llm.engine.spec.stats.num_drafts < 20  # of ~48 decode steps for each of 3 sequences
    assert_draft_pool_free(llm)


def test_grammar_requests_keep_their_greedy_tokens_with_a_draft_model(model):
    """A draft model's drafts for a constrained request are cut where its grammar refuses one, and each verifying
    row is masked: the same tokens and logprobs as without, answers that match, drafts kept."""
    from engine.structured.spec import Guide

    base_llm = engine(model, None)
    tok = base_llm.engine.tokenizer
    toks = [tok.encode("List fruits, separated by commas: apple, banana, cherry, date, fig, grape. Again:"),
            tok.encode('Copy this JSON: {"fruit": ["apple", "banana", "cherry"], "count": 3}\nJSON: ')]
    pattern = r"( ?(apple|banana|cherry|date|fig|grape)[,.]){8}"
    schema = {"type": "object", "properties": {"fruit": {"type": "array", "items": {"type": "string"}},
                                               "count": {"type": "integer"}}, "required": ["fruit", "count"]}

    def params():
        return [SamplingParams(temperature=0, max_tokens=32, logprobs=2, guide=Guide.regex(pattern)),
                SamplingParams(temperature=0, max_tokens=48, logprobs=2, guide=Guide.json_schema(schema))]

    base = run(base_llm, toks, params())
    llm = engine(model, "smollm2")
    assert run(llm, toks, params()) == base
    import json
    import re

    (regex_out,), (json_out,) = base
    assert regex_out[3] == "stop" and re.fullmatch(pattern, regex_out[2])
    assert json_out[3] == "stop" and set(json.loads(json_out[2])) == {"fruit", "count"}
    assert llm.engine.spec.stats.num_accepted_tokens > 10
    assert_nothing_held(llm)
    assert_draft_pool_free(llm)


def test_a_probe_drafts_for_the_few_sequences_the_draft_has_seen_most_of(model):
    """With the gate closed, a probe step drafts for PROBE_SEQS sequences: those with the fewest tokens the draft
    would first have to compute."""
    from engine.spec.config import SpeculativeConfig
    from engine.spec.decoder import SpecDecoder
    from engine.spec.draft_gate import PROBE_SEQS

    det = use_fast_paths(model[0], "cpu", torch.bfloat16, deterministic=True)
    backend = get_attention_backend("cpu", torch.device("cpu"), torch.bfloat16, True)
    spec = SpecDecoder(SpeculativeConfig("draft_model", 2, model="smollm2"), MAX_LEN,
                       DraftModel(det, backend, 64, 16, max_model_len=MAX_LEN))
    seqs = [Sequence(f"r{i}", list(range(200, 220 + 5 * i))) for i in range(7)]  # 20, 25, ... 50 prompt tokens
    for s in seqs:
        s.append_token(7)
        s.num_computed_tokens = s.num_tokens - 1  # decoding
    spec.gate.observe_plain(0.01, len(seqs))  # a baseline: the open gate drafts
    spec.begin_step(seqs[4:])
    assert sorted(spec._pending) == [s.seq_id for s in seqs[4:]]
    closed = spec.gate.verdict(len(seqs))
    closed.open, closed.idle = False, closed.probe_every - 1  # closed, a probe due
    spec.begin_step(seqs)
    assert PROBE_SEQS == 4 and sorted(spec._pending) == [seqs[0].seq_id] + [s.seq_id for s in seqs[4:]]


def test_the_draft_cache_takes_its_share_of_the_kv_memory(model):
    """--kv-cache-memory holds both caches: with the model as its own draft (the same K/V bytes per token) the
    engine gets half the blocks, and the draft's pool as many."""
    kw = dict(dtype="bfloat16", max_model_len=MAX_LEN, num_threads=2, kv_cache_memory=0.05)
    plain = LLM("smollm2", loaded_model=model, **kw).engine.kv.num_blocks
    llm = LLM("smollm2", loaded_model=model, speculative_config={"method": "draft_model", "model": "smollm2",
                                                                 "num_speculative_tokens": 2}, **kw)
    assert llm.engine.kv.num_blocks == plain // 2 and llm.engine.spec.draft.kv.num_blocks == plain // 2


def test_aborted_and_finished_requests_give_their_draft_blocks_back(model):
    llm = engine(model, "smollm2")
    eng = llm.engine
    toks = prompts(llm)[:3]
    for i, t in enumerate(toks):
        eng.add_request(f"r{i}", t, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(3):  # prompts, then a drafting step for each (every draft kept: 5 tokens a step)
        eng.step()
    assert eng.spec.draft.num_tracked == 3 and eng.spec.stats.num_drafts > 0  # all three drafted for
    eng.abort_request("r1")
    assert eng.spec.draft.num_tracked == 2
    while eng.has_unfinished_requests():
        eng.step()
    assert_nothing_held(llm)
    assert_draft_pool_free(llm)
