"""Measure what the KV cache sizing needs (engine/kv/sizing.py): the weights, and on CUDA the peak memory of
one full step, a dummy forward at --max-num-batched-tokens plus the sampler, read from torch's allocator
statistics (torch.cuda.max_memory_allocated) around it.

`run_profile_step` is the step itself and runs on any device (tests run it on the CPU); `profile_cuda` wraps
it in the CUDA measurements.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from engine.kv.sizing import MemoryProfile, profile_batch_lengths
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def run_profile_step(model, backend, device: torch.device, block_size: int, lengths: list[int]) -> tuple[int, int]:
    """One step over len(lengths) new prompts of these lengths, every one sampled with top-p/top-k (the
    sampler's heavier path), through a KV cache just large enough. Returns (that cache's bytes, rows sampled)."""
    num_blocks = sum(math.ceil(n / block_size) for n in lengths)
    runner_log = logging.getLogger(ModelRunner.__module__)
    quiet, runner_log.disabled = runner_log.disabled, True  # its "KV cache: ..." line is not the engine's cache
    try:
        runner = ModelRunner(model, backend, num_blocks, block_size, device)
    finally:
        runner_log.disabled = quiet
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=1, seed=0)
    vocab = model.config.vocab_size
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence(f"profile-{i}", [(i * 7 + j) % vocab for j in range(n)], params)
        used = math.ceil(n / block_size)
        seq.block_table = list(range(next_block, next_block + used))
        next_block += used
        scheduled.append(ScheduledSeq(seq, n))
    logits, sampled = runner.execute(scheduled)
    Sampler(seed=0)(logits, sampled)
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    return kv_bytes, len(sampled)


def host_memory_bytes() -> int | None:
    """The machine's physical memory (for the CPU sizing line), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def cuda_baseline(device: torch.device) -> int:
    """Free device memory before the engine allocates anything (the reserve is measured against it)."""
    torch.cuda.init()
    return torch.cuda.mem_get_info(device)[0]


def profile_cuda(model, backend, device: torch.device, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, fraction: float, free_at_start: int) -> MemoryProfile:
    """Weights, activation peak and reserve on a CUDA device, with the cached memory released around them."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    lengths = profile_batch_lengths(max_num_batched_tokens, max_num_seqs, max_model_len)
    with torch.inference_mode():
        profile_kv, _ = run_profile_step(model, backend, device, block_size, lengths)
    torch.cuda.synchronize(device)
    activations = max(torch.cuda.max_memory_allocated(device) - weights - profile_kv, 0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # device memory taken since the engine started that torch's allocator does not hold (cuBLAS workspaces,
    # modules); on a shared device it also counts what others allocated meanwhile: a smaller cache, never larger
    reserve = max(free_at_start - free - torch.cuda.memory_reserved(device), 0)
    return MemoryProfile(total=total, fraction=fraction, weights=weights, activations=activations,
                         reserve=reserve, free=free)
