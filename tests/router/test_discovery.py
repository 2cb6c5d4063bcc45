"""Discovery: static list; DNS against a real UDP DNS server on loopback (dnspython resolver); Kubernetes
EndpointSlices → replica URLs on real `kubernetes` client model objects."""

from __future__ import annotations

import asyncio
import socket
import threading

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

from router.discovery import (
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
    t.apply("BOOKMARK", _slice("c", []))
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
