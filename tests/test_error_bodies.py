"""OpenAI error bodies are built in one place, contract/errors.py (`error_body`, `error_type`): no module outside
contract/ writes `{"error": {...}}` by hand, as a dict literal, as `dict(error={...})`, or as JSON text in a string
or bytes constant. Read from the source (ast); tests may spell bodies out to compare with."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "router", "deploy", "kvfleet", "loadtest", "dashboards")
JSON_ERROR = re.compile(rb"""["']error["']\s*:\s*\{""")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def hand_built(source: str, name: str = "<source>") -> list[str]:
    """`name:line` of every error body built by hand in this source."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            hit = any(isinstance(k, ast.Constant) and k.value == "error" and isinstance(v, (ast.Dict, ast.Call))
                      and (isinstance(v, ast.Dict) or getattr(v.func, "id", None) == "dict")
                      for k, v in zip(node.keys, node.values, strict=True))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
            hit = any(k.arg == "error" and isinstance(k.value, ast.Dict) for k in node.keywords)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docs:
            raw = node.value.encode() if isinstance(node.value, str) else node.value
            hit = bool(JSON_ERROR.search(raw))
        else:
            continue
        if hit:
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_module_outside_contract_builds_an_error_body_by_hand():
    found = [hit for pkg in SCANNED for path in sorted((ROOT / pkg).rglob("*.py"))
             for hit in hand_built(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "build OpenAI error bodies with contract.errors.error_body / error_type"


@pytest.mark.parametrize("source", [
    'body = {"error": {"message": "m", "type": "t", "code": 404}}',
    'body = {"error": dict(message="m")}',
    'body = dict(error={"message": "m"})',
    '''body = b'{"error":{"message":"%s"}}' % m''',
    '''body = '{"error": {"message": "m"}}\'''',
])
def test_the_check_finds_a_hand_built_body(source):
    assert hand_built(source) == ["<source>:1"]


@pytest.mark.parametrize("source", [
    'body = error_body("m", error_type(404))',
    'row = {"error": f"{type(e).__name__}: {e}"}',  # a result row's error text, not an OpenAI body
    'health = {"status": "engine_dead", "error": str(dead)}',
    '"""The body: {"error": {"message": str, ...}}"""',  # a docstring may show the shape
])
def test_the_check_leaves_other_uses_of_error_alone(source):
    assert hand_built(source) == []
