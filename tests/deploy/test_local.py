"""`kvfleet up` as a real process: starts engines (the fast fake engine here; the real model in the slow
test) and a router, serves through the router, and leaves no process behind on SIGTERM / Ctrl-C / failure."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from deploy.local import build_parser, engine_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for k in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no consecutive free ports")


def descendants(pid: int) -> set[int]:
    """Every live process whose parent chain leads to pid (from /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(d)] = int(fields[1])
            except (OSError, IndexError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_up(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    base = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet", "up", "--port", str(base), "--engine-port",
                             str(base + 1), "--log-dir", str(tmp_path), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, base


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    out = []
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            out.append(line)
            if marker in line:
                return "".join(out)
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.05)
    raise AssertionError(f"no {marker!r} in output:\n{''.join(out)}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_and_stops_without_orphans(tmp_path, sig):
    proc, port = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "2")
    try:
        banner = read_until(proc, "Ctrl-C to stop", 60)
        assert f"http://127.0.0.1:{port}/v1" in banner and "curl" in banner
        kids = descendants(proc.pid)
        assert len(kids) >= 3  # two engines and the router
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                          json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200
        assert resp.headers["x-kvfleet-replica"] in (f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}")
        proc.send_signal(sig)
        assert proc.wait(timeout=40) == 0
        assert "stopped" in proc.stdout.read()
        assert not [p for p in kids if alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_up_reports_a_failing_engine_and_cleans_up(tmp_path):
    proc, _ = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "2", "--",
                       "--no-such-flag")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    # both replicas fail; which one up notices first depends on which one exits first
    assert re.search(r"engine-[01] exited with status 2", out) and "--no-such-flag" in out


def test_up_rejects_bad_flags(tmp_path):
    proc, _ = start_up(tmp_path, "--replicas", "0")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--replicas must be >= 1" in out


def test_engine_argv_pins_only_the_real_engine():
    ns = build_parser().parse_args(["--engine-port", "9001"])
    assert ns.pin_cores and not build_parser().parse_args(["--no-pin-cores"]).pin_cores
    argv = engine_argv(ns, "py", 1, 2, (2, 3))
    assert argv == ["py", "-m", "kvfleet", "engine", "--model", "smollm2", "--host", "127.0.0.1", "--port", "9002",
                    "--instance-id", "replica-1", "--num-threads", "2", "--log-level", "warning", "--cpu-cores", "2-3"]
    assert "--cpu-cores" not in engine_argv(ns, "py", 0, 1, None)
    fake = build_parser().parse_args(["--engine-module", "loadtest.fake_engine"])
    assert engine_argv(fake, "py", 0, 1, (0,))[-2:] == ["--instance-id", "replica-0"]  # no threads, no cores


@pytest.mark.slow
@pytest.mark.model
def test_up_with_the_bundled_model(tmp_path):
    proc, port = start_up(tmp_path, "--replicas", "2", "--", "--max-num-seqs", "4")
    try:
        read_until(proc, "Ctrl-C to stop", 600)
        kids = descendants(proc.pid)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}],
                                "max_tokens": 8})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert not [p for p in kids if alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_models_parse_into_pools_the_router_reads():
    from deploy.local_models import KVEvents, LocalModel, parse_models, pools_file, vllm_argv
    from router.pools.file import parse_pools

    models = parse_models("smollm2,tiny=/data/tiny-llama,vllm:Qwen/Qwen3=/data/qwen3")
    assert models == [LocalModel("smollm2", "smollm2"), LocalModel("tiny", "/data/tiny-llama"),
                      LocalModel("Qwen/Qwen3", "/data/qwen3", "vllm")]
    assert [m.pool for m in models] == ["smollm2", "tiny", "qwen-qwen3"]
    placed = [(models[0], ["http://127.0.0.1:9001"], []),
              (models[2], ["http://127.0.0.1:9003", "http://127.0.0.1:9004"], [KVEvents("/tmp/k3", 7002),
                                                                                KVEvents("/tmp/k4", 7004)])]
    cfg = parse_pools(yaml_dump(pools_file(placed)))
    small, qwen = cfg.pools
    assert (small.spec.models, small.engine, small.kv_events, small.tokenizer) == (("smollm2",), "kvfleet", None,
                                                                                   "smollm2")
    assert (qwen.spec.models, qwen.engine, qwen.tokenizer) == (("Qwen/Qwen3",), "vllm", "/data/qwen3")
    assert qwen.kv_events.endpoints("http://127.0.0.1:9004") == ("ipc:///tmp/k4", "tcp://127.0.0.1:7004")
    argv = vllm_argv("vpy", models[2], "127.0.0.1", 9003, KVEvents("/tmp/k3", 7002))
    assert argv[:3] == ["vpy", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--served-model-name") + 1] == "Qwen/Qwen3" and "--enable-prompt-tokens-details" in argv
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("ipc:///tmp/k3", "tcp://127.0.0.1:7002")


@pytest.mark.parametrize("models, problem", [
    ("smollm2,,x", "an empty item"), ("a=x,a=y", "model 'a' is listed twice"),
    ("vllm:smollm2", "a vLLM model needs NAME=HF_DIRECTORY"), ("A=x,a=y", "would share the pool name 'a'")])
def test_bad_model_lists_name_the_item(models, problem):
    from deploy.local_models import parse_models

    with pytest.raises(ValueError, match=problem):
        parse_models(models)


def test_up_serves_two_models_one_pool_each(tmp_path):
    proc, port = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "1",
                          "--models", "smollm2,tiny=/nowhere/tiny")
    url = f"http://127.0.0.1:{port}"
    try:
        banner = read_until(proc, "Ctrl-C to stop", 60)
        assert "models: smollm2, tiny" in banner
        for model, replica in (("smollm2", port + 1), ("tiny", port + 2)):
            resp = httpx.post(url + "/v1/chat/completions", timeout=10,
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] == f"http://127.0.0.1:{replica}"
        resp = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"  # two models: name one
        assert sorted(m["id"] for m in httpx.get(url + "/v1/models").json()["data"]) == ["smollm2", "tiny"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_up_refuses_vllm_without_a_model_directory(tmp_path):
    proc, _ = start_up(tmp_path, "--engine", "vllm")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--engine vllm needs --models NAME=HF_DIRECTORY" in out


def yaml_dump(data) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def test_up_with_the_picker_beside_the_engines(tmp_path):
    """`kvfleet up --epp`: an endpoint picker over the same engines; a gateway's request through it reaches one,
    and stopping leaves nothing behind."""
    from tests.router.epp.gateway import Gateway, wait_serving

    grpc_port = free_ports(2)
    metrics_port = grpc_port + 1
    proc, port = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "2", "--epp",
                          "--epp-port", str(grpc_port), "--epp-metrics-port", str(metrics_port))
    try:
        banner = read_until(proc, "Ctrl-C to stop", 60)
        assert f"127.0.0.1:{grpc_port}" in banner
        kids = descendants(proc.pid)
        wait_serving(f"127.0.0.1:{grpc_port}", timeout=30)
        got = Gateway(f"127.0.0.1:{grpc_port}").send("/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
        assert got.status == 200, got.body
        assert got.served in (f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}")
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/ready").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        assert not [p for p in kids if alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_up_refuses_picker_ports_that_collide(tmp_path):
    proc, port = start_up(tmp_path, "--epp", "--epp-port", "9002", "--epp-metrics-port", "9002")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "must differ" in out
