"""Processes for the router benchmarks: engines (real or fake) and routers on loopback, each in its own
process group, stopped (TERM, then KILL) by the caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from deploy.ports import free_port

PY = sys.executable


class Proc:
    def __init__(self, argv: list[str], url: str, log_dir: str, name: str, env: dict | None = None):
        self.url, self.name = url, name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def wait_ready(self, timeout: float = 600.0, path: str = "/ready") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()


def start_engine(ns, log_dir: str, name: str, num_blocks: int, index: int = 0) -> Proc:
    """With ns.pin_cores, the real engine `index` runs on usable core index % their count, 1 thread by default."""
    port = free_port()
    if ns.engine_module:
        argv = [PY, "-m", ns.engine_module, "--port", str(port), "--instance-id", name, "--model", ns.model]
    else:
        argv = [PY, "-m", "kvfleet", "engine", "--model", ns.model, "--port", str(port), "--instance-id", name,
                "--num-blocks", str(num_blocks), "--log-level", "warning"]
        pin = getattr(ns, "pin_cores", False)
        threads = ns.threads_per_engine or (1 if pin else None)
        if threads:
            argv += ["--num-threads", str(threads)]
        if pin:
            cores = sorted(os.sched_getaffinity(0))
            argv += ["--cpu-cores", str(cores[index % len(cores)])]
    return Proc(argv + ns.engine_arg, f"http://127.0.0.1:{port}", log_dir, name)


def start_fake_engines(n: int, chunks: int, log_dir: str, model: str = "smollm2", first: int = 0) -> list[Proc]:
    """n fake engines (loadtest/fake_engine.py) of `model` answering with `chunks` SSE chunks, ready."""
    fakes = [Proc([PY, "-m", "loadtest.fake_engine", "--port", str(p := free_port()), "--instance-id", f"f{i}",
                   "--chunks", str(chunks), "--model", model], f"http://127.0.0.1:{p}", log_dir, f"fake-{i}")
             for i in range(first, first + n)]
    for f in fakes:
        f.wait_ready()
    return fakes


def start_router(ns, log_dir: str, replicas: list[str], policy: str, model: str | None) -> Proc:
    port = free_port()
    argv = [PY, "-m", "router.main", "--port", str(port), "--policy", policy, "--model", model or "",
            "--replicas", ",".join(replicas), "--log-level", "warning"]
    return Proc(argv + list(getattr(ns, "router_arg", [])), f"http://127.0.0.1:{port}", log_dir, f"router-{policy}")




def start_kv_fleet(ns, log_dir: str, procs: list[Proc], engines: int = 2) -> Proc:
    """`engines` real engines of ns.model (4,096 blocks each) behind one `kv` router, all ready; each Proc is
    appended to `procs` as it starts (the caller stops them). The router."""
    started = [start_engine(ns, log_dir, f"e{i}", 4096, i) for i in range(engines)]
    procs += started
    for e in started:
        e.wait_ready(300)
    router = start_router(ns, log_dir, [e.url for e in started], "kv", ns.model)
    procs.append(router)
    router.wait_ready(120)
    return router
