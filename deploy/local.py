"""`kvfleet up`: a local fleet on this machine - N engine replicas of the bundled model and a KV-aware router.

    kvfleet up                      # router on http://127.0.0.1:8000, engines on :8001 and :8002
    kvfleet up --replicas 3 --policy round-robin -- --max-num-seqs 8   # flags after -- go to every engine
    kvfleet up --prometheus         # also a Prometheus scraping them, with kvfleet's recording rules and alerts
    kvfleet up --models smollm2,tiny=/data/tiny-llama               # two models, a pool of --replicas each
    kvfleet up --models smollm2,vllm:smollm2-hf=/tmp/smollm2-hf --vllm-python /tmp/vllm-venv/bin/python

With several models (deploy/local_models.py) the router gets a pools file with one pool per model: a request's
`model` picks the pool; one without a model gets 400 (with one model, the router fills it in).

Each engine is pinned to its own slice of the usable cores (--cpu-cores), so replicas do not compete for the
same ones; with fewer cores than replicas nothing is pinned (--no-pin-cores turns pinning off).

On a machine with GPUs each replica gets its own (CUDA_VISIBLE_DEVICES, round robin over --gpus, default: the
visible ones); replicas that must share a device split --gpu-memory-fraction of it evenly (deploy/gpus.py).

Every child runs in its own process group (and gets SIGTERM if this launcher dies), waits until all are ready,
prints where to send requests, and on Ctrl-C / SIGTERM stops the router first, then drains the engines; whatever
has not exited after --stop-timeout is killed, group by group. No orphans.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

from deploy.gpus import ReplicaDevice, assign_gpus, cuda_device_count, describe, parse_gpu_list, visible_gpus
from deploy.local_models import ENGINES, KVEvents, LocalModel, parse_models, pools_file, vllm_argv
from deploy.ports import free_port
from deploy.prometheus import INSTALL_HINT, find_binaries, prometheus_argv, scrape_config
from engine.cpu_cores import core_slices, format_cpu_list
from router.routing.policies import POLICIES

_PR_SET_PDEATHSIG = 1
CPU_ONLY = ReplicaDevice(None, None)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Child:
    def __init__(self, name: str, argv: list[str], url: str, log_path: str, ready_path: str = "/ready",
                 env: dict[str, str] | None = None):
        self.name, self.argv, self.url, self.log_path = name, argv, url, log_path
        self.ready_path = ready_path
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - n, 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Fleet:
    def __init__(self, engines: list[Child], router: list[Child], others: list[Child] = ()):
        self.groups = (router, engines, list(others))
        self.children = [*engines, *router, *others]

    def stop(self, timeout: float) -> None:
        """Router first (no new work), then engines (they drain), then the rest (Prometheus); kill stragglers'
        whole groups."""
        for group in self.groups:
            for c in group:
                if c.alive():
                    c.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in group:
                try:
                    c.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        for c in self.children:
            c.signal(signal.SIGKILL)  # the group: anything the child left behind
            try:
                c.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            c.log.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet up", description="Start a router and N engine replicas of the "
                                "bundled model on this machine; Ctrl-C stops everything.")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (of each model; default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--engine-port", type=int, default=8001, help="first engine port (then +1 per replica)")
    p.add_argument("--model", default="smollm2", help="the one model to serve (default: the bundled smollm2)")
    p.add_argument("--models", default=None, metavar="LIST",
                   help="several models, a pool each behind one router: [ENGINE:][NAME=]SOURCE,... e.g. "
                        "smollm2,tiny=/data/tiny-llama or smollm2,vllm:smollm2-hf=/tmp/smollm2-hf (SOURCE: a bundled "
                        "alias, HF directory or GGUF file; vLLM takes an HF directory)")
    p.add_argument("--engine", default="kvfleet", choices=ENGINES,
                   help="the engine of models that name none (vllm: vLLM's CPU build, see --vllm-python)")
    p.add_argument("--vllm-python", default=os.environ.get("KVFLEET_VLLM_PYTHON", sys.executable), metavar="PATH",
                   help="the python that runs vLLM engines (env KVFLEET_VLLM_PYTHON; default this one)")
    p.add_argument("--policy", default="kv", choices=list(POLICIES))
    p.add_argument("--threads-per-engine", type=int, default=None,
                   help="torch threads per engine (default: the usable cores split evenly)")
    p.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="pin each engine to its own slice of the usable cores (threads-per-engine of them, at most "
                        "an even split); skipped when there are fewer cores than replicas (default: on)")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="GPUs to hand out round robin, one per replica (ids as CUDA_VISIBLE_DEVICES takes them, e.g. "
                        "0,1; 'none' for CPUs only; default: this process's CUDA_VISIBLE_DEVICES, else every GPU)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                   help="share of each GPU's memory its replicas use together; k replicas on one GPU get 1/k of it "
                        "each (default 0.9)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every process")
    p.add_argument("--stop-timeout", type=float, default=15.0, help="seconds each stage may take to exit")
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a new temporary directory)")
    p.add_argument("--engine-module", default=None,
                   help="run engines as `python -m MODULE` instead of `kvfleet engine` (e.g. loadtest.fake_engine)")
    p.add_argument("--tenants", default=None, metavar="FILE", help="the router's tenants file (API keys, budgets)")
    p.add_argument("--prometheus", action="store_true",
                   help="also start a Prometheus (Debian's package) scraping the engines and the router, with "
                        "kvfleet's recording rules and alerts, on a free loopback port")
    p.add_argument("--prometheus-port", type=int, default=None, help="its port (default: a free one)")
    p.add_argument("--prometheus-interval", type=float, default=5.0,
                   help="its scrape and rule evaluation interval in seconds (default 5)")
    p.add_argument("--deterministic", action="store_true",
                   help="start every kvfleet engine with --deterministic (tokens and logprobs independent of the batch "
                        "and of the cache; docs/engine.md#determinism)")
    p.add_argument("--epp", action="store_true",
                   help="also start an endpoint picker (`kvfleet epp`: Envoy ext_proc on --epp-port, its /metrics and "
                   "/ready on --epp-metrics-port) over the same engines, for a local gateway")
    p.add_argument("--epp-port", type=int, default=9002, help="the picker's gRPC port (default %(default)s)")
    p.add_argument("--epp-metrics-port", type=int, default=9090, help="its HTTP port (default %(default)s)")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: extra flags for every engine")
    return p


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if ns.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {ns.replicas}")
    if ns.deterministic and ns.engine != "kvfleet":
        parser.error(f"--deterministic is a flag of kvfleet's engine, not of --engine {ns.engine}")
    for name in ("port", "engine_port", "epp_port", "epp_metrics_port"):
        if not 1 <= getattr(ns, name) <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in 1..65535")
    if ns.threads_per_engine is not None and ns.threads_per_engine < 1:
        parser.error("--threads-per-engine must be >= 1")
    if not 0 < ns.gpu_memory_fraction <= 1:
        parser.error(f"--gpu-memory-fraction must be in (0, 1], got {ns.gpu_memory_fraction}")
    if ns.gpus is not None:
        try:
            parse_gpu_list(ns.gpus)
        except ValueError as e:
            parser.error(f"--gpus: {e}")
    if ns.prometheus_interval <= 0:
        parser.error("--prometheus-interval must be > 0")
    if ns.prometheus and find_binaries() is None:
        parser.error(f"--prometheus: {INSTALL_HINT}")
    try:
        ns.served = local_models(ns)
    except ValueError as e:
        parser.error(f"--models: {e}")
    total = ns.replicas * len(ns.served)
    if ns.engine_port + total - 1 > 65535:
        parser.error("--engine-port + engines runs past port 65535")
    if ns.port in range(ns.engine_port, ns.engine_port + total):
        parser.error(f"--port {ns.port} collides with the engine ports {ns.engine_port}..")
    if ns.epp:
        for name in ("epp_port", "epp_metrics_port"):
            port = getattr(ns, name)
            if port == ns.port or port in range(ns.engine_port, ns.engine_port + total):
                parser.error(f"--{name.replace('_', '-')} {port} collides with the router's or an engine's port")
        if ns.epp_port == ns.epp_metrics_port:
            parser.error("--epp-port and --epp-metrics-port must differ")
    if any(m.engine == "vllm" for m in ns.served):
        if ns.engine_module:
            parser.error("--engine-module runs kvfleet-like engines; it cannot stand in for vLLM")
        probe = subprocess.run([ns.vllm_python, "-c", "import vllm"], capture_output=True)
        if probe.returncode != 0:
            parser.error(f"--vllm-python {ns.vllm_python} cannot import vllm (docs/peers.md installs vLLM's CPU "
                         "build in its own venv)")


def local_models(ns: argparse.Namespace) -> list[LocalModel]:
    """The models to serve: --models, else --model with --engine."""
    if ns.models is not None:
        return parse_models(ns.models, ns.engine)
    if ns.engine == "vllm":
        raise ValueError("--engine vllm needs --models NAME=HF_DIRECTORY (vLLM loads no kvfleet alias)")
    return [LocalModel(ns.model, ns.model, "kvfleet")]


def engine_argv(ns: argparse.Namespace, py: str, i: int, threads: int, cores: tuple[int, ...] | None,
                device: ReplicaDevice = CPU_ONLY, model: LocalModel | None = None) -> list[str]:
    """Replica i's command line (before the flags after --); threads, cores and GPU share only for the real engine."""
    base = [py, "-m", ns.engine_module] if ns.engine_module else [py, "-m", "kvfleet", "engine"]
    model = model or LocalModel(ns.model, ns.model)
    argv = [*base, "--model", model.name if ns.engine_module else model.source, "--host", ns.host, "--port",
            str(ns.engine_port + i), "--instance-id", f"replica-{i}"]
    if model.name != model.source and not ns.engine_module:
        argv += ["--served-model-name", model.name]
    if not ns.engine_module:
        argv += ["--num-threads", str(threads), "--log-level", "warning"]
        if cores:
            argv += ["--cpu-cores", format_cpu_list(cores)]
        argv += device.engine_args()
    return argv


def replica_devices(ns: argparse.Namespace, env=os.environ, device_count=cuda_device_count,
                    engines: int | None = None) -> list[ReplicaDevice]:
    """Each engine's GPU and memory share (deploy/gpus.py; `engines`: default --replicas); no GPU on CPU-only
    machines."""
    gpus = parse_gpu_list(ns.gpus) if ns.gpus is not None else visible_gpus(env, device_count)
    return assign_gpus(gpus, engines or ns.replicas, ns.gpu_memory_fraction)


def _wait_ready(children: list[Child], timeout: float, stopping) -> str | None:
    """None once every child answers /ready with 200; otherwise why not."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    with httpx.Client(timeout=1.0) as client:
        while pending:
            if stopping():
                return "interrupted"
            for c in list(pending):
                if not c.alive():
                    return f"{c.name} exited with status {c.popen.returncode}; last log lines ({c.log_path}):\n{c.tail()}"
                try:
                    if client.get(c.url + c.ready_path).status_code == 200:
                        pending.remove(c)
                        print(f"  {c.name} ready at {c.url}", flush=True)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                return f"not ready after {timeout:.0f}s: {', '.join(c.name for c in pending)}"
            time.sleep(0.25)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    _check(ns, parser)
    extra = ns.engine_args[1:] if ns.engine_args[:1] == ["--"] else ns.engine_args
    if ns.deterministic and not ns.engine_module:
        extra = ["--deterministic", *extra]
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="kvfleet-up-")
    os.makedirs(log_dir, exist_ok=True)
    usable = sorted(os.sched_getaffinity(0))
    n_engines = ns.replicas * len(ns.served)
    threads = ns.threads_per_engine or max(1, len(usable) // n_engines)
    pin = ns.pin_cores and not ns.engine_module  # a fake engine has no --cpu-cores
    slices = core_slices(usable, n_engines, threads) if pin else None
    if pin and slices is None:
        print(f"kvfleet up: {len(usable)} usable core(s) for {n_engines} engines: engines are not pinned to cores",
              file=sys.stderr, flush=True)
    per_model = ns.replicas
    devices = replica_devices(ns, engines=n_engines)
    stop = {"signal": None}

    def on_signal(sig, frame):
        stop["signal"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    py = sys.executable
    engines: list[Child] = []
    router: list[Child] = []
    others: list[Child] = []
    what = " + ".join(f"{per_model} {m.engine} replica(s) of {m.name}" for m in ns.served)
    print(f"kvfleet up: {what} + a {ns.policy} router (logs in {log_dir})", flush=True)
    if slices:
        print(f"  engine cores: {' | '.join(format_cpu_list(c) for c in slices)}", flush=True)
    if describe(devices):
        print(f"  engine GPUs: {describe(devices)}", flush=True)
    try:
        placed = []
        for k, model in enumerate(ns.served):
            urls, events = [], []
            for j in range(per_model):
                i = k * per_model + j
                url = f"http://{ns.host}:{ns.engine_port + i}"
                log_path = os.path.join(log_dir, f"engine-{i}.log")
                if model.engine == "vllm":
                    kv = KVEvents(os.path.join(log_dir, f"kv-events-{i}"), free_port(ns.host))
                    argv_i = vllm_argv(ns.vllm_python, model, ns.host, ns.engine_port + i, kv)
                    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                           "VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(slices[i]) if slices else "auto"}
                    engines.append(Child(f"engine-{i}", [*argv_i, *extra], url, log_path, "/health", env))
                    events.append(kv)
                else:
                    argv_i = engine_argv(ns, py, i, threads, slices[i] if slices else None, devices[i], model)
                    engines.append(Child(f"engine-{i}", [*argv_i, *extra], url, log_path, env=devices[i].env()))
                urls.append(url)
            placed.append((model, urls, events))
        router_url = f"http://{ns.host}:{ns.port}"
        router.append(Child("router", router_argv(ns, py, placed, log_dir), router_url,
                            os.path.join(log_dir, "router.log")))
        if ns.epp:  # stopped with the router, before the engines
            router.append(Child("epp", epp_argv(ns, py, placed, log_dir), f"http://{ns.host}:{ns.epp_metrics_port}",
                                os.path.join(log_dir, "epp.log")))
        if ns.prometheus:
            others.append(_prometheus_child(ns, log_dir, [e.url for e in engines], router_url))
        children = [*engines, *router, *others]
        problem = _wait_ready(children, ns.ready_timeout, lambda: stop["signal"] is not None)
        if problem is None:
            problem = _wait_router_sees_all(router_url, n_engines, 30.0)
        if problem is not None:
            print(f"kvfleet up: {problem}", file=sys.stderr, flush=True)
            return 130 if problem == "interrupted" else 1
        if ns.epp:
            print(f"Endpoint picker (Envoy ext_proc, gRPC): {ns.host}:{ns.epp_port}; its metrics: "
                  f"{router[1].url}/metrics", flush=True)
        print(_banner(router_url, [e.url for e in engines], [m.name for m in ns.served],
                      others[0].url if others else None), flush=True)
        while stop["signal"] is None:
            for c in children:
                if not c.alive() and not getattr(c, "reported", False):
                    c.reported = True
                    print(f"kvfleet up: {c.name} exited with status {c.popen.returncode} (log: {c.log_path})",
                          file=sys.stderr, flush=True)
            if not router[0].alive():
                return 1
            time.sleep(0.2)
        return 0
    finally:
        print("kvfleet up: stopping ...", flush=True)
        Fleet(engines, router, others).stop(ns.stop_timeout)
        for s, h in old.items():
            signal.signal(s, h)
        print("kvfleet up: stopped", flush=True)


def epp_argv(ns: argparse.Namespace, py: str, placed: list, log_dir: str) -> list[str]:
    """The endpoint picker over the router's replicas, pools and tenants (the same flags, its own ports)."""
    return router_argv(ns, py, placed, log_dir, "epp", ns.epp_port) + ["--metrics-port", str(ns.epp_metrics_port)]


def router_argv(ns: argparse.Namespace, py: str, placed: list, log_dir: str, command: str = "router",
                port: int | None = None) -> list[str]:
    """One kvfleet model: its replicas, its tokenizer, and requests without a model get it. Several (or a vLLM
    one): a pools file, one pool per model, each with its model's tokenizer."""
    argv = [py, "-m", "kvfleet", command, "--host", ns.host, "--port", str(ns.port if port is None else port),
            "--policy", ns.policy, "--log-level", "warning"]
    (model, urls, _), *more = placed
    if not more and model.engine == "kvfleet":
        argv += ["--model", model.source, "--replicas", ",".join(urls), "--default-model", model.name]
    else:
        path = os.path.join(log_dir, "pools.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(pools_file(placed), f, sort_keys=False)
        argv += ["--pools", path, "--model", ""]
        if not more:
            argv += ["--default-model", model.name]
    return argv + (["--tenants", ns.tenants] if ns.tenants else [])


def _prometheus_child(ns: argparse.Namespace, log_dir: str, engine_urls: list[str], router_url: str) -> Child:
    """Prometheus scraping this fleet, with dashboards/prometheus/kvfleet-rules.yaml; data under log_dir."""
    port = ns.prometheus_port or free_port(ns.host)
    config = os.path.join(log_dir, "prometheus.yml")
    with open(config, "w") as f:
        yaml.safe_dump(scrape_config(engine_urls, [router_url], ns.prometheus_interval), f, sort_keys=False)
    argv = prometheus_argv(find_binaries(), config, os.path.join(log_dir, "prometheus-data"), ns.host, port)
    return Child("prometheus", argv, f"http://{ns.host}:{port}", os.path.join(log_dir, "prometheus.log"),
                 ready_path="/-/ready")


def _wait_router_sees_all(router_url: str, n: int, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(router_url + "/ready", timeout=1.0).json().get("ready_replicas") == n:
                return None
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    return f"the router does not see all {n} replicas as ready"


def _banner(router_url: str, engines: list[str], models: list[str], prometheus_url: str | None = None) -> str:
    prom = "" if prometheus_url is None else f"""
Prometheus (kvfleet's recording rules and alerts): {prometheus_url}
  dashboards as PNG:  python -m dashboards.render --prometheus {prometheus_url} --out dashboards-png
"""
    return f"""
kvfleet is up. Send OpenAI requests to the router:

  {router_url}/v1      (models: {', '.join(models)}; engines: {', '.join(engines)})

  curl {router_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{models[0]}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

Router metrics: {router_url}/metrics{prom}
Press Ctrl-C to stop everything.
"""


if __name__ == "__main__":
    sys.exit(main())
