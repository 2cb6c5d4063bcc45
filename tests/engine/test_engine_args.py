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
    ("debug_step_delay_ms", -1, "--debug-step-delay-ms"),
    ("debug_step_delay_ms", 0.5, "--debug-step-delay-ms"),
    ("debug_oom_every", -3, "--debug-oom-every"),
    ("debug_oom_every", "2", "--debug-oom-every"),
    ("max_step_ms", -1, "--max-step-ms"),
    ("max_step_ms", float("nan"), "--max-step-ms"),
    ("max_step_ms", 1e9, "--max-step-ms"),
    ("max_step_ms", True, "--max-step-ms"),
    ("max_step_ms", "150", "--max-step-ms"),
])
def test_bad_values_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError) as e:
        EngineArgs(**{field: value})
    assert e.value.field == flag and str(e.value).startswith(flag)


def test_max_step_ms_bounds_steps_by_default_and_0_turns_it_off():
    assert EngineArgs().max_step_ms == 150.0
    assert _parse("--max-step-ms", "250").max_step_ms == 250.0 and _parse("--max-step-ms", "0").max_step_ms == 0.0


def test_cpu_cores_must_be_usable():
    usable = sorted(os.sched_getaffinity(0))
    assert _parse("--cpu-cores", str(usable[0])).cpu_cores == str(usable[0])
    assert _parse().cpu_cores is None
    with pytest.raises(ConfigError, match=rf"--cpu-cores: '{usable[0]},8191' names core\(s\) 8191 that"):
        _parse("--cpu-cores", f"{usable[0]},8191")


def test_fault_injection_flags_are_off_by_default_and_documented_as_such():
    assert (EngineArgs().debug_step_delay_ms, EngineArgs().debug_oom_every) == (0, 0)
    a = _parse("--debug-step-delay-ms", "250", "--debug-oom-every", "7")
    assert (a.debug_step_delay_ms, a.debug_oom_every) == (250, 7)
    text = " ".join(add_cli_args(argparse.ArgumentParser()).format_help().split())
    assert "fault injection (for tests and chaos drills only" in text
    assert "--debug-step-delay-ms MS" in text and "--debug-oom-every N" in text
    with pytest.raises(ConfigError, match=r"^--debug-oom-every must be >= 0, got -1$"):
        _parse("--debug-oom-every", "-1")


def test_cli_rejects_unknown_choices_through_argparse():
    parser = add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int4"])


def test_cuda_graphs_default_to_wherever_they_apply_and_warn_only_when_asked_for():
    from engine.model_runner import graphs_apply

    assert EngineArgs().cuda_graphs is None and _parse().cuda_graphs is None
    assert _parse("--no-cuda-graphs").cuda_graphs is False and _parse("--cuda-graphs").cuda_graphs is True
    assert graphs_apply(None, "cuda", "triton", True, False) == (True, None)
    assert graphs_apply(None, "cpu", "cpu", True, False) == (False, None)  # a CPU engine starts without a warning
    assert graphs_apply(None, "cuda", "triton", True, True) == (False, None)
    assert graphs_apply(False, "cuda", "triton", True, False) == (False, None)
    on, why = graphs_apply(True, "cpu", "torch", True, False)
    assert not on and "need a CUDA device" in why
    on, why = graphs_apply(True, "cuda", "triton", True, True)
    assert not on and "LoRA" in why
