"""What a scenario returns (a verdict with its figures and checks), and the pure statistics behind them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Verdict:
    scenario: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


def linear_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def second_half_growth(ts: list[float], ys: list[float]) -> float:
    """How much ys grows over the second half of the run by the slope of a linear fit of that half:
    slope x the half's duration (same unit as ys). Warm-up (the first half) is ignored."""
    if len(ts) < 4:
        return 0.0
    mid = ts[0] + (ts[-1] - ts[0]) / 2
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if t >= mid]
    if len(pts) < 2:
        return 0.0
    hx, hy = [p[0] for p in pts], [p[1] for p in pts]
    return linear_slope(hx, hy) * (hx[-1] - hx[0])


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
