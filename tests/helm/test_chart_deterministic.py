"""`deterministic` in the chart: a kvfleet pool's engines get --deterministic when it is true, and not by default;
the engine's own parser accepts what is rendered."""

from __future__ import annotations

import argparse

import pytest

from contract.errors import ConfigError
from engine.args import EngineArgs, add_cli_args
from tests.helm.chart import container, engine, render


def _args(r) -> list[str]:
    return container(engine(r, "stable"), "engine")["args"]


def _parsed(args: list[str]) -> EngineArgs:
    known = [a for a in args if a.split("=")[0] in ("--deterministic", "--model", "--max-model-len")]
    ns, _ = add_cli_args(argparse.ArgumentParser()).parse_known_args(known)
    return EngineArgs.from_cli(ns)


def test_deterministic_engines_get_the_flag():
    args = _args(render({"engineDefaults": {"deterministic": True}}))
    assert "--deterministic" in args
    assert _parsed(args).deterministic is True


def test_deterministic_is_off_by_default():
    args = _args(render({}))
    assert "--deterministic" not in args and _parsed(args).deterministic is False


def test_deterministic_with_lora_is_refused_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        EngineArgs(deterministic=True, enable_lora=True)
    assert "--deterministic" in str(e.value) and "LoRA" in str(e.value)
