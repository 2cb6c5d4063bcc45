"""The engine deployment's autoscaling on a local Ray instance (slow): from 1 replica, a burst of streams that
queues on an engine allowed 1 running sequence drives the `waiting` metric past its target, and Serve's
controller, calling deploy/ray/autoscaling.py, adds a second replica; once the burst is over and the (short)
scale-down stabilization window has passed, it goes back to 1."""

import threading
import time

import httpx
import pytest

from deploy.ports import free_port
from loadtest.ray_serve import APP, deploy, ray_serve, undeploy

pytestmark = [pytest.mark.slow, pytest.mark.model]


def engine_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["EngineReplica"]
    return status.replica_states.get("RUNNING", 0)


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(1.0)
    return False


def test_scales_up_on_waiting_requests_and_back_down_after_the_window():
    args = {"engine": {"model": "smollm2", "max_num_seqs": 1, "num_threads": 1, "num_blocks": 512},
            "policy": "least-load", "num_cpus": 0.5, "look_back_period_s": 2.0,
            "autoscaling": {"min_replicas": 1, "max_replicas": 2, "kv_usage_target": 0.9, "waiting_target": 1,
                            "scale_down_stabilization_s": 20}}
    with ray_serve(free_port()) as url:
        deploy(args, url)
        assert engine_replicas() == 1
        stop = threading.Event()

        def load():
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    c.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "Once upon a time",
                                                          "max_tokens": 48, "temperature": 0})

        threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            assert wait_for(lambda: engine_replicas() == 2, 240), "no scale-up to 2 replicas under load"
        finally:
            stopped_at = time.monotonic()
            stop.set()
            for t in threads:
                t.join(timeout=300)
        assert wait_for(lambda: engine_replicas() == 1, 240), "no scale-down to 1 replica after the load"
        assert time.monotonic() - stopped_at >= 15  # not before the 20 s window (less the look-back and a tick)
        undeploy()
