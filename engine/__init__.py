"""kvfleet's paged-KV engine."""

import os

# OpenMP workers (libgomp, torch's CPU thread pool) spin-wait ~300k iterations between parallel regions by
# default. When cores are shared (replicas, routers and clients on one machine) spinning workers starve each
# other and every step gets 3-20x slower; spinning briefly, then sleeping, costs a few microseconds per region
# on an idle machine. Set here, before anything imports torch; an explicit setting in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
os.environ.setdefault("KMP_BLOCKTIME", "1")

from engine.sampling_params import SamplingParams

__all__ = ["SamplingParams", "LLM"]


def __getattr__(name: str):  # LLM pulls in torch and the model code; load it on first use
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
