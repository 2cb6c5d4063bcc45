"""Sessions generated to a `kvfleet profile --json` shape (kvfleet/sim/workload.py from_profile)."""

from __future__ import annotations

import statistics

import pytest

from kvfleet.sim.workload import PROFILE_MAX_TURNS, from_profile


def profile(follow_up=0.75, shared=1.0, mean=1200.0, p50=1000.0, out=40.0, max_prompt=8000):
    return {"prompt_tokens": {"p50": p50, "mean": mean, "max": max_prompt}, "output_tokens": {"mean": out},
            "follow_up_share": follow_up, "shared_prefix_share": shared}


def test_sessions_have_the_profiles_turns_output_mean_prompt_and_rate():
    wl = from_profile(profile(), 2000, 4.0, seed=1)
    turns = [t for s in wl.sessions for t in s.turns]
    assert {len(s.turns) for s in wl.sessions} == {4}  # 1 / (1 - 0.75): three follow-ups to each first turn
    assert len(wl.sessions) == 500 and len(turns) == 2000
    assert {t.output_tokens for t in turns} == {40}
    assert statistics.mean(t.prompt_tokens for t in turns) == pytest.approx(1200, rel=0.1)
    span = max(s.start_s for s in wl.sessions)
    assert len(wl.sessions) / span == pytest.approx(1.0, rel=0.15)  # 4 requests/s in sessions of 4
    # turn k+1 resends turn k: its leading blocks are turn k's
    s = wl.sessions[0]
    assert s.turns[1].block_hashes[:len(s.turns[0].block_hashes)] == s.turns[0].block_hashes


def test_a_shared_prefix_share_below_half_gives_each_session_its_own_system_prompt():
    shared = from_profile(profile(follow_up=0.0, shared=0.9), 200, 1.0)
    own = from_profile(profile(follow_up=0.0, shared=0.1), 200, 1.0)
    first = [s.turns[0].block_hashes[0] for s in shared.sessions]
    assert len(set(first)) == 2
    assert len({s.turns[0].block_hashes[0] for s in own.sessions}) > 150
    assert {len(s.turns) for s in own.sessions} == {1}


def test_all_follow_ups_are_capped_and_a_bad_profile_is_named():
    assert {len(s.turns) for s in from_profile(profile(follow_up=1.0), 64, 1.0).sessions} == {PROFILE_MAX_TURNS}
    with pytest.raises(ValueError, match="missing or bad 'output_tokens'"):
        from_profile({"prompt_tokens": {"p50": 1, "mean": 1, "max": 1}, "follow_up_share": 0,
                      "shared_prefix_share": 0}, 10, 1.0)
    with pytest.raises(ValueError, match="shares within"):
        from_profile(profile(follow_up=1.5), 10, 1.0)
