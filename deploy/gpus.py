"""Which GPU each local replica gets (`kvfleet up`): pure functions, tested without GPUs.

An engine replica uses one device (there is no tensor parallelism). Replicas go round robin over the
visible GPUs, each process seeing only its own through CUDA_VISIBLE_DEVICES. With more replicas than GPUs,
replicas share a device and split it: `--gpu-memory-fraction` F is the share of each device that all the
replicas on it use together, so each of k replicas on one device sizes its KV cache from F / k of the
device's total memory (the engine's --gpu-memory-fraction), never from the same free memory as its neighbour.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaDevice:
    """A replica's device: CUDA_VISIBLE_DEVICES and --gpu-memory-fraction; both None on CPU-only machines."""

    visible_devices: str | None
    memory_fraction: float | None

    def env(self) -> dict[str, str]:
        return {} if self.visible_devices is None else {"CUDA_VISIBLE_DEVICES": self.visible_devices}

    def engine_args(self) -> list[str]:
        return [] if self.memory_fraction is None else ["--gpu-memory-fraction", f"{self.memory_fraction:g}"]


def parse_gpu_list(text: str) -> list[str]:
    """"0,1,3" -> ["0", "1", "3"] (ids or GPU UUIDs, as CUDA_VISIBLE_DEVICES takes them); "" / "none" / "-1" -> []."""
    if text.strip().lower() in ("", "none", "-1"):
        return []
    ids = [part.strip() for part in text.split(",")]
    if any(not i for i in ids):
        raise ValueError(f"GPU list {text!r} has an empty entry; expected ids like 0,1,3")
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {text!r} names a GPU twice")
    return ids


def visible_gpus(env: Mapping[str, str], device_count: Callable[[], int]) -> list[str]:
    """The GPUs this launcher may hand out: its own CUDA_VISIBLE_DEVICES if set, else 0..device_count()-1."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_gpu_list(env["CUDA_VISIBLE_DEVICES"])
    return [str(i) for i in range(device_count())]


def assign_gpus(gpus: Sequence[str], replicas: int, memory_fraction: float) -> list[ReplicaDevice]:
    """Replica i gets gpus[i % len(gpus)]; the k replicas on one device get memory_fraction / k each."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {memory_fraction}")
    if not gpus:
        return [ReplicaDevice(None, None)] * replicas
    chosen = [gpus[i % len(gpus)] for i in range(replicas)]
    sharing = Counter(chosen)
    # rounded down to 4 decimals, as passed on the command line: the shares never add up to more than asked
    return [ReplicaDevice(g, math.floor(memory_fraction / sharing[g] * 10_000) / 10_000) for g in chosen]


def describe(devices: Sequence[ReplicaDevice]) -> str:
    """`replica-0: GPU 0 (0.45 of it) | replica-1: GPU 1 (0.9 of it)`; empty on CPUs."""
    if all(d.visible_devices is None for d in devices):
        return ""
    return " | ".join(f"replica-{i}: GPU {d.visible_devices} ({d.memory_fraction:.4g} of it)"
                      for i, d in enumerate(devices))


def cuda_device_count() -> int:
    """Devices torch sees (0 without CUDA); imported lazily so the launcher starts fast on CPUs."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
