import random

import pytest

from contract.errors import ConfigError
from router.pools.choice import PoolChoice, PoolRefusal, PoolSpec, apply_caps, check_pools, choose_pool

SEED = 7
SESSIONS = [f"session-{i}" for i in range(10_000)]


def pools(canary_weight=20, stable_weight=80, **stable):
    return [PoolSpec("stable", "v1", stable_weight, max_context_tokens=4096, **stable),
            PoolSpec("canary", "v2", canary_weight, max_context_tokens=4096),
            PoolSpec("long", "v1-long", 1, max_context_tokens=32768, long_context=True)]


def assign(ps, sessions=SESSIONS, prompt=100, max_tokens=100):
    rng = random.Random(0)
    out = {}
    for s in sessions:
        choice = choose_pool(ps, s, prompt, max_tokens, SEED, rng)
        assert isinstance(choice, PoolChoice)
        out[s] = choice.pool.name
    return out


def test_session_ratio_within_two_points_of_the_weights():
    names = list(assign(pools()).values())
    share = names.count("canary") / len(names)
    assert 0.18 <= share <= 0.22
    assert names.count("long") == 0  # the long-context pool takes only what the others cannot


def test_same_session_same_pool_on_every_call():
    first = assign(pools(), SESSIONS[:500])
    for _ in range(3):
        assert assign(pools(), SESSIONS[:500]) == first


def test_growing_canary_moves_sessions_only_into_it():
    before, after = assign(pools(20)), assign(pools(30))
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(before[s] == "stable" and after[s] == "canary" for s in moved)
    # expected share moved: 30/110 - 20/100 = 7.3%
    assert 0.06 <= len(moved) / len(SESSIONS) <= 0.085


def test_shrinking_canary_moves_sessions_only_out_of_it():
    before, after = assign(pools(30)), assign(pools(20))
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(before[s] == "canary" and after[s] == "stable" for s in moved)


def test_weight_zero_drains_the_canary():
    names = assign(pools(0), SESSIONS[:2000])
    assert set(names.values()) == {"stable"}


def test_other_pools_unaffected_by_a_third_pools_weight():
    three = [PoolSpec("a", "v1", 50), PoolSpec("b", "v1", 30), PoolSpec("c", "v1", 20)]
    grown = [PoolSpec("a", "v1", 50), PoolSpec("b", "v1", 30), PoolSpec("c", "v1", 40)]
    before, after = assign(three, SESSIONS[:3000]), assign(grown, SESSIONS[:3000])
    assert all(after[s] == before[s] or after[s] == "c" for s in before)


def test_without_session_the_injected_random_decides():
    ps = pools()
    rng1, rng2 = random.Random(42), random.Random(42)
    seq1 = [choose_pool(ps, None, 10, 10, SEED, rng1).pool.name for _ in range(10_000)]
    seq2 = [choose_pool(ps, None, 10, 10, SEED, rng2).pool.name for _ in range(10_000)]
    assert seq1 == seq2
    assert 0.18 <= seq1.count("canary") / len(seq1) <= 0.22


def test_long_request_goes_to_the_long_context_pool():
    ps = pools()
    fits = choose_pool(ps, "s", 3000, 1096, SEED, random.Random(0))
    assert fits.pool.name in {"stable", "canary"}  # 4096 exactly fits
    over = choose_pool(ps, "s", 3000, 1097, SEED, random.Random(0))
    assert over == PoolChoice(ps[2])


def test_over_every_limit_is_a_400_naming_the_limit():
    refusal = choose_pool(pools(), "s", 32000, 1000, SEED, random.Random(0))
    assert refusal == PoolRefusal(400, "context_length_exceeded",
                                  "prompt (32000 tokens) + max_tokens (1000) exceeds the largest pool "
                                  "context limit of 32768 tokens")


def test_without_long_context_pool_a_long_request_is_refused():
    ps = pools()[:2]
    refusal = choose_pool(ps, "s", 4000, 200, SEED, random.Random(0))
    assert isinstance(refusal, PoolRefusal) and refusal.status == 400 and "4096 tokens" in refusal.message


def test_admission_counts_the_pools_default_and_cap():
    ps = [PoolSpec("stable", "v1", 1, max_tokens_cap=512, default_max_tokens=256, max_context_tokens=4096),
          PoolSpec("long", "v1", 1, max_context_tokens=32768, long_context=True)]
    assert choose_pool(ps, "s", 3840, None, SEED, random.Random(0)).pool.name == "stable"  # 3840 + 256
    assert choose_pool(ps, "s", 3841, None, SEED, random.Random(0)).pool.name == "long"
    assert choose_pool(ps, "s", 3584, 9999, SEED, random.Random(0)).pool.name == "stable"  # capped to 512


def test_all_regular_weights_zero_is_a_503():
    ps = pools(0, 0)
    assert choose_pool(ps, "s", 10, 10, SEED, random.Random(0)).status == 503


def test_caps():
    pool = PoolSpec("p", "v", 1, max_tokens_cap=1024, default_max_tokens=256)
    assert apply_caps(pool, None) == (256, False)
    assert apply_caps(pool, 100) == (100, False)
    assert apply_caps(pool, 1024) == (1024, False)
    assert apply_caps(pool, 1025) == (1024, True)
    assert apply_caps(PoolSpec("p", "v", 1), None) == (None, False)
    assert apply_caps(PoolSpec("p", "v", 1), 10**6) == (10**6, False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(name=""), "name"), (dict(version=""), "version"), (dict(weight=-1), "weight"),
    (dict(weight=True), "weight"), (dict(weight=1.5), "weight"), (dict(max_tokens_cap=0), "max_tokens_cap"),
    (dict(default_max_tokens=0), "default_max_tokens"), (dict(max_context_tokens=-5), "max_context_tokens"),
    (dict(max_tokens_cap=10, default_max_tokens=20), "default_max_tokens"),
    (dict(max_context_tokens=100, default_max_tokens=100), "default_max_tokens"),
    (dict(long_context=1), "long_context"),
])
def test_invalid_pool_names_the_field(kwargs, field):
    args = dict(name="p", version="v", weight=1) | kwargs
    with pytest.raises(ConfigError) as e:
        PoolSpec(**args)
    assert e.value.field == field


def test_check_pools():
    check_pools(pools())
    with pytest.raises(ConfigError) as e:
        check_pools([PoolSpec("a", "v", 1), PoolSpec("a", "w", 1)])
    assert e.value.field == "name"
    with pytest.raises(ConfigError):
        check_pools([])
