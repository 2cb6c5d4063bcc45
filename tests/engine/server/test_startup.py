"""`kvfleet engine` refuses bad flags at once and exits non-zero when the model cannot load."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.engine.server.conftest import ROOT, start_engine


def test_bad_flag_names_it():
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--max-num-seqs", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-num-seqs" in r.stderr


def test_missing_model_path_fails_before_serving():
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--model", "/no/such/model"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "/no/such/model" in r.stderr


def test_missing_draft_model_path_fails_before_serving():
    spec = json.dumps({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 4})
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--speculative-config", spec], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--speculative-config: model '/no/such/draft'" in r.stderr


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


def test_models_is_never_200_before_a_chat_request_can_succeed(tmp_path):
    """Poll /v1/models and a chat request side by side from process start: while the model loads both
    answer 503 with Retry-After; the first 200 of /v1/models is followed by a chat request that succeeds."""
    server = start_engine(str(tmp_path), "--max-model-len", "512", "--num-blocks", "64", wait_ready=False)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    seen_503 = False
    try:
        deadline = time.monotonic() + 600
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                assert server.proc.poll() is None, server.log()
                try:
                    models = client.get(f"{server.url}/v1/models")
                except httpx.TransportError:  # not listening yet
                    time.sleep(0.05)
                    continue
                if models.status_code == 200:
                    r = client.post(f"{server.url}/v1/chat/completions", json=chat)
                    assert r.status_code == 200, r.text
                    assert [m["id"] for m in models.json()["data"]] == ["smollm2"]
                    break
                assert models.status_code == 503 and models.headers["retry-after"], models.text
                assert models.json()["error"]["code"] == "not_ready"
                seen_503 = True
                early = client.post(f"{server.url}/v1/chat/completions", json=chat)
                assert early.status_code in (200, 503), early.text  # 200 only if it finished loading meanwhile
            else:
                raise AssertionError(f"/v1/models never answered 200:\n{server.log()}")
        assert seen_503  # the model takes seconds to load: the poll saw the loading phase
    finally:
        server.stop()
