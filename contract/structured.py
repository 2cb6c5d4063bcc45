"""Which kind of constrained decoding a request body asks for, read alike by the engine and the router.

    constrained_kind(body) -> "json_schema" | "json_object" | "regex" | "choice" | "grammar" | "tools" | None

Tools count as "tools" whenever they are sent and tool_choice is not "none" (auto may answer in text;
required and named functions are constrained). Pure, stdlib only; the body is untrusted (any JSON).
"""

from __future__ import annotations

from collections.abc import Mapping

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")
_VLLM = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
         "guided_grammar": "grammar"}
_STRUCTURED = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}


def constrained_kind(body: Mapping) -> str | None:
    rf = body.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") in ("json_schema", "json_object"):
        return rf["type"]
    for field, kind in _VLLM.items():
        if body.get(field) is not None:
            return kind
    so = body.get("structured_outputs")
    if isinstance(so, Mapping):
        for field, kind in _STRUCTURED.items():
            if so.get(field) not in (None, False):
                return kind
    if isinstance(body.get("tools"), list) and body["tools"] and body.get("tool_choice") != "none":
        return "tools"
    return None
