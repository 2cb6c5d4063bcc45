"""InferenceObjectives (llm-d-router's apix/v1alpha2): a name a request carries in `x-llm-d-inference-objective`
and the priority it gets (`spec.priority`, higher first, default 0). Read from a YAML file of InferenceObjective
objects (one per document, as the chart renders them), checked once at start-up; pure."""

from __future__ import annotations

from collections.abc import Iterable

import yaml

from contract.errors import ConfigError

KIND = "InferenceObjective"


def objectives_from(docs: Iterable[object], where: str = "objectives") -> dict[str, int]:
    """name -> priority of every InferenceObjective among `docs` (other kinds and empty documents are skipped)."""
    out: dict[str, int] = {}
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ConfigError(where, f"document {i} is not a mapping")
        if doc.get("kind") != KIND:
            continue
        meta, spec = doc.get("metadata"), doc.get("spec")
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            raise ConfigError(where, f"document {i}: an InferenceObjective needs metadata.name")
        priority = (spec or {}).get("priority", 0) if isinstance(spec, dict) or spec is None else None
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ConfigError(where, f"InferenceObjective {name}: spec.priority must be an integer, got {priority!r}")
        if name in out:
            raise ConfigError(where, f"InferenceObjective {name} is defined twice")
        out[name] = priority
    return out


def load_objectives(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            docs = list(yaml.safe_load_all(f))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("objectives", f"{path}: {e}") from None
    return objectives_from(docs, f"objectives ({path})")
