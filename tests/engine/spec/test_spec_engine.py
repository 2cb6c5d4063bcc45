"""Speculative decoding on the bundled SmolLM2 (offline API): the same greedy tokens (and, under --deterministic,
the same logprobs and seeded samples) with and without drafts, in mixed batches with chunked prefill, prefix hits
and n > 1; stops and max_tokens inside accepted runs; no block leaked."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_model
from engine.model.registry import resolve_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_LEN = 512

LIST = "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Repeat: apple, banana,"
REPEATING = [
    LIST,
    "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n"
    "apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Rename the variable x to count in this code:\nx = 0\nfor item in items:\n    if item.ok:\n        x += 1\n"
    "print(x)\n\nAnswer:\ncount = 0\nfor item in items:\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model("smollm2"), torch.bfloat16, "cpu", MAX_LEN)


def ungated(llm: LLM) -> LLM:
    """Every step drafts, whatever drafting gains on this machine (engine/spec/draft_gate.py): the tests count
    drafts and compare what verifying steps produce."""
    if llm.engine.spec is not None:
        llm.engine.spec.gate = None
    return llm


def engine(model, spec: bool, **kw) -> LLM:
    args = dict(dtype="bfloat16", max_model_len=MAX_LEN, num_blocks=400, num_threads=2, max_num_seqs=8,
                max_num_batched_tokens=64)
    args.update(kw)
    return ungated(LLM("smollm2", loaded_model=model, speculative_config=SPEC if spec else None, **args))


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    out = [tok.encode(p) for p in REPEATING]
    rng = random.Random(3)
    out += [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(2)]
    out.append(out[0][:40] + tok.encode(" The list again:"))  # a prefix hit on the first prompt's blocks
    return out


def run(llm: LLM, token_lists, params):
    outs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params)
    return [[(list(c.token_ids), c.logprobs, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def assert_nothing_held(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.pool.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.has_unfinished()


def greedy_params(n_prompts: int, max_tokens: int) -> list[SamplingParams]:
    p = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2) for _ in range(n_prompts)]
    p[1] = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, n=2)
    return p


def compare_greedy(model, deterministic: bool, num_prompts: int, max_tokens: int, **kw) -> None:
    base_llm = engine(model, False, deterministic=deterministic, **kw)
    toks = prompts(base_llm)[:num_prompts]
    base = run(base_llm, toks, greedy_params(len(toks), max_tokens))
    spec_llm = engine(model, True, deterministic=deterministic, **kw)
    spec = run(spec_llm, toks, greedy_params(len(toks), max_tokens))
    st = spec_llm.engine.spec.stats
    print(f"\ngreedy ({'deterministic' if deterministic else 'default'}): {st.num_accepted_tokens} of "
          f"{st.num_draft_tokens} drafts accepted ({st.num_accepted_tokens / max(1, st.num_draft_tokens):.0%}) in "
          f"{st.num_drafts} verifications; by position {st.accepted_per_pos}")
    for b, s in zip(base, spec, strict=True):
        for (bt, blp, btext, bfin), (stok, slp, stext, sfin) in zip(b, s, strict=True):
            assert stok == bt and stext == btext and sfin == bfin
            assert len(slp) == len(stok)
            assert [lp.token_id for lp in slp] == stok
            if deterministic:  # bit for bit: the verifying rows' logits are a decode step's
                assert [(lp.logprob, lp.top) for lp in slp] == [(lp.logprob, lp.top) for lp in blp]
    assert st.num_accepted_tokens > 5 and st.num_drafts > 5
    assert_nothing_held(spec_llm)


def test_greedy_tokens_and_logprobs_equal_with_and_without_speculation(model):
    """--deterministic, the repeating prompts (one with n=2) and a random one, 24 tokens each."""
    compare_greedy(model, True, 3, 24)


def test_greedy_tokens_equal_on_every_prompt(model):
    """Repeating, code-editing and random prompts, n=2, prompts prefilled in chunks beside the drafts (64-token
    steps); --deterministic: tokens and logprobs bit for bit."""
    compare_greedy(model, True, 8, 40)


class ScriptedGate:
    """A gate that drafts in every other step, closed (probing): what a gate flipping mid-stream does to the
    engine, without waiting for this machine's timings to flip the real one (tests/engine/spec/test_draft_gate.py
    covers its decisions)."""

    def __init__(self) -> None:
        self.open, self.steps, self.probes, self.learnt = False, 0, 0, 0

    def allow(self, decoding: int) -> bool:
        self.steps += 1
        self.probes += self.steps % 2
        return bool(self.steps % 2)

    def observe(self, *args) -> None:
        self.learnt += 1

    def observe_plain(self, *args) -> None:
        self.learnt += 1


def test_steps_the_gate_leaves_undrafted_and_probes_keep_the_tokens(model):
    """Drafting switched on and off from step to step, each drafting step a probe (at most PROBE_SEQS sequences
    draft), over 8 prompts with chunked prefill and n=2: --deterministic tokens and logprobs are those without
    speculation, no block is held after, and the steps of decodes only reach the gate."""
    from engine.spec.draft_gate import PROBE_SEQS

    base_llm = engine(model, False, deterministic=True)
    toks = prompts(base_llm)[:8]
    base = run(base_llm, toks, greedy_params(len(toks), 40))
    llm = engine(model, True, deterministic=True)
    gate = llm.engine.spec.gate = ScriptedGate()
    assert run(llm, toks, greedy_params(len(toks), 40)) == base
    st = llm.engine.spec.stats
    assert 0 < st.num_drafts <= PROBE_SEQS * gate.probes and st.num_accepted_tokens > 5
    assert 0 < gate.learnt < gate.steps
    assert_nothing_held(llm)


@pytest.mark.slow
def test_greedy_tokens_equal_in_default_mode(model):
    """Default mode picks kernels by step size, so drafts that change how a prompt is chunked move its logits'
    last bits (docs/engine.md#determinism): with room for every prompt in one step, greedy tokens are equal."""
    compare_greedy(model, False, 8, 40, max_num_batched_tokens=2048)


def test_suffix_decoding_keeps_the_greedy_tokens_and_learns_from_finished_requests(model):
    """`suffix`: --deterministic greedy tokens and logprobs equal without speculation; a second round of the same
    prompts keeps more drafts than the first, from the outputs the first round left in the shared index."""
    suffix = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_spec_factor": 2.0}
    base_llm = engine(model, False, deterministic=True)
    toks = prompts(base_llm)[:4]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2) for _ in toks]
    base = run(base_llm, toks, params)
    llm = ungated(LLM("smollm2", loaded_model=model, speculative_config=suffix, dtype="bfloat16",
                      max_model_len=MAX_LEN, num_blocks=400, num_threads=2, max_num_seqs=8, max_num_batched_tokens=64,
                      deterministic=True))
    assert run(llm, toks, params) == base
    st = llm.engine.spec.stats
    first = st.num_accepted_tokens
    assert first > 5 and llm.engine.spec.cache.num_requests == len(toks)
    assert run(llm, toks, params) == base
    assert st.num_accepted_tokens - first > first  # the same answers again: drafted from the cache
    assert_nothing_held(llm)


def test_seeded_samples_are_the_same_and_unseeded_ones_complete(model):
    toks = prompts(engine(model, False))[:4]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=32, ignore_eos=True, logprobs=0)
              for i in range(len(toks))]
    base = run(engine(model, False, deterministic=True), toks, seeded)
    llm = engine(model, True, deterministic=True)
    spec = run(llm, toks, seeded)
    assert [[c[0] for c in o] for o in spec] == [[c[0] for c in o] for o in base]  # the same draws, position by position
    assert llm.engine.spec.stats.num_drafts > 0
    free = [SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.1, presence_penalty=0.5, max_tokens=32,
                           ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.7, min_tokens=5, max_tokens=32, logprobs=1),
            SamplingParams(temperature=0.5, frequency_penalty=0.3, max_tokens=32, ignore_eos=True, n=2, logprobs=1),
            SamplingParams(temperature=0.3, max_tokens=32, ignore_eos=True)]
    for out, p in zip(run(llm, toks, free), free, strict=True):
        for tokens, lps, _, finish in out:
            assert finish in ("stop", "length")
            assert len(tokens) == p.max_tokens or finish == "stop"
            assert lps is None if p.logprobs is None else len(lps) == len(tokens)
    assert_nothing_held(llm)


def test_stops_and_max_tokens_inside_an_accepted_run(model):
    base_llm = engine(model, False, deterministic=True)
    toks = [base_llm.engine.tokenizer.encode(LIST)]  # its answer copies the prompt: drafts are kept
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = [o[0][0] for o in run(base_llm, toks, [greedy])]
    llm = engine(model, True, deterministic=True)
    for i, tokens in enumerate(base):
        # a stop token first seen well inside the output, max_tokens that cut a run, a stop string
        j = next(j for j in range(3, len(tokens)) if tokens[j] not in tokens[:j])
        cases = [(SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[tokens[j]]), tokens[:j + 1], "stop"),
                 (SamplingParams(temperature=0, max_tokens=j, ignore_eos=True), tokens[:j], "length")]
        text = base_llm.engine.tokenizer.decode(tokens)
        word = text[len(text) // 2:len(text) // 2 + 4]
        cases.append((SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[word]), None, "stop"))
        for params, want, finish in cases:
            (out,) = run(llm, [toks[i]], [params])
            got, _, got_text, got_finish = out[0]
            assert got_finish == finish
            if want is not None:
                assert got == want
            else:
                assert got_text == text[:text.index(word)]
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    assert_nothing_held(llm)


def test_deltas_carry_the_accepted_run(model):
    """A step with accepted drafts reports every token it kept in one delta, and the text of the deltas is the text
    of the tokens."""
    llm = engine(model, True)
    tok = llm.engine.tokenizer
    eng = llm.engine
    eng.add_request("r", tok.encode(LIST), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                  logprobs=1))
    sizes, tokens = [], []
    while eng.has_unfinished_requests():
        for d in eng.step():
            for c in d.outputs:
                sizes.append(len(c.token_ids))
                tokens += c.token_ids
                assert len(c.logprobs) == len(c.token_ids)
    assert max(sizes) > 1 and len(tokens) == 24 == sum(sizes)
    assert_nothing_held(llm)


@pytest.mark.slow
def test_acceptance_on_a_copy_heavy_prompt(model):
    """Not timing: how many drafts the model accepts when its answer copies its prompt (printed)."""
    llm = engine(model, True)
    code = "\n".join(f"    total_{i} = compute(values[{i}], scale={i}, offset=base + {i})" for i in range(12))
    prompt = (f"def update(values, base):\n{code}\n    return total\n\n# The same function, with compute renamed to "
              f"evaluate:\ndef update(values, base):\n")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120))
    st = llm.engine.spec.stats
    rate = st.num_accepted_tokens / max(1, st.num_draft_tokens)
    per_step = (st.num_accepted_tokens + st.num_drafts) / max(1, st.num_drafts)
    print(f"\ncopy-heavy prompt: {st.num_accepted_tokens}/{st.num_draft_tokens} drafts accepted ({rate:.0%}), "
          f"{per_step:.2f} tokens per verifying step, by position {st.accepted_per_pos}; "
          f"{len(out[0].outputs[0].token_ids)} tokens: {out[0].outputs[0].text[:80]!r}...")
    assert rate > 0.3


def test_structured_outputs_keep_their_grammar_and_their_greedy_tokens(model):
    """Requests with a grammar get drafts too (those the grammar accepts), each verifying row masked with the
    grammar's state at its position: --deterministic greedy tokens and logprobs equal without speculation, every
    answer matches its grammar, and drafts were kept."""
    from engine.structured.spec import Guide

    tok = engine(model, False).engine.tokenizer
    toks = [tok.encode(LIST), tok.encode(REPEATING[1]), tok.encode('Copy this JSON: {"fruit": ["apple", "banana", '
                                                                    '"cherry", "date"], "count": 4}\nJSON: ')]
    pattern = r"( ?(apple|banana|cherry|date|fig|grape)[,.]){12}"
    schema = {"type": "object", "properties": {"fruit": {"type": "array", "items": {"type": "string"}},
                                               "count": {"type": "integer"}}, "required": ["fruit", "count"]}

    def params():
        return [SamplingParams(temperature=0, max_tokens=40, logprobs=2, guide=Guide.regex(pattern)),
                SamplingParams(temperature=0, max_tokens=40, logprobs=2, guide=Guide.regex(pattern)),
                SamplingParams(temperature=0, max_tokens=60, logprobs=2, guide=Guide.json_schema(schema))]

    base = run(engine(model, False, deterministic=True), toks, params())
    llm = engine(model, True, deterministic=True)
    spec = run(llm, toks, params())
    assert spec == base
    import json
    import re

    for (tokens, _, text, finish), p in zip([o[0] for o in spec], params(), strict=True):
        assert finish == "stop" and len(tokens) < p.max_tokens
        if p.guide.kind.value == "regex":
            assert re.fullmatch(pattern, text), text
        else:
            assert set(json.loads(text)) == {"fruit", "count"}
    st = llm.engine.spec.stats
    assert st.num_accepted_tokens > 5, st
    assert_nothing_held(llm)


def test_lora_requests_get_drafts_and_keep_their_greedy_tokens(tmp_path):
    """Verifying rows carry their sequence's adapter: greedy tokens of one prompt under two adapters and the base
    model, in one batch, equal without speculation (float32, every prompt in one step), with drafts kept."""
    from engine.lora.request import LoRARequest
    from tests.engine.lora._adapters import write_adapters

    paths = write_adapters(str(tmp_path))

    def llm(spec: bool) -> LLM:
        return ungated(LLM("smollm2", dtype="float32", max_model_len=MAX_LEN, num_blocks=400, num_threads=2,
                           max_num_seqs=8, max_num_batched_tokens=2048, enable_lora=True, max_loras=2,
                           max_lora_rank=64, speculative_config=SPEC if spec else None))

    names = [None, "attn-r8", "mlp-r16"]

    def params():
        return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               lora=None if n is None else LoRARequest(n, 1 + list(paths).index(n), paths[n]))
                for n in names]

    base_llm = llm(False)
    toks = [base_llm.engine.tokenizer.encode(REPEATING[0])] * len(names)
    base = [o[0][0] for o in run(base_llm, toks, params())]
    spec_llm = llm(True)
    assert [o[0][0] for o in run(spec_llm, toks, params())] == base
    assert base[1] != base[0] != base[2]  # the adapters change the answer
    assert spec_llm.engine.spec.stats.num_accepted_tokens > 5
    assert_nothing_held(spec_llm)


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that samples a and b come from one distribution (categories with fewer than 5
    expected in either arm pooled into one)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cats, other = [], (0, 0)
    for t in set(ca) | set(cb):
        tot = ca[t] + cb[t]
        if min(tot * na, tot * nb) / (na + nb) >= 5:
            cats.append((ca[t], cb[t]))
        else:
            other = (other[0] + ca[t], other[1] + cb[t])
    if sum(other):
        cats.append(other)
    stat = 0.0
    for x, y in cats:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cats) - 1
    return 1.0 if df <= 0 else float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                              torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_sampled_tokens_keep_their_distribution_with_speculation(model):
    """Independent draws (different seeds in the two arms, temperature 1, top-k 8) of the 2nd, 3rd and 4th output
    tokens of a prompt whose answer copies it, with and without drafts: a chi-square test of homogeneity at each
    position must not reject at p < 0.001; the same test tells apart a sample with a quarter of its draws moved."""
    n = 300
    tok = engine(model, False).engine.tokenizer
    prompt = tok.encode(LIST)

    def draws(spec: bool, seed0: int) -> tuple[list[list[int]], LLM]:
        llm = engine(model, spec, max_num_seqs=16, max_num_batched_tokens=256)
        params = [SamplingParams(temperature=1.0, top_k=8, seed=seed0 + i, max_tokens=4, ignore_eos=True)
                  for i in range(n)]
        return [o[0][0] for o in run(llm, [prompt] * n, params)], llm

    plain, _ = draws(False, 0)
    spec, llm = draws(True, 10_000)
    st = llm.engine.spec.stats
    assert st.num_accepted_tokens > 50, st
    from collections import Counter

    for pos in (1, 2, 3):
        p = chi_square_p([t[pos] for t in plain], [t[pos] for t in spec])
        print(f"\noutput position {pos}: chi-square p {p:.3f}; drafts kept {st.num_accepted_tokens} of "
              f"{st.num_draft_tokens}")
        assert p > 0.001, (pos, p)
        # its power: a quarter of the draws moved to the second most frequent token is told apart
        common = [t for t, _ in Counter(t[pos] for t in plain).most_common(2)]
        biased = [t[pos] for t in spec[:n - n // 4]] + [common[-1]] * (n // 4)
        assert chi_square_p([t[pos] for t in plain], biased) < 0.001, pos
    assert_nothing_held(llm)
