"""The endpoints of an InferencePool (inference.networking.k8s.io/v1): the pods its `selector.matchLabels` selects
in its namespace, each `podIP:targetPort` its own endpoint (the data-parallel ranks of one pod are as many
endpoints as it has target ports). Only pods that are Ready, have an IP and are not being deleted count.

`pool_urls` is pure (plain dicts, as the Kubernetes API's JSON); `InferencePoolDiscovery` reads the pool and
lists + watches its pods in a thread (re-reading the pool at every resync), as K8sDiscovery does EndpointSlices.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping

from router.routing.discovery import replica_url

log = logging.getLogger("kvfleet.router.discovery")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def pool_selector(pool: Mapping) -> dict[str, str]:
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def pool_ports(pool: Mapping) -> list[int]:
    spec = pool.get("spec") or {}
    return [int(p["number"]) for p in spec.get("targetPorts") or [] if isinstance(p, Mapping) and "number" in p]


def pod_ready(pod: Mapping) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def selected(pod: Mapping, selector: Mapping[str, str]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pool_urls(pool: Mapping, pods: list[Mapping], scheme: str = "http") -> list[str]:
    """Every endpoint of the pool, sorted: podIP:port for each ready selected pod and each target port."""
    selector, ports = pool_selector(pool), pool_ports(pool)
    return sorted({replica_url(scheme, pod["status"]["podIP"], port) for pod in pods
                   if selected(pod, selector) and pod_ready(pod) for port in ports})


class PodTracker:
    """The pool's pods by name, updated by watch events. Pure."""

    def __init__(self) -> None:
        self.pods: dict[str, Mapping] = {}

    def reset(self, pods: list[Mapping]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}

    def apply(self, event_type: str, pod: Mapping) -> None:
        name = pod["metadata"]["name"]
        if event_type == "DELETED":
            self.pods.pop(name, None)
        elif event_type in ("ADDED", "MODIFIED"):
            self.pods[name] = pod


class InferencePoolDiscovery:
    def __init__(self, name: str, namespace: str, scheme: str, resync_s: float, api=None):
        self.name, self.namespace, self.scheme, self.resync_s = name, namespace, scheme, resync_s
        self.tracker = PodTracker()
        self.api = api  # (CustomObjectsApi, CoreV1Api, ApiClient), for tests
        self._stop = threading.Event()

    def _make_api(self):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.CustomObjectsApi(), client.CoreV1Api(), client.ApiClient()

    def _watch_loop(self, emit) -> None:
        from kubernetes import watch

        custom, core, api_client = self.api or self._make_api()
        while not self._stop.is_set():
            try:
                pool = custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
                selector = ",".join(f"{k}={v}" for k, v in sorted(pool_selector(pool).items()))
                listing = core.list_namespaced_pod(self.namespace, label_selector=selector)
                self.tracker.reset([api_client.sanitize_for_serialization(p) for p in listing.items])
                emit(pool_urls(pool, list(self.tracker.pods.values()), self.scheme))
                w = watch.Watch()
                for ev in w.stream(core.list_namespaced_pod, self.namespace, label_selector=selector,
                                   resource_version=listing.metadata.resource_version,
                                   timeout_seconds=int(self.resync_s)):
                    if self._stop.is_set():
                        w.stop()
                        break
                    self.tracker.apply(ev["type"], api_client.sanitize_for_serialization(ev["object"]))
                    emit(pool_urls(pool, list(self.tracker.pods.values()), self.scheme))
            except Exception as e:  # API errors, an absent pool, expired resource versions: re-read after a pause
                log.warning("InferencePool %s/%s: %s", self.namespace, self.name, e)
                self._stop.wait(2.0)

    async def run(self, on_change) -> None:
        loop = asyncio.get_running_loop()
        last: list[list[str] | None] = [None]

        def emit(urls: list[str]) -> None:
            if urls != last[0]:
                last[0] = urls
                asyncio.run_coroutine_threadsafe(on_change(urls), loop)

        thread = threading.Thread(target=self._watch_loop, args=(emit,), name="inferencepool-discovery", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()
