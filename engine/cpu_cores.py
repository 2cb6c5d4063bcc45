"""CPU core lists in the Linux format ("0", "0-1", "0,2-3"): parse, format, split among replicas, pin.

`--cpu-cores` pins an engine to some cores, so that replicas on one machine do not compete for the same ones;
`kvfleet up` gives each replica a disjoint slice from `core_slices`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

MAX_CORE = 8191  # Linux NR_CPUS is at most 8192


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The sorted distinct cores of a list like "0,2-3"; ValueError on bad syntax or an empty list."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"must be a CPU list like 0, 0-1 or 0,2-3; got {text!r}")
    cores: set[int] = set()
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip(), re.ASCII)
        if m is None:
            raise ValueError(f"must be a CPU list like 0, 0-1 or 0,2-3; got {text!r}")
        first, last = int(m[1]), int(m[2] or m[1])
        if last < first:
            raise ValueError(f"range {item.strip()!r} runs backwards in {text!r}")
        if last > MAX_CORE:
            raise ValueError(f"core {last} is beyond the largest core number Linux supports ({MAX_CORE})")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Sequence[int]) -> str:
    """The shortest list for these cores: (0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def core_slices(cores: Sequence[int], replicas: int, per_replica: int | None = None) -> list[tuple[int, ...]] | None:
    """Disjoint consecutive slices of `cores`, one per replica: len(cores) // replicas each, or per_replica if
    that is fewer; None when there are fewer cores than replicas (then nothing is pinned)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ordered = sorted(set(cores))
    size = len(ordered) // replicas
    if size == 0:
        return None
    if per_replica is not None:
        size = max(1, min(size, per_replica))
    return [tuple(ordered[i * size:(i + 1) * size]) for i in range(replicas)]


def pin_process(cores: Sequence[int]) -> None:
    """Pin every thread of this process to `cores`; threads started later inherit it from their creator."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread exited meanwhile
            pass
