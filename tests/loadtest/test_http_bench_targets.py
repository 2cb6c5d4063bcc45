"""Which servers http_bench starts for their turns: the llama.cpp peer on the bundled GGUF, a clear message
when its binary is missing."""

from __future__ import annotations

import argparse
import shlex

import pytest

from engine.model.registry import resolve_model
from loadtest.http_bench import add_target_args, resolve_targets


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_target_args(ap)
    return ap.parse_args(list(argv))


def test_llamacpp_serves_the_same_gguf_kvfleet_loads_beside_kvfleet(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    targets, starts = resolve_targets(_args("--with-kvfleet", "--with-llamacpp", "--llamacpp-bin", str(binary)))
    assert targets == {"kvfleet": "http://127.0.0.1:8001", "llamacpp": "http://127.0.0.1:8300"}
    cmd = shlex.split(starts["llamacpp"])
    assert cmd[0] == str(binary) and cmd[cmd.index("-m") + 1] == resolve_model("smollm2").path
    assert cmd[cmd.index("--port") + 1] == "8300" and cmd[cmd.index("-t") + 1] == "2"


def test_a_missing_llamacpp_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(SystemExit, match="setup_llamacpp.sh"):
        resolve_targets(_args("--with-llamacpp", "--peers-dir", str(tmp_path)))
