"""What a request constrains its output to, as a small frozen value: the grammar cache's key.

    Guide.json_schema(schema) | Guide.json_object() | Guide.regex(pattern) | Guide.choice(options)
    | Guide.grammar(ebnf)
    guide.key            # (kind, text): the cache key; the same schema sent again hits the compiled grammar
    guide.param          # the request field to blame when it cannot be compiled (set by the HTTP edge)

Pure: no I/O, no grammar library. A schema's text is its compact JSON with keys in the order given (not
sorted: the order of "properties" decides the order of keys in the answer, so it is part of the grammar).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


class GuideKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Guide:
    kind: GuideKind
    text: str  # the schema as canonical JSON, the regex, the choices as a JSON list, or the EBNF grammar
    param: str = field(default="response_format", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind.value, self.text

    @classmethod
    def json_schema(cls, schema: dict, param: str = "response_format.json_schema.schema") -> Guide:
        return cls(GuideKind.JSON_SCHEMA, canonical_json(schema), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Guide:
        return cls(GuideKind.JSON_OBJECT, "", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "guided_regex") -> Guide:
        return cls(GuideKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> Guide:
        return cls(GuideKind.CHOICE, json.dumps(list(options), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, ebnf: str, param: str = "guided_grammar") -> Guide:
        return cls(GuideKind.GRAMMAR, ebnf, param)

    def schema(self) -> dict:
        return json.loads(self.text)

    def choices(self) -> list[str]:
        return json.loads(self.text)


def canonical_json(value: object) -> str:
    """Compact JSON with keys in their given order (property order matters to the answer's shape)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
