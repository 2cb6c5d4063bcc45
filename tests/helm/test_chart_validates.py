"""Every manifest the chart renders, with default values and with each feature toggled, validates: built-in
kinds against Kubernetes' own schemas (kubernetes-validate, strict: unknown fields are errors) for the
chart's oldest and newest supported Kubernetes versions, custom resources against their projects' published
CRDs (data/crds/SOURCES.md). And `helm lint --strict` finds nothing but the missing icon."""

from __future__ import annotations

from functools import cache

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm import crd_schema
from tests.helm.chart import CHART, KUBE_VERSIONS, TOGGLES, render

CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "HTTPRoute", "InferencePool", "InferenceObjective"}


@cache
def rendered(toggle: str):
    return render(TOGGLES[toggle])


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_every_builtin_manifest_validates_against_kubernetes_schemas(toggle):
    r = rendered(toggle)
    assert r.manifests
    problems = []
    for m in r.manifests:
        if m["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(m, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{version} {m['kind']}/{m['metadata']['name']}: {e.message} at "
                                f"{'.'.join(map(str, e.path))}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_every_custom_resource_validates_against_its_published_crd(toggle):
    problems = []
    for m in rendered(toggle).manifests:
        if m["kind"] in CUSTOM_KINDS:
            problems += [f"{m['kind']}/{m['metadata']['name']}: {e}" for e in crd_schema.errors(m)]
    assert not problems, "\n".join(problems)


def test_the_toggles_render_every_custom_kind():
    seen = {m["kind"] for t in TOGGLES for m in rendered(t).manifests}
    assert CUSTOM_KINDS <= seen
    assert {(m["apiVersion"], m["kind"]) for t in TOGGLES for m in rendered(t).manifests
            if m["kind"] in CUSTOM_KINDS} <= crd_schema.kinds()


def test_crd_validation_catches_a_misspelt_field_and_a_wrong_type():
    """The CRD check is not vacuous: strict on unknown fields, typed."""
    sm = next(m for m in rendered("monitoring").manifests if m["kind"] == "ServiceMonitor")
    bad = {**sm, "spec": {**sm["spec"], "endpoint": sm["spec"]["endpoints"]}}
    assert any("endpoint" in e for e in crd_schema.errors(bad))
    so = next(m for m in rendered("keda").manifests if m["kind"] == "ScaledObject")
    bad = {**so, "spec": {**so["spec"], "minReplicaCount": "one"}}
    assert any(e.startswith("spec.minReplicaCount") for e in crd_schema.errors(bad))


def test_kubernetes_validation_catches_a_misspelt_field():
    dep = next(m for m in rendered("default").manifests if m["kind"] == "Deployment")
    bad = {**dep, "spec": {**dep["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)


@pytest.mark.parametrize("toggle", ["default", "hpa", "keda", "monitoring", "httproute", "inferencepool"])
def test_helm_lint_strict_is_clean(toggle):
    for version in KUBE_VERSIONS:
        report = helm.lint(str(CHART), TOGGLES[toggle], strict=True, kube_version=f"v{version}.0")
        # the one info finding allowed: the chart has no icon (there is no kvfleet logo to point at)
        findings = [m for m in report["messages"] if m["severity"] >= 1 and m["error"] != "icon is recommended"]
        assert not findings and not report["errors"], (version, findings, report["errors"])
