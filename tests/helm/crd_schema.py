"""Validate custom resources against the CRDs vendored under tests/helm/data/crds/ (sources in data/crds/SOURCES.md).

A CRD's `openAPIV3Schema` is OpenAPI, not quite JSON Schema: `to_json_schema` turns `nullable` and
`x-kubernetes-int-or-string` into JSON Schema and, like the API server's strict field validation (what
`kubectl apply` uses by default), rejects fields the schema does not declare, except under
`x-kubernetes-preserve-unknown-fields`. CEL rules (`x-kubernetes-validations`) are not evaluated.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "data" / "crds"


def to_json_schema(node):
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def _validators() -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    """(apiVersion, kind) -> validator, for every served version of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = to_json_schema(version["schema"]["openAPIV3Schema"])
                props = schema.setdefault("properties", {})
                props["metadata"] = {"type": "object"}  # checked by the API server, not by the CRD schema
                out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = \
                    jsonschema.Draft202012Validator(schema)
    return out


def kinds() -> set[tuple[str, str]]:
    return set(_validators())


def errors(resource: dict) -> list[str]:
    """Readable validation errors of one custom resource (empty when valid); KeyError for a kind not vendored."""
    validator = _validators()[(resource["apiVersion"], resource["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(resource), key=lambda e: list(map(str, e.absolute_path)))]
