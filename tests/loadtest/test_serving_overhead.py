"""loadtest/serving_overhead.py's offline replay of the served trace, at a tiny size."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest import serving_overhead

pytestmark = pytest.mark.model


def test_replay_runs_the_trace_to_its_lengths_and_frees_every_block():
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import load_tokenizer

    trace = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 5))
             for r in serving_overhead.chat_trace(6, [2], seed=3)[:6]]
    engine = LLMEngine(EngineArgs(model="smollm2", max_model_len=serving_overhead.MAX_MODEL_LEN, num_blocks=256))
    out = serving_overhead.replay(engine, load_tokenizer("smollm2"), trace, 2)
    assert out["output_tokens"] == sum(r.max_tokens for r in trace)  # EOS ignored: every request to its length
    assert out["tpot_p50"] > 0 and out["out_tok_s"] > 0
    assert 0 < out["prompt_per_output"] <= sum(r.approx_prompt_tokens + 64 for r in trace) / out["output_tokens"]
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def test_replay_child_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        serving_overhead.main(["--replay-child", "--concurrency", "0"])
    assert "--rounds" in capsys.readouterr().err
