"""The engine core in a process of its own: a core killed mid-stream fails every stream with an error
event (never a hang), the server reports itself dead and exits non-zero; killing the server takes the core
with it (no orphan holding the model)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.engine.server.conftest import start_engine

FLAGS = ("--max-num-seqs", "8", "--num-blocks", "512", "--max-model-len", "1024")


def _children(pid: int) -> list[int]:
    """Children of every thread of the process (the core is started from a worker thread)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids.extend(int(p) for p in f.read().split())
    return kids


def _core_pid(server) -> int:
    kids = [p for p in _children(server.proc.pid) if "spawn" in open(f"/proc/{p}/cmdline").read()]
    assert len(kids) == 1, f"expected one engine core process, got {kids}"
    return kids[0]


def _stream(url: str, out: list, started: threading.Event) -> None:
    body = {"model": "smollm2", "prompt": "Count: one, two,", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        started.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e}")
    out.append(events)


@pytest.fixture()
def server(tmp_path):
    s = start_engine(str(tmp_path), *FLAGS)
    yield s
    s.stop()


def test_a_killed_core_fails_every_stream_and_the_server_exits(server):
    core = _core_pid(server)
    assert core != server.proc.pid
    results: list = []
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server.url, results, ev)) for ev in started]
    for t in threads:
        t.start()
    assert all(ev.wait(60) for ev in started), server.log()
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its engine core died"
    assert len(results) == 3
    for events in results:
        errors = [json.loads(e)["error"] for e in events if e.startswith("{") and '"error"' in e]
        assert len(errors) == 1, events[-3:]
        assert "engine" in errors[0]["message"], errors[0]
        assert events[-1] == "[DONE]"
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            r = httpx.get(f"{server.url}/ready", timeout=2)
            assert r.status_code == 503 and r.json()["reason"] == "engine_dead"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert server.proc.poll() == 1, "the server went on after its engine core died"
    assert "engine core process died" in server.log()


@pytest.mark.slow  # a model load of its own (kept out of the default run for its time)
def test_killing_the_server_takes_its_core_along(server):
    core = _core_pid(server)
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{core}") and time.monotonic() < deadline:
        try:
            with open(f"/proc/{core}/stat") as f:
                if f.read().split()[2] == "Z":  # a zombie until its parent is reaped: gone as far as work goes
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{core}") and open(f"/proc/{core}/stat").read().split()[2] != "Z"
    assert not alive, "the engine core outlived its server"
