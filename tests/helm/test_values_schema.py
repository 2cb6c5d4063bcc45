"""values.schema.json refuses bad values at install, with a message naming the field and what was wrong."""

from __future__ import annotations

import helm_python as helm
import pytest
import yaml

from tests.helm.chart import CHART, TOGGLES, render

BAD = [
    ({"pools": {"stable": {"weight": -1}}}, "/pools/stable/weight", "minimum: got -1, want 0"),
    ({"pools": {"stable": {"wieght": 3}}}, "/pools/stable", "additional properties 'wieght' not allowed"),
    ({"pools": {"Stable_1": {}}}, "", "'Stable_1' does not match pattern"),
    ({"pools": {"stable": {"version": 2}}}, "/pools/stable/version", "got number, want string"),
    ({"engineDefaults": {"modelSource": {"type": "s3"}}}, "/engineDefaults/modelSource/type",
     "value must be one of 'bundled', 'pvc', 'hostPath', 'download'"),
    ({"engineDefaults": {"autoscaling": {"minReplicas": 0}}}, "/engineDefaults/autoscaling/minReplicas",
     "minimum: got 0, want 1"),
    ({"engineDefaults": {"autoscaling": {"targetKvCacheUsage": 80}}},
     "/engineDefaults/autoscaling/targetKvCacheUsage", "maximum: got 80, want 1"),
    ({"engineDefaults": {"resources": {"requests": {"memory": "lots"}}}},
     "/engineDefaults/resources/requests/memory", "'lots' does not match pattern"),
    ({"engineDefaults": {"drainTimeoutSeconds": "30s"}}, "/engineDefaults/drainTimeoutSeconds",
     "got string, want integer"),
    ({"router": {"replicas": 1}}, "/router/replicas", "minimum: got 1, want 2"),
    ({"router": {"policy": "random"}}, "/router/policy", "value must be one of 'kv'"),
    ({"router": {"discovery": "consul"}}, "/router/discovery", "value must be one of 'k8s', 'dns'"),
    ({"router": {"modelSource": {"type": "download"}}}, "/router/modelSource/type",
     "value must be one of 'bundled', 'pvc', 'hostPath'"),
    ({"autoscaling": {"mode": "vpa"}}, "/autoscaling/mode", "value must be one of 'hpa', 'keda'"),
    ({"autoscaling": {"keda": {"prometheusServer": "prometheus:9090"}}}, "/autoscaling/keda/prometheusServer",
     "'prometheus:9090' does not match pattern '^https?://'"),
    ({"redis": {"external": {"url": "localhost:6379"}}}, "/redis/external/url", "'localhost:6379' does not match pattern"),
    ({"monitoring": {"serviceMonitors": {"interval": "often"}}}, "/monitoring/serviceMonitors/interval",
     "'often' does not match pattern"),
    ({"hashSeed": -5}, "/hashSeed", "minimum: got -5, want 0"),
    ({"replicas": 3}, "", "additional properties 'replicas' not allowed"),
]


@pytest.mark.parametrize("values,where,problem", BAD, ids=[b[1] or str(b[0]) for b in BAD])
def test_bad_values_fail_naming_the_field(values, where, problem):
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert f"at '{where}': {problem}" in str(e.value)


def test_defaults_and_every_toggle_pass_the_schema():
    with helm.Chart.load(str(CHART)) as c:
        for values in TOGGLES.values():
            c.validate_schema(values)


def test_every_default_value_is_described_by_the_schema():
    """additionalProperties: false everywhere means a key added to values.yaml but not to the schema fails
    here, before a user meets it."""
    with helm.Chart.load(str(CHART)) as c:
        c.validate_schema(yaml.safe_load((CHART / "values.yaml").read_text()))
