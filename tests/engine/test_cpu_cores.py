"""CPU core lists: exact parsing, shortest formatting, disjoint slices per replica, pinning every thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.cpu_cores import core_slices, format_cpu_list, parse_cpu_list


@pytest.mark.parametrize("text,cores", [
    ("0", (0,)),
    ("0-1", (0, 1)),
    ("0,2-3", (0, 2, 3)),
    (" 3 , 1 ", (1, 3)),
    ("2-2", (2,)),
    ("0-2,1-3", (0, 1, 2, 3)),  # overlaps merge, as in the kernel's lists
    ("8191", (8191,)),
])
def test_parse(text, cores):
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", " ", "a", "-1", "1-", "-", "0,,1", "0,", "1-0", "0-1-2", "0:2", "1.5", "٣",
                                  "8192", "0-100000"])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize("cores,text", [((0,), "0"), ((0, 1), "0-1"), ((0, 2, 3), "0,2-3"),
                                        ((5, 0, 1, 2), "0-2,5"), ((1, 1, 3), "1,3"), ((), "")])
def test_format(cores, text):
    assert format_cpu_list(cores) == text
    if cores:
        assert parse_cpu_list(text) == tuple(sorted(set(cores)))


def test_core_slices():
    assert core_slices((0, 1), 2) == [(0,), (1,)]
    assert core_slices((0, 1, 2, 3), 2) == [(0, 1), (2, 3)]
    assert core_slices((0,), 2) is None
    assert core_slices((0, 1, 2), 2) == [(0,), (1,)]  # the odd core stays free
    assert core_slices((4, 6, 5, 7), 2) == [(4, 5), (6, 7)]
    assert core_slices((0, 1, 2, 3), 1) == [(0, 1, 2, 3)]
    assert core_slices((0, 1, 2, 3, 4, 5), 2, per_replica=2) == [(0, 1), (2, 3)]  # threads-per-engine of them
    assert core_slices((0, 1, 2, 3), 2, per_replica=8) == [(0, 1), (2, 3)]  # never more than an even split
    with pytest.raises(ValueError):
        core_slices((0, 1), 0)


def test_pin_process_pins_running_and_later_threads():
    core = min(os.sched_getaffinity(0))
    code = f"""
import os, threading
from engine.cpu_cores import pin_process
started = threading.Event(); stop = threading.Event()
before = threading.Thread(target=lambda: (started.set(), stop.wait())); before.start(); started.wait()
pin_process(({core},))
later = []
t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t.start(); t.join()
stop.set(); before.join()
print(sorted({{c for tid in os.listdir('/proc/self/task') for c in os.sched_getaffinity(int(tid))}}), sorted(later[0]))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]
