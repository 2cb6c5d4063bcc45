"""Bounded JSON Schemas for the structured-output tests: objects, arrays, enums, nesting, string patterns and
numbers with bounds, each small enough (maxItems, maxLength, few properties) to finish well inside max_tokens."""

from __future__ import annotations

import random

_LEAVES = [
    {"type": "string", "maxLength": 12},
    {"type": "string", "pattern": "^[a-z]{2,6}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
    {"type": "integer", "minimum": -5, "maximum": 99},
    {"type": "integer", "minimum": 0, "maximum": 3},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "enum": ["cat", "dog"]},
    {"type": "null"},
]


def _value(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth < 2 and r < 0.2:
        return _object(rng, depth + 1)
    if depth < 2 and r < 0.35:
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return dict(rng.choice(_LEAVES))


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "kind", "size", "tags", "color", "ok", "score", "code", "meta"], rng.randint(1, 4))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schema(seed: int) -> dict:
    rng = random.Random(seed)
    if rng.random() < 0.15:
        return {"type": "array", "items": _object(rng, 1), "minItems": 1, "maxItems": 2}
    return _object(rng, 0)
