"""A target server's turn: start it (if it has a start command), wait until it is ready, stop it afterwards; and
the commands that start vLLM-CPU and llama.cpp's server from the peers folder (kvfleet/peers.py). Used by the stress matrix
(matrix.py) and the HTTP benchmarks (loadtest/http_bench.py, loadtest/long_stream.py), so two servers never share
the CPUs.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvfleet.peers import peers_dir, vllm_model_dir, vllm_python


def vllm_cmd(dtype: str = "bfloat16", threads_bind: str | None = "0-1", peers: Path | None = None,
             max_model_len: int = 2048) -> str:
    """vLLM-CPU as ../shared/peers/README.md starts it (from `peers`, see kvfleet/peers.py); bf16 on both
    cores is its best setting here."""
    peers = peers or peers_dir()
    bind = f"VLLM_CPU_OMP_THREADS_BIND={threads_bind} " if threads_bind else ""
    return (f"HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 {bind}{shlex.quote(str(vllm_python(peers)))} -m "
            f"vllm.entrypoints.openai.api_server --model {shlex.quote(str(vllm_model_dir(peers, dtype)))} "
            f"--served-model-name smollm2 --host 127.0.0.1 --port 8200 --dtype {dtype} --max-model-len {max_model_len}")


def llamacpp_cmd(binary: Path | None = None, threads: int = 2, parallel: int = 64) -> str:
    """llama.cpp's `llama-server` as ../shared/peers/setup_llamacpp.sh says to serve the bundled GGUF (the same
    Q4_1 file kvfleet loads): both cores, `parallel` slots over one shared KV pool, flash attention; `binary`
    defaults to what that script builds with DIR=<peers>/llamacpp."""
    from engine.model.registry import resolve_model

    binary = binary or peers_dir() / "llamacpp" / "llama-server"
    gguf = resolve_model("smollm2").path
    return (f"{shlex.quote(str(binary))} -m {shlex.quote(gguf)} --host 127.0.0.1 --port 8300 -t {threads} "
            f"-tb {threads} -np {parallel} -kvu -c {1024 * parallel} -fa on --metrics --no-webui -a smollm2")


async def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                ready = (await client.get(f"{url}/ready")).status_code  # kvfleet; vLLM has no /ready
                if ready == 200 or (ready == 404 and (await client.get(f"{url}/health")).status_code == 200
                                    and (await client.get(f"{url}/v1/models")).status_code == 200):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def start_server(cmd: str, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Turn:
    """One target's turn: `async with` starts its server (if it has a start command), waits until it is
    ready, and stops it afterwards; `name` is the target, with `#round` when there are several rounds."""

    def __init__(self, name: str, cmd: str | None, url: str, timeout: float, log: str):
        self.name, self._cmd, self._url, self._timeout, self._log = name, cmd, url, timeout, log
        self._proc: subprocess.Popen | None = None

    async def __aenter__(self) -> Turn:
        self._proc = start_server(self._cmd, self._log) if self._cmd else None
        try:
            await wait_ready(self._url, self._timeout, self._proc)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        if self._proc is not None:
            stop_server(self._proc)
