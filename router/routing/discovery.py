"""Where the replicas are: a static list, the A records of a headless Service (re-resolved periodically), or
the Kubernetes API (EndpointSlices of a Service, ready endpoints only; list + watch, with periodic resync; or an
InferencePool's pods, router/routing/pool_pods.py).

Each source runs as `await source.run(on_change)` and calls `await on_change(urls)` with the full current list
whenever it changes. Transient lookup failures keep the last known list (no flapping); an authoritative
"no such name / no endpoints" empties it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from dataclasses import dataclass

from contract.errors import ConfigError
from router.config import RouterConfig

log = logging.getLogger("kvfleet.router.discovery")


@dataclass(frozen=True)
class StaticSource:
    urls: tuple[str, ...]


@dataclass(frozen=True)
class DnsSource:
    name: str
    port: int = 8000


@dataclass(frozen=True)
class K8sSource:
    service: str
    namespace: str | None = None  # None: the router's own (--k8s-namespace)
    port_name: str | None = None  # None: the EndpointSlice's first port


@dataclass(frozen=True)
class InferencePoolSource:
    name: str  # an InferencePool (inference.networking.k8s.io/v1): its selected pods x its target ports
    namespace: str | None = None


Source = StaticSource | DnsSource | K8sSource | InferencePoolSource


def flag_source(cfg: RouterConfig) -> Source:
    """The discovery source the command-line flags describe (the one pool of a router without --pools)."""
    if cfg.discovery == "dns":
        if not cfg.dns_name:  # RouterConfig refuses this already
            raise ConfigError("dns_name", "dns discovery needs the headless Service name")
        return DnsSource(cfg.dns_name, cfg.dns_port)
    if cfg.discovery == "k8s":
        if not cfg.k8s_service:  # RouterConfig refuses this already
            raise ConfigError("k8s_service", "k8s discovery needs the Service name")
        return K8sSource(cfg.k8s_service, cfg.k8s_namespace, cfg.k8s_port_name)
    if cfg.discovery == "inference-pool":
        if not cfg.inference_pool:  # RouterConfig refuses this already
            raise ConfigError("inference_pool", "inference-pool discovery needs the InferencePool's name")
        return InferencePoolSource(cfg.inference_pool, cfg.k8s_namespace)
    return StaticSource(tuple(cfg.replicas))


def replica_url(scheme: str, host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{scheme}://{host}:{port}"


class StaticDiscovery:
    def __init__(self, urls):
        self.urls = list(urls)

    async def run(self, on_change) -> None:
        await on_change(self.urls)


# -- DNS -----------------------------------------------------------------------------------------------------
def make_resolver(nameserver: str | None = None, timeout_s: float = 2.0):
    import dns.asyncresolver

    if nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, _, port = nameserver.rpartition(":") if nameserver.count(":") == 1 else (nameserver, "", "")
        resolver.nameservers = [host]
        if port:
            resolver.port = int(port)
    resolver.lifetime = timeout_s
    resolver.timeout = timeout_s
    return resolver


class DnsDiscovery:
    """All A (and AAAA) records of a headless Service name → http://ip:port, re-resolved every interval."""

    def __init__(self, name: str, port: int, scheme: str = "http", interval_s: float = 5.0, resolver=None):
        self.name, self.port, self.scheme, self.interval_s = name, port, scheme, interval_s
        self.resolver = resolver or make_resolver()
        self.urls: list[str] | None = None

    async def resolve(self) -> list[str] | None:
        """The current URLs, sorted; None when the lookup failed transiently (keep the last list)."""
        import dns.exception
        import dns.resolver

        addresses: list[str] = []
        authoritative_empty = 0
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.name, rdtype, search=True)
                addresses.extend(r.address for r in answer)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                authoritative_empty += 1
            except (dns.resolver.NoNameservers, dns.exception.Timeout, OSError) as e:
                log.warning("DNS lookup of %s (%s) failed: %s", self.name, rdtype, e)
                if rdtype == "A":
                    return None
        if not addresses and authoritative_empty < 2:
            return None
        return sorted(replica_url(self.scheme, a, self.port) for a in set(addresses))

    async def refresh(self, on_change) -> None:
        urls = await self.resolve()
        if urls is not None and urls != self.urls:
            log.info("DNS %s → %s", self.name, urls)
            self.urls = urls
            await on_change(urls)

    async def run(self, on_change) -> None:
        while True:
            await self.refresh(on_change)
            await asyncio.sleep(self.interval_s)


# -- Kubernetes EndpointSlices -------------------------------------------------------------------------------
def endpoint_slice_urls(endpoint_slice, port_name: str | None = None, scheme: str = "http") -> list[str]:
    """URLs of the ready endpoints of one EndpointSlice (a `kubernetes.client.V1EndpointSlice`).

    Readiness follows the API's rule: `conditions.ready` unset means ready; terminating endpoints report
    ready=false. The port is the one named `port_name`, or the slice's first port."""
    ports = endpoint_slice.ports or []
    port = None
    for p in ports:
        if port_name is None or p.name == port_name:
            port = p.port
            break
    if port is None:
        return []
    urls = []
    for ep in endpoint_slice.endpoints or []:
        cond = ep.conditions
        if cond is not None and cond.ready is False:
            continue
        if cond is not None and cond.terminating is True and cond.ready is not True:
            continue
        for addr in ep.addresses or []:
            urls.append(replica_url(scheme, addr, port))
    return urls


class SliceTracker:
    """The union of ready endpoints over a Service's EndpointSlices, updated by watch events. Pure."""

    def __init__(self, port_name: str | None, scheme: str):
        self.port_name, self.scheme = port_name, scheme
        self.slices: dict[str, list[str]] = {}

    def reset(self, slices) -> None:
        self.slices = {s.metadata.name: endpoint_slice_urls(s, self.port_name, self.scheme) for s in slices}

    def apply(self, event_type: str, endpoint_slice) -> None:
        """ADDED / MODIFIED / DELETED change one slice; anything else (BOOKMARK) changes nothing."""
        if event_type == "DELETED":
            self.slices.pop(endpoint_slice.metadata.name, None)
        elif event_type in ("ADDED", "MODIFIED"):
            self.slices[endpoint_slice.metadata.name] = endpoint_slice_urls(endpoint_slice, self.port_name,
                                                                            self.scheme)

    def urls(self) -> list[str]:
        return sorted({u for urls in self.slices.values() for u in urls})


class K8sDiscovery:
    """List + watch the Service's EndpointSlices (label kubernetes.io/service-name) in a thread; re-list every
    `resync_s` (the watch's timeout) and after any watch error."""

    def __init__(self, service: str, namespace: str, port_name: str | None, scheme: str, resync_s: float,
                 api=None):
        self.service, self.namespace, self.resync_s = service, namespace, resync_s
        self.tracker = SliceTracker(port_name, scheme)
        self.api = api
        self._stop = threading.Event()

    def _make_api(self):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.DiscoveryV1Api()

    def _watch_loop(self, emit) -> None:
        from kubernetes import watch

        api = self.api or self._make_api()
        selector = f"kubernetes.io/service-name={self.service}"
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                self.tracker.reset(listing.items)
                emit(self.tracker.urls())
                w = watch.Watch()
                for ev in w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                   resource_version=listing.metadata.resource_version,
                                   timeout_seconds=int(self.resync_s)):
                    if self._stop.is_set():
                        w.stop()
                        break
                    self.tracker.apply(ev["type"], ev["object"])
                    emit(self.tracker.urls())
            except Exception as e:  # API errors, expired resource versions, network: re-list after a pause
                log.warning("EndpointSlice watch of %s/%s: %s", self.namespace, self.service, e)
                self._stop.wait(2.0)

    async def run(self, on_change) -> None:
        loop = asyncio.get_running_loop()
        last: list[list[str] | None] = [None]

        def emit(urls: list[str]) -> None:
            if urls != last[0]:
                last[0] = urls
                asyncio.run_coroutine_threadsafe(on_change(urls), loop)

        thread = threading.Thread(target=self._watch_loop, args=(emit,), name="k8s-discovery", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()


def make_discovery(cfg: RouterConfig, source: Source):
    """The discovery that runs `source`, with the router's scheme, intervals and resolver."""
    if isinstance(source, DnsSource):
        return DnsDiscovery(source.name, source.port, cfg.scheme, cfg.dns_interval_s,
                            make_resolver(cfg.dns_nameserver))
    if isinstance(source, K8sSource):
        return K8sDiscovery(source.service, source.namespace or cfg.k8s_namespace, source.port_name, cfg.scheme,
                            cfg.k8s_resync_s)
    if isinstance(source, InferencePoolSource):
        from router.routing.pool_pods import InferencePoolDiscovery

        return InferencePoolDiscovery(source.name, source.namespace or cfg.k8s_namespace, cfg.scheme, cfg.k8s_resync_s)
    return StaticDiscovery(source.urls)
