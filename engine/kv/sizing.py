"""How many KV blocks an engine allocates: the arithmetic, free of I/O (engine/memory_profile.py measures).

On a GPU the engine may use `fraction` of the device's total memory (--gpu-memory-fraction, so replicas
sharing a device each take their part, never the same free memory twice):

    KV bytes = total x fraction - weights - activations peak - reserve,   at most  free - activations peak

where `activations peak` is what a profiled forward pass at --max-num-batched-tokens plus the sampler
allocated above the weights (its own small KV cache excluded), `reserve` is device memory the engine came to
use outside torch's allocator while loading and profiling, and `free` is the device's free memory after the
profile (the cap keeps a replica from counting on memory another process already holds). On a CPU the KV
cache gets a fixed budget (--kv-cache-memory, default 2 GiB of host memory); activations are not profiled.
Either way one INFO line states the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured on a GPU after loading the model and profiling one full step."""

    total: int
    fraction: float
    weights: int
    activations: int
    reserve: int
    free: int | None = None  # free device memory after profiling; None: no cap


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    kv_bytes: int
    bytes_per_block: int
    limited_by: str  # "--gpu-memory-fraction", "free memory", "--kv-cache-memory" or "CPU default"
    line: str  # the arithmetic, for the log


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_from_profile(p: MemoryProfile, bytes_per_block: int) -> KVCachePlan:
    """The KV cache that fits in p.fraction of the device next to the weights and one step's activations."""
    budget = int(p.total * p.fraction)
    by_fraction = budget - p.weights - p.activations - p.reserve
    kv, limited_by = by_fraction, "--gpu-memory-fraction"
    if p.free is not None and p.free - p.activations < by_fraction:
        kv, limited_by = p.free - p.activations, "free memory"
    num_blocks = max(kv, 0) // bytes_per_block
    line = (f"KV cache sizing (GPU): total {_gib(p.total)} x {p.fraction:g} = {_gib(budget)} - weights "
            f"{_gib(p.weights)} - activations peak {_gib(p.activations)} - reserve {_gib(p.reserve)} = "
            f"{_gib(by_fraction)}")
    if p.free is not None:
        line += f"; free after profiling {_gib(p.free)} - activations peak = {_gib(p.free - p.activations)}"
    line += (f"; KV {_gib(max(kv, 0))} (limited by {limited_by}) / {bytes_per_block} B per block = "
             f"{num_blocks} blocks")
    if num_blocks < 1:
        raise ConfigError("--gpu-memory-fraction", f"--gpu-memory-fraction: no room for a KV block: {line}; raise "
                                                   f"--gpu-memory-fraction or lower --max-num-batched-tokens")
    return KVCachePlan(num_blocks, kv, bytes_per_block, limited_by, line)


def plan_fixed(kv_bytes: int, bytes_per_block: int, weights: int, total: int | None, explicit: bool) -> KVCachePlan:
    """A fixed KV budget: --kv-cache-memory, or the CPU default (host memory, activations not profiled)."""
    limited_by = "--kv-cache-memory" if explicit else "CPU default"
    num_blocks = kv_bytes // bytes_per_block
    total_text = "unknown" if total is None else _gib(total)
    line = (f"KV cache sizing (fixed, {limited_by}): total {total_text}, weights {_gib(weights)}, activations peak "
            f"not profiled, reserve none; KV {_gib(kv_bytes)} / {bytes_per_block} B per block = {num_blocks} blocks")
    if num_blocks < 1:
        raise ConfigError("--kv-cache-memory", f"--kv-cache-memory: {_gib(kv_bytes)} holds no KV block of "
                                               f"{bytes_per_block} bytes")
    return KVCachePlan(num_blocks, kv_bytes, bytes_per_block, limited_by, line)


def profile_batch_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiled step: the whole token budget, as many sequences as may run (each one
    sampled: the widest logits and sampler work) and the first as long as allowed (the largest attention)."""
    n = min(max_num_seqs, max_num_batched_tokens)
    lengths = [1] * n
    remaining = max_num_batched_tokens - n
    for i in range(n):
        add = min(remaining, max_model_len - 1)
        lengths[i] += add
        remaining -= add
        if not remaining:
            break
    return lengths
