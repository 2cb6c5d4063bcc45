"""The Serve application on a local Ray instance, for the Ray benchmarks and the slow tests: start Ray and
Serve once, deploy the application (deploy/ray/app.py) with given args, take it down, stop everything."""

from __future__ import annotations

import contextlib
import os
import time

import httpx

APP = "kvfleet"


@contextlib.contextmanager
def ray_serve(port: int, num_cpus: int | None = None):
    """Ray + Serve (HTTP on 127.0.0.1:port) for the block; shut down after it, whatever happens."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def deploy(args: dict, url: str, timeout_s: float = 600.0) -> float:
    """Run the application with these args (replacing any running one); returns the seconds it took to serve."""
    from ray import serve

    from deploy.ray.app import build_app

    t0 = time.perf_counter()
    serve.run(build_app(args), name=APP, route_prefix="/")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v1/models", timeout=10).status_code == 200:
                return time.perf_counter() - t0
        time.sleep(0.5)
    raise TimeoutError(f"the Serve application did not answer within {timeout_s:.0f} s")


def engine_metrics(replica_ids) -> dict[str, str]:
    """Each engine replica's /metrics text (replica ids as `x-kvfleet-replica` names them), by calls pinned
    to one replica each."""
    from ray import serve

    from deploy.ray.app import ENGINE_DEPLOYMENT
    from deploy.ray.route_hint import PIN_KWARG

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP)
    return {rid: handle.metrics.remote(**{PIN_KWARG: rid}).result(timeout_s=60) for rid in replica_ids}


def undeploy() -> None:
    from ray import serve

    serve.delete(APP, _blocking=True)
