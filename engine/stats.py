"""What an engine reports of itself after every step: KV usage, queues, counters (the server's /metrics and
the router's load signals read it). Torch-free, so the server process need not import torch for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    kv_usage: float
    num_running: int
    num_waiting: int
    num_total_blocks: int
    block_size: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    num_preemptions: int
    alloc_failures: int
    evictions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    oom_events: int = 0
    gpu_memory_used_bytes: int | None = None  # torch.cuda.memory_allocated on the engine's GPU; None on CPUs
    kv_events_published: int = 0
    num_free_blocks: int = 0  # blocks no request holds (cached ones among them, evictable)
    num_cached_blocks: int = 0  # blocks whose content the prefix cache holds (held or free)
    num_pinned_blocks: int = 0  # blocks cache_control prefixes keep from eviction (engine/kv/pins.py)
    max_loras: int = 0  # adapter slots per step (0: LoRA off)
    deterministic: bool = False  # --deterministic: batch-invariant kernels
    tier_blocks: int = 0  # blocks the lower tier holds (--kv-tier-gib)
    tier_bytes: int = 0
    tier_spilled_blocks: int = 0  # evicted blocks it took, since start
    tier_reloaded_blocks: int = 0  # blocks brought back from it into the cache, since start
    step_seconds: float = 0.0  # the last step's wall time (schedule to sampled tokens)
    step_predicted_seconds: float = 0.0  # what the step-time model predicted for it (0 until fitted; engine/step_time.py)
    steps_predicted: int = 0  # steps the model predicted, since start; over them, the seconds predicted and taken,
    step_predicted_seconds_total: float = 0.0
    step_observed_seconds_total: float = 0.0
    step_prediction_error_seconds_total: float = 0.0  # and the sum of |predicted - taken|
    spec_num_drafts: int = 0  # --speculative-config (engine/spec/): verifications of a sequence with drafts,
    spec_num_draft_tokens: int = 0  # the drafts they verified, and those accepted, since start
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at position i; () with speculation off
    spec_gate_open: bool = True  # whether drafting pays at the last step's batch size (engine/spec/draft_gate.py)
    spec_gate_speedup: float | None = None  # its moving estimate of what drafting gains (None: not measured yet)
    spec_gate_closed_steps: int = 0  # steps that did not draft because it was closed, since start
    lora_running: tuple[str, ...] = ()  # adapters of the running requests
    lora_waiting: tuple[str, ...] = ()  # adapters of the waiting ones
