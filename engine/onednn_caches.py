"""Bounds on oneDNN's shape-keyed caches, so a CPU engine's memory stops growing.

On the CPU, torch's bf16 matmuls and the pre-packed projections (engine/model/cpu_linear.py) run through oneDNN,
which builds a primitive for every distinct input shape and keeps it in two caches of 1,024 entries each by
default: ideep's (`LRU_CACHE_CAPACITY`) and oneDNN's own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`). A serving engine
batches a different number of tokens at almost every step, so nearly every step brings new shapes, and each
entry holds about 0.6-1.5 MB at SmolLM2-135M's sizes (more for larger batches and models). Measured here: four
projections called at 1,000 distinct row counts grew a process from 0.25 to 3.0 GB; with both caches at 64
entries it stayed at 0.34 GB. The chaos soak saw the same as an engine's RSS rising through the run.

Both are read from the environment when the first oneDNN operation runs, so the engine sets them before it loads
a model. A value the user has set wins. A shape evicted from the cache costs a new primitive (about 0.5 ms per
projection shape) the next time it comes; the hot shapes (decode batches) stay cached.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_CAPACITY = 256
VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY,
                        env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set both cache capacities to `capacity` where the environment does not set them; the values in force."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    env = os.environ if env is None else env
    for name in VARIABLES:
        env.setdefault(name, str(capacity))
    return {name: env[name] for name in VARIABLES}
