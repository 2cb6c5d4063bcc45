"""The link KV blocks cross in the fleet simulator: a peer pull (issue 31), a reload from a replica's lower tier
(tier.py), the hand-off from a prefill replica to a decode replica (disaggregation). Transfers are independent:
no link is shared, so many at once take no longer than one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvfleet.sim.cost import CostModel
from router.config import ScoringConfig


@dataclass(frozen=True)
class PullLink:
    """A move of n prompt tokens' KV takes latency_s + n * kv_bytes_per_token / bandwidth_bytes_s. Defaults:
    SmolLM2-135M's KV (30 layers x 2 x 3 kv heads x 64 x 2 bytes) over a TCP link of 1 GB/s with 2 ms to set up."""

    bandwidth_bytes_s: float = 1e9
    latency_s: float = 0.002
    kv_bytes_per_token: int = 23_040

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_s", "kv_bytes_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PullLink.{name}: must be > 0, got {getattr(self, name)}")
        if not self.latency_s >= 0:
            raise ValueError(f"PullLink.latency_s: must be >= 0, got {self.latency_s}")

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bandwidth_bytes_s

    def scoring(self, scoring: ScoringConfig, cost: CostModel) -> ScoringConfig:
        """The routing score's pull costs, in prefill-token units of `cost`."""
        return replace(scoring, pull_token_cost=self.kv_bytes_per_token / self.bandwidth_bytes_s / cost.prefill_token_s,
                       pull_fixed_tokens=self.latency_s / cost.prefill_token_s)
