"""The `helm test` hook's script, taken from the rendered Pod and run as the Pod would run it (same env), against
a real router on loopback in front of a fake engine: it passes on a reply and fails on an error."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helm.chart import TOGGLES, render
from tests.router.conftest import fake_engine, procs, router  # noqa: F401  (procs is a fixture)


def _hook(values: dict) -> tuple[str, dict]:
    pod = next(m for m in render(values).of("Pod") if m["metadata"]["annotations"].get("helm.sh/hook") == "test")
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-c"]
    return c["args"][0], {e["name"]: e.get("value") for e in c["env"]}


def _run(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=60)


def test_hook_passes_through_a_working_router_and_fails_on_an_error(procs):  # noqa: F811
    script, env = _hook({})
    eng = fake_engine(procs, "e1").wait_ready()
    rt = router(procs, [eng.url]).wait_ready()
    ok = _run(script, {**env, "ROUTER_URL": rt.url})
    assert ok.returncode == 0 and ok.stdout.startswith("OK: 8 tokens from " + eng.url), ok.stdout + ok.stderr
    failing = fake_engine(procs, "e2", "--fail-status", "500").wait_ready()
    bad_rt = router(procs, [failing.url]).wait_ready()
    bad = _run(script, {**env, "ROUTER_URL": bad_rt.url})
    assert bad.returncode != 0 and "FAIL: HTTP" in bad.stderr


def test_hook_sends_the_api_key_when_one_is_configured():
    values = {**TOGGLES["redis-chart"], "tests": {"apiKeySecret": {"name": "test-key"}}}
    script, _ = _hook(values)
    pod = next(m for m in render(values).of("Pod"))
    ref = next(e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "API_KEY")["valueFrom"]
    assert ref == {"secretKeyRef": {"name": "test-key", "key": "api-key"}}
    assert '"Bearer " + os.environ["API_KEY"]' in script
