"""Which adapter a request runs under: its name (the request's `model`), a number unique to this load of
it, and the directory it loads from. The front end hands one with every request; the core loads it lazily."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    name: str
    id: int  # unique per load: an adapter unloaded and loaded again under the same name gets a new one
    path: str


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}; (name, path)."""
    import json

    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{text!r} is not valid JSON: {e}") from None
        name, path = (obj.get("name"), obj.get("path")) if isinstance(obj, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{text!r} must be NAME=PATH (or {{\"name\": ..., \"path\": ...}})")
    return name.strip(), path.strip()
