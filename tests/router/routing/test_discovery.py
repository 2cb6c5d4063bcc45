"""Discovery: static list; DNS against a real UDP DNS server on loopback (dnspython resolver); Kubernetes
EndpointSlices → replica URLs on real `kubernetes` client model objects."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import httpx
from kubernetes.client import (
    DiscoveryV1EndpointPort,
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1ObjectMeta,
)

from router.routing.discovery import (
    DnsDiscovery,
    SliceTracker,
    StaticDiscovery,
    endpoint_slice_urls,
    make_resolver,
    replica_url,
)


class TinyDNS:
    """Answers A/AAAA queries from a dict it can change while running; unknown names get NXDOMAIN."""

    def __init__(self, records: dict[str, list[str]]):
        self.records = records
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop:
            try:
                data, addr = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            q = dns.message.from_wire(data)
            self.queries += 1
            resp = dns.message.make_response(q)
            question = q.question[0]
            name = question.name.to_text().rstrip(".")
            if name not in self.records:
                resp.set_rcode(dns.rcode.NXDOMAIN)
            else:
                want = "AAAA" if question.rdtype == dns.rdatatype.AAAA else "A"
                addrs = [a for a in self.records[name] if (":" in a) == (want == "AAAA")]
                if addrs:
                    resp.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", want, addrs))
            self.sock.sendto(resp.to_wire(), addr)

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def test_replica_url_brackets_ipv6():
    assert replica_url("http", "10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert replica_url("https", "fd00::7", 8000) == "https://[fd00::7]:8000"


def test_static_discovery_reports_its_list():
    got = []

    async def on_change(urls):
        got.append(urls)

    asyncio.run(StaticDiscovery(["http://a:1", "http://b:1"]).run(on_change))
    assert got == [["http://a:1", "http://b:1"]]


def test_dns_discovery_resolves_all_records_and_follows_changes():
    server = TinyDNS({"engine.kvfleet.svc.cluster.local": ["10.0.0.2", "10.0.0.1", "fd00::5"]})
    try:
        changes = []

        async def on_change(urls):
            changes.append(urls)

        async def scenario():
            resolver = make_resolver(f"127.0.0.1:{server.port}", timeout_s=1.0)
            d = DnsDiscovery("engine.kvfleet.svc.cluster.local", 8000, "http", 0.05, resolver)
            await d.refresh(on_change)
            await d.refresh(on_change)  # unchanged: no callback
            server.records["engine.kvfleet.svc.cluster.local"] = ["10.0.0.1", "10.0.0.3"]  # a pod replaced
            await d.refresh(on_change)
            del server.records["engine.kvfleet.svc.cluster.local"]  # service gone: authoritative empty
            await d.refresh(on_change)
            # the periodic loop picks a new pod up without a restart
            server.records["engine.kvfleet.svc.cluster.local"] = ["10.0.0.9"]
            task = asyncio.create_task(d.run(on_change))
            for _ in range(100):
                if changes[-1] == ["http://10.0.0.9:8000"]:
                    break
                await asyncio.sleep(0.02)
            task.cancel()

        asyncio.run(scenario())
        assert changes == [
            ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::5]:8000"],
            ["http://10.0.0.1:8000", "http://10.0.0.3:8000"],
            [],
            ["http://10.0.0.9:8000"],
        ]
    finally:
        server.close()


def test_dns_failure_keeps_the_last_list():
    # a nameserver that never answers: the lookup times out, which is not "no replicas"
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        async def scenario():
            resolver = make_resolver(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2)
            d = DnsDiscovery("engine.local", 8000, resolver=resolver)
            d.urls = ["http://10.0.0.1:8000"]
            assert await d.resolve() is None
            called = []
            await d.refresh(lambda urls: called.append(urls))
            return called, d.urls

        called, urls = asyncio.run(scenario())
        assert called == [] and urls == ["http://10.0.0.1:8000"]
    finally:
        silent.close()


def _slice(name, endpoints, ports=(("http", 8000),)):
    return V1EndpointSlice(
        address_type="IPv4", metadata=V1ObjectMeta(name=name, labels={"kubernetes.io/service-name": "engine"}),
        ports=[DiscoveryV1EndpointPort(name=n, port=p, protocol="TCP") for n, p in ports],
        endpoints=[V1Endpoint(addresses=addrs, conditions=None if cond is None else V1EndpointConditions(**cond))
                   for addrs, cond in endpoints])


def test_endpoint_slice_ready_endpoints_only():
    s = _slice("engine-abc", [
        (["10.1.0.1"], {"ready": True, "serving": True, "terminating": False}),
        (["10.1.0.2"], {"ready": False, "serving": False, "terminating": False}),  # starting up
        (["10.1.0.3"], {"ready": False, "serving": True, "terminating": True}),  # draining
        (["10.1.0.4"], None),  # conditions unset: ready per the API
        (["10.1.0.5"], {"ready": None}),
    ], ports=(("metrics", 9100), ("http", 8000)))
    assert endpoint_slice_urls(s, "http") == ["http://10.1.0.1:8000", "http://10.1.0.4:8000",
                                              "http://10.1.0.5:8000"]
    assert endpoint_slice_urls(s, None) == ["http://10.1.0.1:9100", "http://10.1.0.4:9100",
                                            "http://10.1.0.5:9100"]
    assert endpoint_slice_urls(s, "grpc") == []


def test_slice_tracker_follows_watch_events():
    t = SliceTracker("http", "http")
    t.reset([_slice("a", [(["10.0.0.1"], {"ready": True})]), _slice("b", [(["10.0.0.2"], {"ready": True})])])
    assert t.urls() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    t.apply("MODIFIED", _slice("a", [(["10.0.0.1"], {"ready": False}), (["10.0.0.7"], {"ready": True})]))
    assert t.urls() == ["http://10.0.0.2:8000", "http://10.0.0.7:8000"]
    t.apply("ADDED", _slice("c", [(["10.0.0.2"], {"ready": True})]))  # same pod in two slices: once
    t.apply("DELETED", _slice("b", []))
    assert t.urls() == ["http://10.0.0.2:8000", "http://10.0.0.7:8000"]
    t.apply("BOOKMARK", None)
    assert t.urls() == ["http://10.0.0.2:8000", "http://10.0.0.7:8000"]


def test_router_follows_dns_without_a_restart(procs):
    """A router process discovering fake engines on 127.0.0.1 and 127.0.0.2 (same port) through a DNS
    server: replicas join and leave as the records change."""
    from tests.router.conftest import fake_engine, free_port, router, wait_for

    port = free_port()
    one = fake_engine(procs, "one", port=port, host="127.0.0.1")
    two = fake_engine(procs, "two", port=port, host="127.0.0.2")
    name = "engine.kvfleet.svc.cluster.local"
    server = TinyDNS({name: ["127.0.0.1"]})
    try:
        r = router(procs, None, "--dns-name", name, "--dns-port", str(port), "--dns-interval", "0.2",
                   "--dns-nameserver", f"127.0.0.1:{server.port}", policy="round-robin")
        for p in (one, two, r):
            p.wait_ready()

        def served(n=6):
            return {httpx.post(r.url + "/v1/completions", json={"prompt": [1, 2]}, timeout=10).headers[
                "x-fake-instance"] for _ in range(n)}

        assert served() == {"one"}
        server.records[name] = ["127.0.0.1", "127.0.0.2"]
        wait_for(lambda: httpx.get(r.url + "/ready").json()["ready_replicas"] == 2, what="second replica joined")
        assert served() == {"one", "two"}
        server.records[name] = ["127.0.0.2"]
        wait_for(lambda: httpx.get(r.url + "/ready").json()["replicas"] == 1, what="first replica left")
        assert served() == {"two"}
    finally:
        server.close()


class FakeKubeAPI:
    """Just enough of the Kubernetes API for EndpointSlices: list (with resourceVersion) and watch (NDJSON
    events until timeoutSeconds), so the real `kubernetes` client and watch code run against it."""

    def __init__(self):
        import json as _json
        import queue
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        self.slices: dict[str, dict] = {}
        self.version = 1
        self.watchers: list[queue.Queue] = []
        self.lists = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                parts = urlsplit(self.path)
                q = parse_qs(parts.query)
                if not parts.path.endswith("/endpointslices"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if q.get("watch", ["false"])[0] == "true":
                    events: queue.Queue = queue.Queue()
                    api.watchers.append(events)
                    deadline = time.monotonic() + float(q.get("timeoutSeconds", ["5"])[0])
                    try:
                        while time.monotonic() < deadline:
                            try:
                                ev = events.get(timeout=0.05)
                            except queue.Empty:
                                continue
                            self.wfile.write(_json.dumps(ev).encode() + b"\n")
                            self.wfile.flush()
                    finally:
                        api.watchers.remove(events)
                    return
                api.lists += 1
                self.wfile.write(_json.dumps({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                              "metadata": {"resourceVersion": str(api.version)},
                                              "items": list(api.slices.values())}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def put(self, name: str, endpoints: list[tuple[str, bool]], notify: bool = True, deleted: bool = False):
        self.version += 1
        obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
               "metadata": {"name": name, "resourceVersion": str(self.version),
                            "labels": {"kubernetes.io/service-name": "engine"}},
               "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
               "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints]}
        kind = "DELETED" if deleted else "MODIFIED" if name in self.slices else "ADDED"
        if deleted:
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        if notify:
            for w in list(self.watchers):
                w.put({"type": kind, "object": obj})

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_k8s_discovery_lists_watches_and_resyncs():
    from kubernetes.client import ApiClient, Configuration, DiscoveryV1Api

    from router.routing.discovery import K8sDiscovery

    kube = FakeKubeAPI()
    kube.put("engine-a", [("10.0.0.1", True), ("10.0.0.2", False)])
    conf = Configuration(host=kube.url)
    api = DiscoveryV1Api(ApiClient(conf))
    changes: list[list[str]] = []

    async def scenario():
        async def on_change(urls):
            changes.append(urls)

        async def until(urls, what):
            for _ in range(200):
                if changes and changes[-1] == urls:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{what}: last {changes[-1:]}")

        d = K8sDiscovery("engine", "kvfleet", "http", "http", resync_s=1.0, api=api)
        task = asyncio.create_task(d.run(on_change))
        await until(["http://10.0.0.1:8000"], "initial list: ready endpoints only")
        for _ in range(100):
            if kube.watchers:
                break
            await asyncio.sleep(0.02)
        kube.put("engine-a", [("10.0.0.1", True), ("10.0.0.2", True)])
        await until(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "MODIFIED: pod became ready")
        kube.put("engine-b", [("10.0.0.3", True)])
        await until(["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"], "ADDED slice")
        kube.put("engine-a", [], deleted=True)
        await until(["http://10.0.0.3:8000"], "DELETED slice")
        kube.put("engine-b", [("10.0.0.4", True)], notify=False)  # a missed event: the periodic re-list heals it
        await until(["http://10.0.0.4:8000"], "resync")
        task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        kube.close()
    assert kube.lists >= 2
