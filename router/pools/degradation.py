"""Automatic degradation of one engine pool: a state machine over injected signals and time. Pure: the
router measures the signals, passes `now` in, and applies `actions(...)` of the state it gets back.

Levels, in order (each keeps the actions of the ones before it):
- NORMAL: nothing changed;
- CANARY_ROLLBACK: a canary pool's weight times 0 (automatic rollback to stable); skipped for a pool that
  is not a canary;
- LOWER_MAX_TOKENS: the pool's default max_tokens times `max_tokens_factor`;
- SHED: shed the lowest-priority, longest requests first (router/admission/shedding.py decides whom).

Signals *trip* when any known one is at or above its trip level, and are *clear* when every known one is
below its clear level (clear < trip: hysteresis; between the two, neither). `step`:
- tripped: one level up, if at least `dwell_s` has passed since the last level change (the first move
  from a fresh state is immediate); the clear period restarts;
- clear: the clear period starts (or continues); one level down once it has lasted `dwell_s` and
  `dwell_s` has passed since the last change; the clear period then restarts, so each further step down
  needs another `dwell_s` of clear signals;
- neither: the level holds and the clear period restarts.
An unknown signal (None) neither trips nor keeps the pool from clearing.

A canary's rollback holds: a canary steps down no further than CANARY_ROLLBACK, however clear its signals
(drained, it sees no traffic, so clear signals would say nothing about it). The router starts it afresh
(`State(canary=True)`) when the pool's configuration changes: a new version or weight in the pools file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from contract.errors import ConfigError
from router.pools.choice import PoolSpec
from router.states import StrEnum


class Level(StrEnum):
    NORMAL = "normal"
    CANARY_ROLLBACK = "canary_rollback"
    LOWER_MAX_TOKENS = "lower_max_tokens"
    SHED = "shed"


LEVELS = (Level.NORMAL, Level.CANARY_ROLLBACK, Level.LOWER_MAX_TOKENS, Level.SHED)
SIGNALS = ("p99_ttft_s", "p99_tpot_s", "error_rate", "oom_events", "alloc_failures", "kv_usage")


@dataclass(frozen=True)
class Signals:
    """One pool's signals over the router's window; None = unknown (e.g. no requests in the window)."""

    p99_ttft_s: float | None = None
    p99_tpot_s: float | None = None
    error_rate: float | None = None  # failed / all requests
    oom_events: int | None = None  # OOMs engines reported in the window
    alloc_failures: int | None = None  # KV block allocations that found no free block, in the window
    kv_usage: float | None = None  # mean KV cache usage, 0..1


@dataclass(frozen=True)
class DegradationConfig:
    """Trip and clear levels per signal (clear < trip) and the minimum time between level changes."""

    p99_ttft_s_trip: float = 2.0
    p99_ttft_s_clear: float = 1.0
    p99_tpot_s_trip: float = 0.2
    p99_tpot_s_clear: float = 0.1
    error_rate_trip: float = 0.05
    error_rate_clear: float = 0.01
    oom_events_trip: float = 1
    oom_events_clear: float = 1  # any OOM blocks recovery
    alloc_failures_trip: float = 500  # a preemption storm (a few per window are normal under load)
    alloc_failures_clear: float = 50
    kv_usage_trip: float = 0.98
    kv_usage_clear: float = 0.90
    dwell_s: float = 30.0
    max_tokens_factor: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ConfigError(f.name, f"{f.name} must be a finite number >= 0, got {value!r}")
        for name in SIGNALS:
            if getattr(self, f"{name}_clear") > getattr(self, f"{name}_trip"):
                raise ConfigError(f"{name}_clear", f"{name}_clear must not be above {name}_trip")
        if not 0 < self.max_tokens_factor <= 1:
            raise ConfigError("max_tokens_factor", f"max_tokens_factor must be in (0, 1], "
                              f"got {self.max_tokens_factor}")


@dataclass(frozen=True)
class State:
    """A pool's level, whether it is a canary, when the level last changed (None: never), and since when
    the signals have been clear (None: not clear now)."""

    level: Level = Level.NORMAL
    canary: bool = False
    changed_at: float | None = None
    clear_since: float | None = None


@dataclass(frozen=True)
class Actions:
    """What the router applies to the pool: its weight times `canary_weight_factor`, its default max_tokens
    times `max_tokens_factor`, and load shedding when `shed`."""

    canary_weight_factor: float
    max_tokens_factor: float
    shed: bool


def tripped(config: DegradationConfig, signals: Signals) -> bool:
    return any(v >= getattr(config, f"{name}_trip")
               for name in SIGNALS if (v := getattr(signals, name)) is not None)


def clear(config: DegradationConfig, signals: Signals) -> bool:
    return all(v < getattr(config, f"{name}_clear")
               for name in SIGNALS if (v := getattr(signals, name)) is not None)


def _levels(canary: bool) -> tuple[Level, ...]:
    return LEVELS if canary else tuple(lv for lv in LEVELS if lv is not Level.CANARY_ROLLBACK)


def step(config: DegradationConfig, state: State, signals: Signals, now: float) -> State:
    """The pool's next state (rules in the module docstring)."""
    levels = _levels(state.canary)
    i = levels.index(state.level)
    dwelt = state.changed_at is None or now - state.changed_at >= config.dwell_s
    if tripped(config, signals):
        if dwelt and i + 1 < len(levels):
            return replace(state, level=levels[i + 1], changed_at=now, clear_since=None)
        return replace(state, clear_since=None)
    if not clear(config, signals):
        return replace(state, clear_since=None)
    since = now if state.clear_since is None else state.clear_since
    floor = levels.index(Level.CANARY_ROLLBACK) if state.canary and i > 0 else 0
    if i > floor and dwelt and now - since >= config.dwell_s:
        return replace(state, level=levels[i - 1], changed_at=now, clear_since=now)
    return replace(state, clear_since=since)


def actions(config: DegradationConfig, state: State) -> Actions:
    """What the router does at the state's level (each level keeps the actions of the levels below it)."""
    rank = LEVELS.index(state.level)
    return Actions(
        canary_weight_factor=0.0 if state.canary and rank >= LEVELS.index(Level.CANARY_ROLLBACK) else 1.0,
        max_tokens_factor=config.max_tokens_factor if rank >= LEVELS.index(Level.LOWER_MAX_TOKENS) else 1.0,
        shed=state.level is Level.SHED,
    )


def degraded(spec: PoolSpec, act: Actions) -> PoolSpec:
    """The pool as the router uses it under `act`: its weight times the canary factor, its max_tokens default
    and cap times the max_tokens factor (at least 1; a pool that sets neither has nothing to lower)."""
    def lower(v: int | None) -> int | None:
        return None if v is None else max(1, math.floor(v * act.max_tokens_factor))

    if act.canary_weight_factor == 1.0 and act.max_tokens_factor == 1.0:
        return spec
    return replace(spec, weight=math.floor(spec.weight * act.canary_weight_factor),
                   default_max_tokens=lower(spec.default_max_tokens), max_tokens_cap=lower(spec.max_tokens_cap))
