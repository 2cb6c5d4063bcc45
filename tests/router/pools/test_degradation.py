from dataclasses import replace

import pytest

from contract.errors import ConfigError
from router.pools.choice import PoolSpec
from router.pools.degradation import (
    Actions,
    DegradationConfig,
    Level,
    Signals,
    State,
    actions,
    clear,
    degraded,
    step,
    tripped,
)

CONFIG = DegradationConfig(p99_ttft_s_trip=2.0, p99_ttft_s_clear=1.0, dwell_s=10.0, max_tokens_factor=0.5)
SLOW = Signals(p99_ttft_s=3.0)
MIDDLE = Signals(p99_ttft_s=1.5)  # below trip, above clear
FINE = Signals(p99_ttft_s=0.5)


def run(script, state):
    """script: (time, signals) pairs; returns the level after each step."""
    levels = []
    for now, signals in script:
        state = step(CONFIG, state, signals, now)
        levels.append(state.level)
    return levels, state


N, C, L, S = Level.NORMAL, Level.CANARY_ROLLBACK, Level.LOWER_MAX_TOKENS, Level.SHED


def test_canary_steps_up_one_level_per_dwell_time():
    script = [(t, SLOW) for t in (0, 5, 9.9, 10, 15, 20, 30, 100)]
    levels, _ = run(script, State(canary=True))
    assert levels == [C, C, C, L, L, S, S, S]


def test_stable_pool_skips_canary_rollback():
    levels, _ = run([(0, SLOW), (10, SLOW), (20, SLOW)], State())
    assert levels == [L, S, S]


def test_steps_revert_in_order_after_each_clear_period():
    _, state = run([(0, SLOW), (10, SLOW), (20, SLOW)], State(canary=True))
    assert state.level is S
    script = [(t, FINE) for t in (21, 30, 31, 35, 40, 41, 50, 51, 60, 61, 100)]
    levels, state = run(script, state)
    #          21 30 31 35 40 41 50 51 60 61 100
    assert levels == [S, S, L, L, L, C, C, C, C, C, C]  # the rollback holds
    assert state == State(level=C, canary=True, changed_at=41, clear_since=41)
    _, stable = run([(0, SLOW), (10, SLOW)], State())
    levels, state = run([(t, FINE) for t in (21, 30, 31, 40, 41)], stable)
    assert levels == [S, S, L, L, N]  # a stable pool steps all the way back
    assert state == State(level=N, changed_at=41, clear_since=41)


def test_no_flapping_between_clear_and_trip():
    _, state = run([(0, SLOW)], State(canary=True))
    levels, state = run([(t, MIDDLE) for t in range(1, 200, 5)], state)
    assert set(levels) == {C}
    # alternating around the trip level (MIDDLE at even t, SLOW at odd) climbs one level per dwell time and
    # never steps down: MIDDLE restarts the clear period rather than counting towards it
    script = [(200 + t, SLOW if t % 2 else MIDDLE) for t in range(40)]
    levels, _ = run(script, state)
    assert levels == [C] + [L] * 10 + [S] * 29


def test_a_trip_during_the_clear_period_restarts_it():
    _, state = run([(0, SLOW)], State())
    levels, _ = run([(10, FINE), (19, FINE), (19.5, MIDDLE), (20, FINE), (29, FINE), (30, FINE)], state)
    assert levels == [L, L, L, L, L, N]


def test_unknown_signals_neither_trip_nor_block_recovery():
    assert not tripped(CONFIG, Signals())
    assert clear(CONFIG, Signals())
    _, state = run([(0, SLOW)], State())
    levels, _ = run([(5, Signals()), (15, Signals())], state)
    assert levels == [L, N]


def test_a_rolled_back_canary_stays_rolled_back_however_long_it_is_clear():
    _, state = run([(0, SLOW)], State(canary=True))
    levels, state = run([(t, FINE) for t in range(1, 1000, 7)], state)
    assert set(levels) == {C} and actions(CONFIG, state).canary_weight_factor == 0.0


@pytest.mark.parametrize("signals", [
    Signals(p99_tpot_s=0.2), Signals(error_rate=0.05), Signals(oom_events=1), Signals(kv_usage=0.98),
    Signals(alloc_failures=500),
    Signals(p99_ttft_s=2.0),
])
def test_each_signal_trips_at_its_level(signals):
    assert tripped(CONFIG, signals) and not clear(CONFIG, signals)


def test_just_below_trip_does_not_trip():
    assert not tripped(CONFIG, Signals(p99_ttft_s=1.99, p99_tpot_s=0.19, error_rate=0.049, oom_events=0,
                                       kv_usage=0.979))
    assert clear(CONFIG, Signals(p99_ttft_s=0.99, p99_tpot_s=0.099, error_rate=0.0099, oom_events=0,
                                 kv_usage=0.899))
    assert not clear(CONFIG, Signals(p99_ttft_s=0.5, kv_usage=0.9))


def test_actions_per_level():
    assert actions(CONFIG, State(N, canary=True)) == Actions(1.0, 1.0, False)
    assert actions(CONFIG, State(C, canary=True)) == Actions(0.0, 1.0, False)
    assert actions(CONFIG, State(L, canary=True)) == Actions(0.0, 0.5, False)
    assert actions(CONFIG, State(S, canary=True)) == Actions(0.0, 0.5, True)
    assert actions(CONFIG, State(L)) == Actions(1.0, 0.5, False)
    assert actions(CONFIG, State(S)) == Actions(1.0, 0.5, True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(dwell_s=-1), "dwell_s"), (dict(kv_usage_trip=float("nan")), "kv_usage_trip"),
    (dict(error_rate_clear=0.1, error_rate_trip=0.05), "error_rate_clear"),
    (dict(max_tokens_factor=0), "max_tokens_factor"), (dict(max_tokens_factor=1.5), "max_tokens_factor"),
    (dict(dwell_s=True), "dwell_s"),
])
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        DegradationConfig(**kwargs)
    assert e.value.field == field


def test_degraded_pool():
    spec = PoolSpec("canary", "v2", 20, max_tokens_cap=1000, default_max_tokens=301, max_context_tokens=4096,
                    canary=True)
    assert degraded(spec, Actions(1.0, 1.0, False)) is spec
    assert degraded(spec, Actions(0.0, 1.0, False)) == replace(spec, weight=0)
    assert degraded(spec, Actions(0.0, 0.5, True)) == replace(spec, weight=0, max_tokens_cap=500,
                                                               default_max_tokens=150)
    bare = PoolSpec("stable", "v1", 80)
    assert degraded(bare, Actions(1.0, 0.5, False)) == bare  # nothing to lower
    tiny = PoolSpec("stable", "v1", 80, max_tokens_cap=1, default_max_tokens=1)
    assert degraded(tiny, Actions(1.0, 0.25, False)) == tiny  # never below 1
