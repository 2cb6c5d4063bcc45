"""The engine bounds oneDNN's shape-keyed caches (engine/onednn_caches.py): without that, every new batch size
grows a CPU engine's memory (found by the chaos soak, loadtest/chaos/soak.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.onednn_caches import DEFAULT_CAPACITY, VARIABLES, bound_onednn_caches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sets_both_capacities_where_unset():
    env: dict[str, str] = {}
    assert bound_onednn_caches(env=env) == {name: str(DEFAULT_CAPACITY) for name in VARIABLES}
    assert env == {"LRU_CACHE_CAPACITY": "256", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}


def test_a_value_the_user_set_wins():
    env = {"LRU_CACHE_CAPACITY": "1024"}
    assert bound_onednn_caches(64, env) == {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        bound_onednn_caches(0, {})


# SmolLM2-135M's projections (fused qkv, o, fused gate/up, down) through the engine's pre-packed oneDNN linear,
# at 160 distinct row counts: how much the process grew over the last 80 (MB)
_GROWTH = textwrap.dedent("""
    import sys, torch
    from engine.onednn_caches import bound_onednn_caches
    if sys.argv[1] == "bounded":
        bound_onednn_caches(16)
    from engine.model.cpu_linear import OneDnnLinear
    torch.set_num_threads(1)
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    shapes = [(576, 576 * 3), (576, 576), (576, 1536 * 2), (1536, 576)]
    lins = [OneDnnLinear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)) for k, n in shapes]
    for m in range(1, 161):
        if m == 81:
            half = rss_mb()
        for lin in lins:
            lin(torch.randn(m, lin.weight.shape[1], dtype=torch.bfloat16))
    print(rss_mb() - half)
""")


def _growth_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run([sys.executable, "-c", _GROWTH, mode], cwd=ROOT, env={**env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_new_batch_sizes_stop_growing_memory_once_the_caches_are_bounded():
    unbounded, bounded = _growth_mb("unbounded"), _growth_mb("bounded")
    # unbounded, every new row count keeps its primitives (about 0.6 MB each here); bounded, they are evicted
    assert unbounded > 40, f"the unbounded control grew only {unbounded:.1f} MB: the test no longer shows the leak"
    assert bounded < 12, f"grew {bounded:.1f} MB over 80 new batch sizes with the caches bounded at 16 entries"
