"""Import layering, read from the source (ast): contract/ sits under engine/ and router/, which do not import
each other; serving/ (what both servers share) sits between contract/ and them; the folders inside engine/ import each other one way only; nothing in the product imports loadtest/.
And tests/ mirrors the folders of the repository.

Every import counts, including those inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "serving", "engine", "router", "deploy", "kvfleet")
CONTRACT_THIRD_PARTY = {"xxhash", "numpy"}
# The router loads the engines' own tokenizer (one tokenizer path): engine.tokenizer resolves model names
# through engine.model.registry, so it cannot move to contract/ (stdlib only) as it is.
ROUTER_MAY_IMPORT = {"engine.tokenizer"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module path imports (relative imports resolved)."""
    mod = _module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


GRAPH = _graph()


def _top(name: str) -> str:
    return name.split(".")[0]


def _offending(package: str, forbidden: set[str], allowed: set[str] = frozenset()) -> list[str]:
    return sorted(f"{mod} imports {name}" for mod, names in GRAPH.items() if _top(mod) == package
                  for name in names if _top(name) in forbidden and name not in allowed
                  and not any(name.startswith(a + ".") for a in allowed))


def test_every_package_was_read():
    assert {_top(m) for m in GRAPH} == set(PACKAGES)


def test_contract_imports_neither_engine_nor_router_and_only_the_stdlib():
    assert _offending("contract", {"engine", "router", "deploy", "loadtest"}) == []
    third_party = {_top(n) for m, names in GRAPH.items() if _top(m) == "contract" for n in names
                   if _top(n) not in sys.stdlib_module_names and _top(n) != "contract"}
    assert third_party <= CONTRACT_THIRD_PARTY


@pytest.mark.parametrize("package", PACKAGES)
def test_the_product_imports_nothing_from_loadtest(package):
    """loadtest/ (benchmarks, load tools, the fake engine) may import the product, never the other way round."""
    assert _offending(package, {"loadtest"}) == []


def test_serving_imports_only_the_contract():
    """The servers' shared utilities sit below engine/ and router/: neither they nor the command above them."""
    assert _offending("serving", {"engine", "router", "deploy", "kvfleet", "loadtest"}) == []


@pytest.mark.parametrize("package", ["engine", "router"])
def test_the_servers_do_not_import_the_command(package):
    """engine/ and router/ never import kvfleet/ (the command-line package above them)."""
    assert _offending(package, {"kvfleet"}) == []


def test_router_does_not_import_the_engine():
    assert _offending("router", {"engine"}, ROUTER_MAY_IMPORT) == []


def test_engine_does_not_import_the_router():
    assert _offending("engine", {"router", "deploy"}) == []


def _unit(package: str, name: str) -> str | None:
    """engine.kv.manager -> engine.kv (a folder); engine.sequence -> engine.sequence (a module at the top)."""
    parts = name.split(".")
    if parts[0] != package or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def _folder_graph(package: str) -> dict[str, set[str]]:
    units = {u for u in (_unit(package, m) for m in GRAPH) if u is not None}
    graph: dict[str, set[str]] = {}
    for mod, names in GRAPH.items():
        src = _unit(package, mod)
        if src is None:
            continue
        targets = {u for u in (_unit(package, n) for n in names) if u is not None and u != src and u in units}
        graph.setdefault(src, set()).update(targets)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_engine_folders_import_each_other_one_way_only():
    graph = _folder_graph("engine")
    assert {"engine.kv", "engine.server", "engine.model"} <= set(graph)
    assert _cycle(graph) is None


def test_router_folders_import_each_other_one_way_only():
    """http -> admission -> pools, tenants -> routing -> the modules at the top (config, states, metrics,
    refusal); router.main, the command, sits above them all."""
    graph = _folder_graph("router")
    assert {"router.http", "router.admission", "router.routing", "router.pools", "router.tenants"} <= set(graph)
    assert _cycle(graph) is None
    for low in ("router.config", "router.states", "router.refusal", "router.config_file"):
        assert not graph.get(low, set()) - {"router.states", "router.config", "router.config_file"}, low


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
])
def test_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle


def _test_folders() -> list[Path]:
    """Folders under tests/ that hold files, but data/ folders (test data) and caches."""
    tests = ROOT / "tests"
    return [d.relative_to(tests) for d in sorted(tests.rglob("*")) if d.is_dir()
            and not any(p == "data" or p == "__pycache__" or p.startswith(".") for p in d.relative_to(tests).parts)
            and any(f.is_file() for f in d.iterdir())]


def test_tests_mirror_the_packages():
    """tests/X/Y holds the tests of X/Y: every folder under tests/ names a folder of the repository."""
    folders = _test_folders()
    assert {Path("engine/kv"), Path("engine/server"), Path("kvfleet/bench")} <= set(folders)
    assert [f"tests/{f.as_posix()}" for f in folders if not (ROOT / f).is_dir()] == []
