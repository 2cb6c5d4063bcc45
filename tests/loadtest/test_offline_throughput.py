"""Smoke runs of loadtest/offline_throughput.py at tiny sizes (the real measurement is the lead's)."""

from __future__ import annotations

import re

import pytest

from loadtest import offline_throughput

pytestmark = pytest.mark.model

TINY = ["--num-requests", "4", "--min-output", "2", "--max-output", "4", "--batch-sizes", "1,2",
        "--requests-per-batch-size", "1", "--hf-batch", "2", "--kv-cache-memory", "0.05", "--num-threads", "1"]


def test_trace_is_seeded_and_chat_like():
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    a = offline_throughput.build_trace(tok, 50, 1, 60, 16, 128)
    b = offline_throughput.build_trace(tok, 50, 1, 60, 16, 128)
    assert a == b
    lens = [len(p) for p, _ in a]
    assert 45 <= sum(lens) / len(lens) <= 75
    assert all(16 <= n <= 128 for _, n in a)


def test_flops_per_token_counts_weights_and_attention():
    from engine.model.llama import ModelConfig

    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, max_position_embeddings=64,
                      tie_word_embeddings=True)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16
    assert offline_throughput.model_flops_per_token(cfg, 0) == 2 * (2 * per_layer + 8 * 100)
    assert offline_throughput.model_flops_per_token(cfg, 10) - offline_throughput.model_flops_per_token(cfg, 0) \
        == 4 * 2 * 8 * 10


def test_smoke_kvfleet_only(capsys):
    assert offline_throughput.main(TINY + ["--skip-hf"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"kvfleet \(max_num_seqs 64\): 1\d output tokens in [\d.]+ s = [\d.]+ tok/s", out)
    assert re.search(r"of it", out) and "batch   2:" in out


@pytest.mark.slow
def test_smoke_with_hf(capsys):
    assert offline_throughput.main(TINY) == 0
    out = capsys.readouterr().out
    assert re.search(r"ratio kvfleet / HF: [\d.]+x", out)
