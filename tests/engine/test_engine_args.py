"""EngineArgs: CLI round trip and errors that name the flag."""

from __future__ import annotations

import argparse
import os

import pytest

from contract.errors import ConfigError
from engine.args import EngineArgs, add_cli_args


def _parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli(parser.parse_args(list(argv)))


def test_defaults_and_cli_round_trip():
    assert _parse() == EngineArgs()
    a = _parse("--model", "/m.gguf", "--served-model-name", "chat", "alias", "--dtype", "bfloat16",
               "--attention-backend", "torch", "--block-size", "32", "--kv-cache-memory", "0.5", "--num-blocks", "99",
               "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
               "--no-enable-prefix-caching", "--hash-seed", "7", "--seed", "3")
    assert a == EngineArgs(model="/m.gguf", served_model_name="chat", dtype="bfloat16", attention_backend="torch",
                           block_size=32, kv_cache_memory=0.5, num_blocks=99, max_model_len=4096, max_num_seqs=8,
                           max_num_batched_tokens=512, enable_prefix_caching=False, hash_seed=7, seed=3)
    assert a.model_name == "chat" and EngineArgs().model_name == "smollm2"


@pytest.mark.parametrize("field,value,flag", [
    ("block_size", 12, "--block-size"),
    ("block_size", 0, "--block-size"),
    ("kv_cache_memory", 0.0, "--kv-cache-memory"),
    ("kv_cache_memory", -1, "--kv-cache-memory"),
    ("num_blocks", 0, "--num-blocks"),
    ("max_model_len", 1, "--max-model-len"),
    ("max_num_seqs", 0, "--max-num-seqs"),
    ("max_num_batched_tokens", 4, "--max-num-batched-tokens"),  # below max_num_seqs
    ("hash_seed", -1, "--hash-seed"),
    ("hash_seed", 2**64, "--hash-seed"),
    ("seed", -5, "--seed"),
    ("dtype", "int8", "--dtype"),
    ("attention_backend", "flash", "--attention-backend"),
    ("device", "tpu", "--device"),
    ("model", " ", "--model"),
    ("served_model_name", "", "--served-model-name"),
    ("max_num_seqs", True, "--max-num-seqs"),
    ("cpu_cores", "", "--cpu-cores"),
    ("cpu_cores", "0-", "--cpu-cores"),
    ("cpu_cores", "1-0", "--cpu-cores"),
    ("cpu_cores", "zero", "--cpu-cores"),
    ("cpu_cores", 0, "--cpu-cores"),
    ("cpu_cores", "8191", "--cpu-cores"),  # valid syntax, but not a core this process may use
])
def test_bad_values_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError) as e:
        EngineArgs(**{field: value})
    assert e.value.field == flag and str(e.value).startswith(flag)


def test_cpu_cores_must_be_usable():
    usable = sorted(os.sched_getaffinity(0))
    assert _parse("--cpu-cores", str(usable[0])).cpu_cores == str(usable[0])
    assert _parse().cpu_cores is None
    with pytest.raises(ConfigError, match=rf"--cpu-cores: '{usable[0]},8191' names core\(s\) 8191 that"):
        _parse("--cpu-cores", f"{usable[0]},8191")


def test_cli_rejects_unknown_choices_through_argparse():
    parser = add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int4"])
