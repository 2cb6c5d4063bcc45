"""`kvfleet up` on GPU machines: each replica its own device (CUDA_VISIBLE_DEVICES, round robin), replicas that
share a device split its memory fraction. The assignment is pure; one test checks real child processes."""

from __future__ import annotations

import os
import signal

import pytest

from deploy.gpus import ReplicaDevice, assign_gpus, describe, parse_gpu_list, visible_gpus
from deploy.local import build_parser, engine_argv, replica_devices
from tests.deploy.test_local import descendants, read_until, start_up


def test_one_gpu_per_replica_round_robin():
    assert assign_gpus(["0", "1", "2", "3"], 2, 0.9) == [ReplicaDevice("0", 0.9), ReplicaDevice("1", 0.9)]
    assert [d.visible_devices for d in assign_gpus(["0", "1"], 5, 0.9)] == ["0", "1", "0", "1", "0"]


def test_replicas_sharing_a_gpu_split_its_fraction():
    devices = assign_gpus(["0", "1"], 3, 0.9)
    assert devices == [ReplicaDevice("0", 0.45), ReplicaDevice("1", 0.9), ReplicaDevice("0", 0.45)]
    seven = assign_gpus(["0"], 7, 0.9)
    assert {d.memory_fraction for d in seven} == {0.1285}  # rounded down: never more than asked in total
    assert sum(d.memory_fraction for d in seven) <= 0.9


def test_no_gpus_leaves_replicas_on_the_cpu():
    devices = assign_gpus([], 3, 0.9)
    assert devices == [ReplicaDevice(None, None)] * 3
    assert devices[0].env() == {} and devices[0].engine_args() == [] and describe(devices) == ""


def test_env_and_flags_of_a_replica():
    d = ReplicaDevice("GPU-8c1f", 0.45)
    assert d.env() == {"CUDA_VISIBLE_DEVICES": "GPU-8c1f"}
    assert d.engine_args() == ["--gpu-memory-fraction", "0.45"]
    assert describe(assign_gpus(["0", "1"], 3, 0.9)) == ("replica-0: GPU 0 (0.45 of it) | replica-1: GPU 1 (0.9 of it) "
                                                          "| replica-2: GPU 0 (0.45 of it)")


def test_visible_gpus_honour_the_launchers_own_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, lambda: 8) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: 8) == []
    assert visible_gpus({}, lambda: 2) == ["0", "1"]
    assert visible_gpus({}, lambda: 0) == []


@pytest.mark.parametrize("text,error", [("0,,1", "empty entry"), ("1,1", "twice")])
def test_bad_gpu_lists(text, error):
    with pytest.raises(ValueError, match=error):
        parse_gpu_list(text)
    assert parse_gpu_list("none") == [] and parse_gpu_list(" 0, 1 ") == ["0", "1"]


def test_bad_fraction():
    with pytest.raises(ValueError, match="--gpu-memory-fraction"):
        assign_gpus(["0"], 1, 1.5)


def test_up_flags_reach_the_engine_command_line():
    ns = build_parser().parse_args(["--replicas", "3", "--gpus", "4,5", "--gpu-memory-fraction", "0.8"])
    devices = replica_devices(ns, env={}, device_count=lambda: 0)
    assert devices == [ReplicaDevice("4", 0.4), ReplicaDevice("5", 0.8), ReplicaDevice("4", 0.4)]
    argv = engine_argv(ns, "py", 0, 1, None, devices[0])
    assert argv[-2:] == ["--gpu-memory-fraction", "0.4"]
    detected = build_parser().parse_args(["--replicas", "2"])
    assert replica_devices(detected, env={}, device_count=lambda: 2) == [ReplicaDevice("0", 0.9),
                                                                          ReplicaDevice("1", 0.9)]
    assert replica_devices(detected, env={}, device_count=lambda: 0) == [ReplicaDevice(None, None)] * 2


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")


def test_up_gives_each_replica_process_its_own_gpu(tmp_path):
    proc, _ = start_up(tmp_path, "--engine-module", "loadtest.fake_engine", "--replicas", "2", "--gpus", "3,5")
    try:
        out = read_until(proc, "Ctrl-C to stop", 60)
        assert "engine GPUs: replica-0: GPU 3 (0.9 of it) | replica-1: GPU 5 (0.9 of it)" in out
        seen = {}
        for pid in descendants(proc.pid):
            try:
                cmd = _cmdline(pid)
                if "loadtest.fake_engine" in cmd:
                    seen[cmd[cmd.index("--instance-id") + 1]] = _environ(pid).get("CUDA_VISIBLE_DEVICES")
            except (OSError, ValueError):
                pass
        assert seen == {"replica-0": "3", "replica-1": "5"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
