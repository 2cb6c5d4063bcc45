"""kvfleet's paged-KV engine."""

from engine.sampling_params import SamplingParams

__all__ = ["SamplingParams", "LLM"]


def __getattr__(name: str):  # LLM pulls in torch and the model code; load it on first use
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
