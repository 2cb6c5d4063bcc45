"""The fleet every chaos scenario runs against: Redis, 2 real engines of the bundled model, 2 routers sharing
budgets in Redis, all on loopback, each process in its own process group (killed whole on stop).

Engines require the internal token on everything but /health and /ready; routers know three tenants
(keys below; `iso` isolates its cache). Extra routers (other flags, same engines) start on demand.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import yaml

from deploy.ports import free_port
from deploy.redis_server import RedisServer

PY = sys.executable
MODEL = "smollm2"
INTERNAL_TOKEN = "chaos-internal-7f3a9c"
KEYS = {"alpha": "sk-chaos-alpha-5d1e8b", "beta": "sk-chaos-beta-92c4aa", "iso": "sk-chaos-iso-0b77e1",
        "small": "sk-chaos-small-4410fe", "fuzz": "sk-chaos-fuzz-c3d2a1"}
SMALL_BUDGET = 3000  # tokens per minute of tenant `small` (the Redis scenario exhausts it)


def tenants_yaml() -> str:
    def h(k: str) -> list[str]:
        return [hashlib.sha256(k.encode()).hexdigest()]
    return yaml.safe_dump({"tenants": {
        "alpha": {"api_key_sha256": h(KEYS["alpha"]), "tokens_per_minute": 50_000_000, "priority": 1},
        "beta": {"api_key_sha256": h(KEYS["beta"]), "tokens_per_minute": 50_000_000, "priority": 0},
        "iso": {"api_key_sha256": h(KEYS["iso"]), "tokens_per_minute": 50_000_000, "isolate_cache": True},
        "small": {"api_key_sha256": h(KEYS["small"]), "tokens_per_minute": SMALL_BUDGET, "max_tokens": 16},
        "fuzz": {"api_key_sha256": h(KEYS["fuzz"]), "tokens_per_minute": 50_000_000, "max_tokens": 8},
    }}, sort_keys=False)


class Proc:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: str):
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def stop(self) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
        self.kill(signal.SIGKILL)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid) if self.alive() else 0

    def open_fds(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return 0

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")


def rss_bytes(pid: int) -> int:
    """Resident memory of the process and its children (an engine's core process holds its model)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total = int(line.split()[1]) * 1024
        for task in os.listdir(f"/proc/{pid}/task"):  # children of every thread (a core starts from a worker thread)
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(rss_bytes(int(child)) for child in f.read().split())
    except OSError:
        pass
    return total


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """{(name, labels text), value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    total = 0.0
    for (n, lab), v in samples.items():
        if n == name and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            total += v
    return total


class Fleet:
    def __init__(self, log_dir: str, num_blocks: int, engine_args: list[str] | None = None):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.num_blocks = num_blocks
        self.engine_args = engine_args or []
        self.tenants_path = os.path.join(log_dir, "tenants.yaml")
        with open(self.tenants_path, "w") as f:
            f.write(tenants_yaml())
        self.redis = RedisServer(log_dir)
        self.engines: list[Proc] = []
        self.routers: list[Proc] = []
        self.extra: list[Proc] = []
        self.auth = {"authorization": f"Bearer {INTERNAL_TOKEN}"}

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, engines: int = 2, routers: int = 2) -> Fleet:
        self.redis.start()
        cores = sorted(os.sched_getaffinity(0))
        for i in range(engines):
            self.engines.append(self._engine(i, cores[i % len(cores)] if len(cores) > 1 else None))
        for e in self.engines:
            e.start()
        for j in range(routers):
            self.routers.append(self.router(f"router-{j}").start())
        for p in [*self.engines, *self.routers]:
            p.wait_ready()
        self.wait_routers_see_engines()
        return self

    def _engine(self, i: int, core: int | None) -> Proc:
        port = free_port()
        argv = [PY, "-m", "kvfleet", "engine", "--model", MODEL, "--port", str(port), "--instance-id", f"engine-{i}",
                "--num-blocks", str(self.num_blocks), "--internal-token", INTERNAL_TOKEN, "--require-internal-token",
                "--num-threads", "1", "--drain-timeout", "5", *self.engine_args]
        if core is not None:
            argv += ["--cpu-cores", str(core)]
        return Proc(f"engine-{i}", argv, port, self.log_dir)

    def router(self, name: str, *flags: str, redis: bool = True) -> Proc:
        """A router (not started) over this fleet's engines, with the tenants file and, by default, Redis."""
        port = free_port()
        argv = [PY, "-m", "kvfleet", "router", "--port", str(port), "--model", MODEL, "--policy", "kv",
                "--replicas", ",".join(e.url for e in self.engines), "--tenants", self.tenants_path,
                "--internal-token", INTERNAL_TOKEN, "--health-interval", "0.5", "--drain-timeout", "5", *flags]
        if redis:
            argv += ["--redis-url", self.redis.url]
        return Proc(name, argv, port, self.log_dir)

    def start_extra_router(self, name: str, *flags: str, redis: bool = True) -> Proc:
        p = self.router(name, *flags, redis=redis).start()
        self.extra.append(p)
        p.wait_ready()
        return p

    def restart_engine(self, i: int) -> float:
        """Start engine i again on its port (after a kill); seconds until it is ready."""
        e = self.engines[i]
        e.popen = None
        e.start()
        return e.wait_ready()

    def stop(self) -> None:
        for p in [*self.extra, *self.routers, *self.engines]:
            p.stop()
        self.redis.stop()

    def all_procs(self) -> list[Proc]:
        return [*self.engines, *self.routers, *self.extra]

    # -- observation ---------------------------------------------------------------------------------------
    def engine_metrics(self, i: int) -> dict:
        r = httpx.get(self.engines[i].url + "/metrics", headers=self.auth, timeout=5.0)
        r.raise_for_status()
        return parse_metrics(r.text)

    def router_metrics(self, router: Proc) -> dict:
        r = httpx.get(router.url + "/metrics", timeout=5.0)
        r.raise_for_status()
        return parse_metrics(r.text)

    def kv_state(self, i: int) -> dict:
        m = self.engine_metrics(i)
        total = metric(m, "kvfleet:num_kv_blocks")
        return {"total": total, "free": metric(m, "kvfleet:num_free_kv_blocks"),
                "cached": metric(m, "kvfleet:num_cached_kv_blocks"), "usage": metric(m, "vllm:kv_cache_usage_perc"),
                "running": metric(m, "vllm:num_requests_running"), "waiting": metric(m, "vllm:num_requests_waiting"),
                "preemptions": metric(m, "vllm:num_preemptions_total"),
                "hits": metric(m, "vllm:prefix_cache_hits_total"), "queries": metric(m, "vllm:prefix_cache_queries_total")}

    def wait_idle(self, timeout: float = 60.0) -> list[dict]:
        """Every engine's KV state once none runs or waits anything (or at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self.kv_state(i) for i in range(len(self.engines))]
            if all(s["running"] == 0 and s["waiting"] == 0 and s["free"] == s["total"] for s in states):
                return states
            if time.monotonic() > deadline:
                return states
            time.sleep(0.25)

    def router_view(self, router: Proc) -> dict[str, dict]:
        """Per engine URL: ready, KV events live, indexed blocks, as the router exports them."""
        m = self.router_metrics(router)
        return {e.url: {"ready": metric(m, "kvfleet_router_replica_ready", replica=e.url),
                        "live": metric(m, "kvfleet_router_kv_events_live", replica=e.url),
                        "indexed": metric(m, "kvfleet_router_indexed_blocks", replica=e.url)}
                for e in self.engines}

    def wait_routers_see_engines(self, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if all(v["ready"] == 1 and v["live"] == 1 for r in self.routers for v in self.router_view(r).values()):
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("routers do not see every engine ready with live KV events")
