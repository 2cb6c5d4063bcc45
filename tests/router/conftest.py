"""Real processes on loopback for router tests: fake engines, real engines, the router. Each runs in its own
process group and is killed (group-wide) at the end of the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deploy.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Proc:
    def __init__(self, args: list[str], url: str, log_path: str, env: dict | None = None):
        self.args, self.url, self.log_path = args, url, log_path
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log = open(self.log_path, "ab")
        self.popen = subprocess.Popen([sys.executable, *self.args], cwd=ROOT, env=self.env, stdout=self.log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, path: str = "/ready", timeout: float = 60.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.url}{path} not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        if getattr(self, "log", None):
            self.log.close()


def _spawner(log_dir):
    started: list[Proc] = []

    def spawn(args: list[str], url: str, name: str, env: dict | None = None) -> Proc:
        p = Proc(args, url, str(log_dir / f"{name}.log"), env).start()
        started.append(p)
        return p

    return spawn, started


@pytest.fixture
def procs(tmp_path):
    """Factory for processes that are all stopped at the end of the test."""
    spawn, started = _spawner(tmp_path)
    yield spawn
    for p in reversed(started):
        p.stop()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory):
    """Like `procs`, for processes shared by a module's tests (e.g. real engines)."""
    spawn, started = _spawner(tmp_path_factory.mktemp("procs"))
    yield spawn
    for p in reversed(started):
        p.stop()


def fake_engine(procs, name: str, *extra: str, port: int | None = None, host: str = "127.0.0.1") -> Proc:
    port = port or free_port()
    return procs(["-m", "loadtest.fake_engine", "--host", host, "--port", str(port), "--instance-id", name,
                  "--heartbeat-s", "0.3", *extra], f"http://{host}:{port}", name)


def router(procs, replicas: list[str] | None, *extra: str, policy: str = "kv", model: str = "",
           env: dict | None = None, default_model: str | None = "smollm2") -> Proc:
    """A router process; requests that name no model get `default_model` (as `kvfleet up` starts one)."""
    port = free_port()
    args = ["-m", "router.main", "--port", str(port), "--policy", policy, "--model", model,
            "--health-interval", "0.2", "--scrape-interval", "0.2", "--log-level", "warning", *extra]
    if default_model is not None:
        args += ["--default-model", default_model]
    if replicas:
        args += ["--replicas", ",".join(replicas)]
    return procs(args, f"http://127.0.0.1:{port}", f"router-{port}", env)


def ready_replicas(r) -> int:
    """How many replicas the router at r.url counts as ready."""
    return httpx.get(r.url + "/ready").json().get("ready_replicas", 0)


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(cond, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, no persistence (deploy/redis_server.py); stopped at the end.
    `redis_server.kill()` then `redis_server.start()` restarts it empty on the same port."""
    from deploy.redis_server import RedisServer

    server = RedisServer(str(tmp_path)).start()
    yield server
    server.stop()
