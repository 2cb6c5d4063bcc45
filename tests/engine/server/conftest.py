"""Real `kvfleet engine` processes on loopback running the bundled SmolLM2 model.

`engine_server(*flags)` starts one on a free port, waits for /ready and stops it at the end. The
`api_server` fixture is shared by the API, error, fuzz, metrics and cancellation tests (one model
load for all of them); tests needing special flags start their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from deploy.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# small max_num_seqs so a handful of requests queue up (num_requests_waiting > 0)
API_FLAGS = ("--max-num-seqs", "4", "--num-blocks", "1024", "--max-model-len", "2048",
             "--dtype", "float32")  # float32: greedy text is robust to batch composition


@dataclass
class EngineServer:
    url: str
    proc: subprocess.Popen | None
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        labels = {"model_name": "smollm2", **labels}
        want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and "{" + ",".join(sorted(rest.rstrip("}").split(","))) + "}" == want:
                return value
        raise KeyError(f"{name}{want} not in /metrics")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(tmp_dir: str, *flags: str, env: dict | None = None, wait_ready: bool = True,
                 timeout: float = 600) -> EngineServer:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"engine-{port}.log")
    cmd = [sys.executable, "-m", "kvfleet", "engine", "--model", "smollm2", "--host", "127.0.0.1",
           "--port", str(port), "--instance-id", f"test-{port}", *flags]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = EngineServer(f"http://127.0.0.1:{port}", proc, log_path)
    if wait_ready:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"engine not ready after {timeout} s:\n{server.log()}")
            time.sleep(0.5)
    return server


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    if os.environ.get("KVFLEET_TEST_ENGINE_URL"):  # run against an engine someone already started (with API_FLAGS)
        yield EngineServer(os.environ["KVFLEET_TEST_ENGINE_URL"].rstrip("/"), None, os.devnull)
        return
    server = start_engine(str(tmp_path_factory.mktemp("api")), *API_FLAGS)
    yield server
    server.stop(signal.SIGTERM)


@pytest.fixture(scope="session")
def openai_client(api_server):
    with openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
