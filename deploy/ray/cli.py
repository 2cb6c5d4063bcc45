"""`kvfleet ray up`: the Serve application of deploy/ray/serve_config.yaml on a local Ray instance, with CPU
replicas of the bundled model.

    kvfleet ray up                     # the config's autoscaling (1..4 replicas), OpenAI API on :8000
    kvfleet ray up --replicas 2 --port 8000 --policy round-robin

It starts Ray (ray.init) and Serve on 127.0.0.1:PORT, runs the config's application (its import_path and args,
with the flags above applied), prints where to send requests and waits; Ctrl-C shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

SERVE_CONFIG = Path(__file__).resolve().parent / "serve_config.yaml"


@dataclass(frozen=True)
class UpPlan:
    """What `up` runs: the config's first application with the command-line overrides applied."""

    name: str
    route_prefix: str
    import_path: str
    args: dict
    port: int
    num_cpus: int

    def builder(self):
        module, _, attr = self.import_path.partition(":")
        return getattr(importlib.import_module(module), attr)


def plan(config_path: Path, replicas: int | None, port: int, policy: str | None,
         cpu_count: int | None = None) -> UpPlan:
    """Pure: read the serve config and apply the flags (engine threads split over the replicas on this host)."""
    from deploy.ray.app import RayAppConfig

    config = yaml.safe_load(config_path.read_text())
    app = config["applications"][0]
    args = dict(app.get("args") or {})
    if replicas is not None:
        args["replicas"] = replicas
    if policy is not None:
        args["policy"] = policy
    cfg = RayAppConfig.from_args(args)  # validate before Ray starts
    cpus = cpu_count or os.cpu_count() or 1
    most = cfg.replicas or int(dict(cfg.autoscaling).get("max_replicas", 4))
    engine = dict(cfg.engine)
    engine.setdefault("num_threads", max(1, cpus // (cfg.replicas or 1)))
    args["engine"] = engine
    needed = most * cfg.num_cpus + cfg.ingress_replicas * cfg.ingress_num_cpus
    return UpPlan(app["name"], app.get("route_prefix", "/"), app["import_path"], args, port,
                  max(cpus, int(needed + 0.999)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet ray", description="kvfleet on Ray Serve.")
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="run the Serve application locally (CPU replicas of the bundled model)")
    up.add_argument("--replicas", type=int, default=None,
                    help="a fixed number of engine replicas (default: the config's autoscaling)")
    up.add_argument("--port", type=int, default=8000, help="port of the OpenAI API (Serve's HTTP proxy)")
    up.add_argument("--policy", default=None, help="routing policy (default: the config's)")
    up.add_argument("--config", type=Path, default=SERVE_CONFIG, help="serve config (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.replicas is not None and ns.replicas < 1:
        parser().error("--replicas must be >= 1")
    try:
        up = plan(ns.config, ns.replicas, ns.port, ns.policy)
    except ValueError as e:
        parser().error(str(e))
    import ray
    from ray import serve

    stop = threading.Event()
    ray.init(num_cpus=up.num_cpus, include_dashboard=False)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own handlers
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": "127.0.0.1", "port": up.port})
        serve.run(up.builder()(up.args), name=up.name, route_prefix=up.route_prefix)
        replicas = up.args.get("replicas") or "autoscaling"
        print(f"kvfleet on Ray Serve: application {up.name!r}, engine replicas: {replicas}, policy "
              f"{up.args.get('policy', 'kv')}\n  OpenAI API: http://127.0.0.1:{up.port}/v1  (model "
              f"{up.args['engine'].get('model', 'smollm2')})\n  Ctrl-C stops it", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        print("stopping Serve and Ray", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
