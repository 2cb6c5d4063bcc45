"""router/routing/pool_pods.py: an InferencePool's endpoints from its pods, exactly (pure; no API server here)."""

from __future__ import annotations

from router.routing.pool_pods import PodTracker, pool_urls

POOL = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "chat"},
        "spec": {"selector": {"matchLabels": {"app": "kvfleet-engine", "pool": "chat"}},
                 "targetPorts": [{"number": 8000}, {"number": 8001}]}}


def pod(name: str, ip: str | None, ready: bool = True, labels: dict | None = None, phase: str = "Running",
        deleting: bool = False) -> dict:
    meta = {"name": name, "labels": labels if labels is not None else {"app": "kvfleet-engine", "pool": "chat"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T10:00:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_every_target_port_of_every_ready_selected_pod_is_an_endpoint():
    pods = [pod("a", "10.0.0.2"), pod("b", "10.0.0.1"), pod("not-ready", "10.0.0.3", ready=False),
            pod("other", "10.0.0.4", labels={"app": "kvfleet-engine", "pool": "code"}),
            pod("no-ip", None), pod("pending", "10.0.0.5", phase="Pending"), pod("gone", "10.0.0.6", deleting=True)]
    assert pool_urls(POOL, pods) == ["http://10.0.0.1:8000", "http://10.0.0.1:8001",
                                     "http://10.0.0.2:8000", "http://10.0.0.2:8001"]


def test_ipv6_pods_and_a_pool_without_selector_labels():
    assert pool_urls(POOL, [pod("a", "fd00::1")]) == ["http://[fd00::1]:8000", "http://[fd00::1]:8001"]
    no_selector = {"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}}
    assert pool_urls(no_selector, [pod("a", "10.0.0.1")]) == []  # selects nothing rather than everything


def test_watch_events_change_the_tracked_pods():
    t = PodTracker()
    t.reset([pod("a", "10.0.0.1")])
    t.apply("ADDED", pod("b", "10.0.0.2"))
    t.apply("MODIFIED", pod("a", "10.0.0.1", ready=False))
    t.apply("BOOKMARK", pod("c", "10.0.0.3"))
    assert pool_urls(POOL, list(t.pods.values())) == ["http://10.0.0.2:8000", "http://10.0.0.2:8001"]
    t.apply("DELETED", pod("b", "10.0.0.2"))
    assert pool_urls(POOL, list(t.pods.values())) == []
