"""router/epp/objectives.py: InferenceObjective priorities from the YAML the chart renders, and clear errors."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError
from router.epp.objectives import load_objectives, objectives_from


def _obj(name, priority=None):
    spec = {"poolRef": {"name": "chat"}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec}


def test_priorities_by_name_unset_is_zero_other_kinds_skipped():
    docs = [_obj("interactive", 10), _obj("batch", -5), _obj("default"), None, {"kind": "ConfigMap"}]
    assert objectives_from(docs) == {"interactive": 10, "batch": -5, "default": 0}


@pytest.mark.parametrize("docs, message", [
    ([_obj("a", "high")], "spec.priority must be an integer"),
    ([_obj("a", True)], "spec.priority must be an integer"),
    ([_obj("a"), _obj("a", 1)], "defined twice"),
    ([{"kind": "InferenceObjective", "metadata": {}}], "needs metadata.name"),
    (["text"], "not a mapping"),
])
def test_bad_objectives_are_refused_with_what_is_wrong(docs, message):
    with pytest.raises(ConfigError, match=message):
        objectives_from(docs)


def test_load_from_a_file(tmp_path):
    path = tmp_path / "objectives.yaml"
    path.write_text("kind: InferenceObjective\nmetadata: {name: chat}\nspec: {poolRef: {name: p}, priority: 3}\n"
                    "---\nkind: InferenceObjective\nmetadata: {name: bulk}\nspec: {poolRef: {name: p}}\n")
    assert load_objectives(str(path)) == {"chat": 3, "bulk": 0}
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_objectives(str(tmp_path / "missing.yaml"))
