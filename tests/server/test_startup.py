"""`kvfleet engine` refuses bad flags at once and exits non-zero when the model cannot load."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.conftest import ROOT, start_engine


def test_bad_flag_names_it():
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--max-num-seqs", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-num-seqs" in r.stderr


def test_missing_model_path_fails_before_serving():
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--model", "/no/such/model"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "/no/such/model" in r.stderr


def test_model_that_fails_to_load_exits_1(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    (bad / "model.safetensors").write_bytes(b"")
    server = start_engine(str(tmp_path), "--model", str(bad), wait_ready=False)
    try:
        assert server.proc.wait(120) == 1
        assert "exiting" in server.log()
    finally:
        server.stop()
