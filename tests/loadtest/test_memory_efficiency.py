"""Smoke run of loadtest/memory_efficiency.py at a tiny size: it runs and prints its figures."""

from __future__ import annotations

import pytest

from loadtest import memory_efficiency


def test_memory_efficiency_script_prints_the_figures(capsys):
    assert memory_efficiency.main(["--requests", "40", "--pool-tokens", "4096", "--max-tokens", "256",
                                   "--max-model-len", "512", "--prompt-mean", "60", "--output-mean", "80"]) == 0
    text = capsys.readouterr().out
    for needle in ("paged, block 8", "paged, block 16", "paged, block 32", "target: block 16 uses",
                   "concurrency in a full pool of 4096 slots"):
        assert needle in text


def test_paged_waste_is_under_one_block_per_sequence():
    trace = memory_efficiency.make_trace(60, 3, 100, 100, 1.0, 256, 512)
    r = memory_efficiency.simulate(trace, 16, 2048, 512, 256, 2048)
    assert r.peak_used_blocks == 2048 // 16 and r.preemptions > 0
    # at most one partially filled block per running sequence
    assert r.min_used_at_peak >= 1 - r.peak_running * 16 / 2048
    assert r.used_at_peak > r.max_model_len_used_at_peak


def test_bad_sizes_are_rejected():
    with pytest.raises(SystemExit):
        memory_efficiency.main(["--requests", "0"])
    with pytest.raises(SystemExit):
        memory_efficiency.main(["--max-tokens", "4096", "--max-model-len", "2048"])
