"""Engine step times for the fleet simulator: a linear cost model per engine step.

    step seconds = base_s + prefill_token_s * (prompt tokens computed in the step)
                          + decode_seq_s * (sequences decoding one token in the step)

Calibration (`SMOLLM2_1CORE`): kvfleet's own engine, SmolLM2-135M (the bundled Q4_1 GGUF), one torch thread,
prefix caching off, on the 2-core development machine (shared with other work while it ran; no GPU in this
task), `LLM.generate` timed whole (2026-11-30):

    prefill of 128 / 512 / 2,048 tokens (max_tokens 1):  245 / 1,329 / 5,965 ms
    one decode step at batch 1 / 8 / 32:                  16.3 / 29.8 / 53.7 ms

A line through the decode steps gives base 17 ms and 1.2 ms per decoding sequence; the 2,048-token prefill
gives 2.9 ms per prefill token (the 512-token one 2.6, the 128-token one 1.9).
The kvfleet engine and vLLM-CPU were within a factor of 1.6 of each other on single-request TTFT on this
machine (docs/results.md), so the same model stands in for the one-core vLLM-CPU engines of issue 15.

Limits: linear in prefill tokens (attention's quadratic term is folded in: the 2,048-token prefill costs
about 1.2x the per-token figure of the 128-token one), no dependence on context length in decode, one
calibration point (one model, one core). Absolute TTFTs are this engine's on this machine; what carries
over is how policies compare under the same cost. Scale it with `scaled()` (e.g. a faster engine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CostModel:
    base_s: float
    prefill_token_s: float
    decode_seq_s: float

    def __post_init__(self) -> None:
        for name in ("base_s", "prefill_token_s", "decode_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name}: must be >= 0, got {getattr(self, name)}")

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs

    def scaled(self, speedup: float) -> CostModel:
        """The same engine `speedup` times faster (every term divided)."""
        if not speedup > 0:
            raise ValueError(f"speedup: must be > 0, got {speedup}")
        return replace(self, base_s=self.base_s / speedup, prefill_token_s=self.prefill_token_s / speedup,
                       decode_seq_s=self.decode_seq_s / speedup)


SMOLLM2_1CORE = CostModel(base_s=0.017, prefill_token_s=0.0029, decode_seq_s=0.0012)
COST_MODELS = {"smollm2-1core": SMOLLM2_1CORE}
