"""The prompt-lookup proposer and --speculative-config: exact drafts, vLLM's defaults, errors naming the field."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from contract.errors import ConfigError
from engine.args import EngineArgs
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import propose


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule as written: n from max_n down to min_n, the latest earlier occurrence of the last n tokens, the k
    tokens after it (continuing over the copied tokens when the context ends first)."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                ext = list(tokens)
                out = []
                for i in range(k):
                    out.append(ext[start + n + i])
                    ext.append(out[-1])
                return out
    return []


def test_the_longest_ngram_wins_then_the_latest_occurrence():
    assert propose([1, 2, 3, 4, 1, 2, 3], 3, 2, 3) == [4, 1, 2]
    # "1 2" occurs at 1 and at 4; the latest is followed by 7 1 ...
    assert propose([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]
    # the 3-gram "8 1 2" occurs only at the start: it beats the later 2-gram "1 2"
    assert propose([8, 1, 2, 6, 1, 2, 7, 8, 1, 2], 2, 1, 3) == [6, 1]
    assert propose([8, 1, 2, 6, 1, 2, 7, 8, 1, 2], 2, 1, 2) == [7, 8]  # max 2: the latest "1 2"


def test_nothing_when_no_ngram_recurs_or_too_short():
    assert propose([1, 2, 3], 4, 1, 3) == []
    assert propose([1, 2, 1, 3], 4, 2, 2) == []  # "1 3" never occurred before
    assert propose([7], 4, 1, 1) == []
    assert propose([1, 2, 1, 2], 0, 1, 2) == []


def test_a_periodic_tail_proposes_k_tokens():
    assert propose([1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]
    assert propose([4, 4, 4], 3, 1, 2) == [4, 4, 4]
    assert propose([9, 1, 2, 3, 1, 2, 3], 4, 3, 3) == [1, 2, 3, 1]


def test_random_contexts_match_the_reference():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        assert propose(tokens, k, lo, hi) == reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_config_defaults_are_vllms():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 5, 5)
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (cfg.method, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 2, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg
    cfg = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 32})
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor,
            cfg.suffix_decoding_min_token_prob, cfg.suffix_decoding_max_cached_requests) == (24, 1.0, 0.1, 64)
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg and "model" not in json.loads(cfg.to_json())
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg


@pytest.mark.parametrize("text, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 2}', "method is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 32]"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}',
     "prompt_lookup_min must be <= prompt_lookup_max (3)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size must"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model applies only to method draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown field(s) 'draft_model'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model is required with method draft_model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": " "}', "model is required with method"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 1}',
     "suffix_decoding_max_tree_depth must be an integer in [2, 256]"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 1.5}',
     "suffix_decoding_min_token_prob must be a number in [0.0, 1.0]"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": "2"}',
     "suffix_decoding_max_spec_factor must be a number >= 0.0"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1}',
     "suffix_decoding_max_cached_requests must be an integer >= 0"),
    ('[2]', "must be a JSON object, got list"),
    ('{method: ngram}', "must be a JSON object, e.g."),
])
def test_flag_errors_name_the_flag_and_the_field(text, words):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_cli(parser.parse_args(["--speculative-config", text]))
    assert e.value.field == "--speculative-config"
    assert str(e.value).startswith("--speculative-config")
    assert words in str(e.value)


def test_off_by_default_and_on_from_the_flag_or_code():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli(parser.parse_args([])).speculative_config is None
    on = EngineArgs.from_cli(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4,'
                                                ' "prompt_lookup_min": 2, "prompt_lookup_max": 3}']))
    assert on.speculative_config == SpeculativeConfig("ngram", 4, 2, 3)
    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                          "prompt_lookup_max": 3}).speculative_config == on.speculative_config
