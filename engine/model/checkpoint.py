"""Which safetensors files of a Hugging Face directory hold the model, and streaming their tensors.

A sharded checkpoint is read through `model.safetensors.index.json` (its `weight_map`: tensor name ->
shard file), never by globbing: Mistral-7B-v0.3 ships a `consolidated.safetensors` (the same weights under
other names) beside its shards. Without an index the directory must hold `model.safetensors` or exactly
one `*.safetensors` file. Tensors stream shard by shard (safe_open memory-maps one shard, each tensor is
read when it is copied into the model), so the state dict is never held whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from engine.model.registry import ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Shard:
    path: str
    names: tuple[str, ...] | None  # the tensors the index assigns to this file; None: every tensor in it


def checkpoint_shards(directory: str) -> list[Shard]:
    """The shards to read, in index order; a shard the index names but the directory lacks is an error."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        return _shards_from_index(directory, index)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [Shard(single, None)]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if len(files) == 1:
        return [Shard(os.path.join(directory, files[0]), None)]
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {directory}")
    raise ModelNotFoundError(f"{directory} holds several .safetensors files {files} but no {INDEX_FILE} saying "
                             f"which hold the model; expected a Hugging Face checkpoint ({SINGLE_FILE}, or shards "
                             f"listed by {INDEX_FILE})")


def _shards_from_index(directory: str, index: str) -> list[Shard]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map must be a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"{index} is not a safetensors index (a JSON object with weight_map): {e}") from e
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    shards = []
    for file, names in by_file.items():
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"shard {file!r} named by {index} ({len(names)} tensors, e.g. {names[0]!r}) "
                                     f"is missing: no file {path}")
        shards.append(Shard(path, tuple(names)))
    return shards


def iter_tensors(directory: str, device) -> Iterator[tuple[str, object]]:
    """(name, tensor) for every tensor of the checkpoint, one shard open at a time."""
    from safetensors import safe_open

    for shard in checkpoint_shards(directory):
        with safe_open(shard.path, framework="pt", device=str(device)) as f:
            present = set(f.keys())
            names = shard.names if shard.names is not None else sorted(present)
            missing = [n for n in names if n not in present]
            if missing:
                raise ModelNotFoundError(f"shard {shard.path} lacks {len(missing)} tensors that "
                                         f"{INDEX_FILE} assigns to it, e.g. {missing[:3]}")
            for name in names:
                yield name, f.get_tensor(name)
