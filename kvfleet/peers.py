"""Where benchmarks find what lives outside the repo: the peers (vLLM's CPU build and the converted model)
and the shared traces. Each location has an environment variable and a repo-relative default.

    KVFLEET_SHARED_DIR   the project's shared folder (default: ../shared beside the repo)
    KVFLEET_PEERS_DIR    where shared/peers/setup_vllm_cpu.sh and convert_gguf_to_hf.py put vLLM's venv
                         (vllm-venv/) and the Hugging Face copies of SmolLM2 (smollm2-hf/, smollm2-hf-bf16/)
                         (default: .peers/ in the repo, ignored by git), e.g.
                         VENV=.peers/vllm-venv bash ../shared/peers/setup_vllm_cpu.sh
                         python ../shared/peers/convert_gguf_to_hf.py --out32 .peers/smollm2-hf --out16 .peers/smollm2-hf-bf16
    KVFLEET_MOONCAKE_TRACE  the Mooncake conversation trace (default: SHARED/traces/mooncake_conversation_trace.jsonl)
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("KVFLEET_SHARED_DIR") or REPO.parent / "shared")


def peers_dir() -> Path:
    return Path(os.environ.get("KVFLEET_PEERS_DIR") or REPO / ".peers")


def mooncake_trace() -> Path:
    return Path(os.environ.get("KVFLEET_MOONCAKE_TRACE") or shared_dir() / "traces" / "mooncake_conversation_trace.jsonl")


def vllm_python(peers: Path) -> Path:
    return peers / "vllm-venv" / "bin" / "python"


def vllm_model_dir(peers: Path, dtype: str) -> Path:
    return peers / ("smollm2-hf" if dtype == "float32" else "smollm2-hf-bf16")
