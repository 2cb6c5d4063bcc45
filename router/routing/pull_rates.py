"""The pull cost from measured rates (`--pull-token-cost auto`): seconds a pulled token takes over seconds a
prefilled one does, fleet-wide, from the kvfleet engines' counters (engine/server/metrics.py).

Every load scrape brings a replica's cumulative prefill seconds and computed prompt tokens, and its pull transfer
seconds and pulled tokens; the increments since its previous scrape are added to fleet-wide sums whose older
content fades with a half-life of `half_life_s` seconds, so the estimate follows the fleet. Until both sums hold
`min_tokens`, the configured cost stands. A counter that went down (an engine restarted) is a new start. Pure.
"""

from __future__ import annotations

from router.routing.replicas import EngineLoad


class PullRates:
    def __init__(self, half_life_s: float = 600.0, min_tokens: float = 1024.0):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.min_tokens = min_tokens
        self._last: dict[str, tuple[float, float, float, float]] = {}
        self._at: float | None = None
        self.prefill_s = self.prefill_tokens = self.pull_s = self.pulled_tokens = 0.0

    def on_load(self, replica: str, load: EngineLoad, now: float) -> None:
        reading = (load.prefill_seconds, load.prefill_tokens, load.pull_seconds, load.pulled_tokens)
        before = self._last.get(replica)
        self._last[replica] = reading
        if before is None or any(n < b for n, b in zip(reading, before, strict=True)):
            return
        fade = 0.5 ** (max(0.0, now - self._at) / self.half_life_s) if self._at is not None else 1.0
        self._at = now
        self.prefill_s = self.prefill_s * fade + reading[0] - before[0]
        self.prefill_tokens = self.prefill_tokens * fade + reading[1] - before[1]
        self.pull_s = self.pull_s * fade + reading[2] - before[2]
        self.pulled_tokens = self.pulled_tokens * fade + reading[3] - before[3]

    def drop(self, replica: str) -> None:
        self._last.pop(replica, None)

    def cost(self, configured: float) -> float:
        """Prefill tokens one pulled token costs: measured once both rates are known, else `configured`."""
        if self.prefill_tokens < self.min_tokens or self.pulled_tokens < self.min_tokens or self.prefill_s <= 0:
            return configured
        return (self.pull_s / self.pulled_tokens) / (self.prefill_s / self.prefill_tokens)
