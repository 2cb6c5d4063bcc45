"""The pools file: what it parses to, and errors that name the file, the line and the field."""

from __future__ import annotations

import textwrap

import pytest

from router.config_file import ConfigFileError
from router.pools.choice import PoolSpec
from router.pools.degradation import DegradationConfig
from router.pools.file import DegradationSettings, PoolsFile, parse_pools
from router.routing.discovery import DnsSource, K8sSource, StaticSource

GOOD = textwrap.dedent("""\
    pools:
      stable:
        version: v1
        weight: 80
        replicas: [http://127.0.0.1:8001, "http://127.0.0.1:8002/"]
        max_tokens_cap: 1024
        default_max_tokens: 256
        max_context_tokens: 4096
      canary:
        version: 2
        weight: 20
        canary: true
        k8s: {service: engine-canary, port_name: http}
      long:
        version: "1.10"
        weight: 1
        long_context: true
        max_context_tokens: 32768
        dns: {name: engine-long.ns.svc.cluster.local, port: 8080}
    degradation:
      window_s: 10
      min_requests: 5
      dwell_s: 20
      p99_ttft_s: {trip: 3, clear: 1.5}
      error_rate: {trip: 0.1}
    """)


def test_a_good_file():
    cfg = parse_pools(GOOD, "pools.yaml")
    stable, canary, long = cfg.pools
    assert stable.spec == PoolSpec("stable", "v1", 80, max_tokens_cap=1024, default_max_tokens=256,
                                   max_context_tokens=4096)
    assert stable.source == StaticSource(("http://127.0.0.1:8001", "http://127.0.0.1:8002"))
    assert canary.spec == PoolSpec("canary", "2", 20, canary=True)  # a number as written
    assert canary.source == K8sSource("engine-canary", None, "http")
    assert long.spec == PoolSpec("long", "1.10", 1, max_context_tokens=32768, long_context=True)
    assert long.source == DnsSource("engine-long.ns.svc.cluster.local", 8080)
    assert cfg.degradation == DegradationSettings(
        DegradationConfig(p99_ttft_s_trip=3.0, p99_ttft_s_clear=1.5, error_rate_trip=0.1, dwell_s=20.0),
        window_s=10.0, min_requests=5)
    assert cfg.describe() == "stable (v1, weight 80), canary (2, weight 20), long (1.10, weight 1)"


def test_roles_parse_and_a_prefill_pool_is_never_chosen():
    from random import Random

    from router.pools.choice import PoolChoice, choose_pool

    cfg = parse_pools("pools:\n  pre:\n    version: v1\n    weight: 9\n    role: prefill\n    replicas: [http://h:1]\n"
                      "  dec:\n    version: v1\n    weight: 1\n    role: decode\n    replicas: [http://h:2]\n")
    specs = [p.spec for p in cfg.pools]
    assert [(s.name, s.role) for s in specs] == [("pre", "prefill"), ("dec", "decode")]
    picks = {choose_pool(specs, None, 10, None, 0, Random(i)) for i in range(50)}
    assert {c.pool.name for c in picks if isinstance(c, PoolChoice)} == {"dec"}


def test_degradation_is_optional():
    cfg = parse_pools("pools:\n  a:\n    version: v1\n    weight: 1\n    replicas: [http://h:1]\n")
    assert cfg.degradation == DegradationSettings()


def _bad(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize("text, line, field, problem", [
    (_bad("weight: 80", "weight: -5"), 4, "pools.stable.weight", "must be an integer >= 0, got -5"),
    (_bad("weight: 80", "weight: lots"), 4, "pools.stable.weight", 'got "lots"'),
    (_bad("    version: v1\n", ""), 2, "pools.stable.version", "missing"),
    (_bad("    k8s: {service: engine-canary, port_name: http}\n", ""), 9, "pools.canary",
     "needs exactly one discovery source (replicas, dns, k8s), got none"),
    (_bad("    dns:", "    replicas: [http://h:1]\n    dns:"), 14, "pools.long",
     "got replicas, dns"),
    (_bad("http://127.0.0.1:8001", "ftp://x"), 5, "pools.stable.replicas[0]", "not an http(s) base URL"),
    (_bad("    canary: true", "    canary: yes please"), 12, "pools.canary.canary", "must be true or false"),
    (_bad("    canary: true", "    colour: blue"), 12, "pools.canary.colour", "unknown field"),
    (_bad("  canary:", "  Canary_1:"), 9, "pools.Canary_1", "a pool name is 1-63 lower-case"),
    (_bad("default_max_tokens: 256", "default_max_tokens: 2000"), 7, "pools.stable.default_max_tokens",
     "above max_tokens_cap 1024"),
    (_bad("k8s: {service: engine-canary, port_name: http}", "k8s: {port_name: http}"), 13,
     "pools.canary.k8s.service", "missing"),
    (_bad("port: 8080", "port: 70000"), 19, "pools.long.dns.port", "must be in 1..65535"),
    (_bad("trip: 3, clear: 1.5", "trip: 1, clear: 1.5"), 24, "degradation.p99_ttft_s",
     "p99_ttft_s_clear must not be above p99_ttft_s_trip"),
    (_bad("min_requests: 5", "min_requests: 0"), 22, "degradation.min_requests", "must be a positive integer"),
    (_bad("window_s: 10", "window_s: soon"), 21, "degradation.window_s", "must be a number"),
    (_bad("error_rate: {trip: 0.1}", "error_rates: {trip: 0.1}"), 25, "degradation.error_rates", "unknown field"),
    (_bad("weight: 80", "weight: 80\n    weight: 90"), 5, "pools.stable.weight", "given twice (first on line 4)"),
    (_bad("http://127.0.0.1:8002/", "http://10.0.0.9:1").replace("dns: {name: engine-long.ns.svc.cluster.local, "
                                                                  "port: 8080}", "replicas: [http://10.0.0.9:1]"),
     19, "pools.long.replicas", "http://10.0.0.9:1 is already a replica of pool stable"),
    (_bad("    canary: true", "    model: a\n    models: [b]"), 13, "pools.canary.models", "not both"),
    (_bad("    canary: true", "    models: [a, a]"), 12, "pools.canary.models[1]", "'a' is listed twice"),
    (_bad("    canary: true", "    models: a"), 12, "pools.canary.models", "must be a non-empty list of model names"),
    (_bad("    canary: true", "    engine: tensorrt"), 12, "pools.canary.engine",
     "must be one of auto, kvfleet, vllm, sglang, got 'tensorrt'"),
    (_bad("    canary: true", "    engine: vllm\n    kv_events: http://x:5557"), 13, "pools.canary.kv_events",
     "endpoints are tcp://HOST:PORT"),
    (_bad("    canary: true", "    engine: kvfleet\n    kv_events: tcp://{host}:5557"), 13, "pools.canary.kv_events",
     "kv_events (ZMQ) is for vllm and sglang pools"),
    (_bad("    canary: true", "    role: prefil"), 12, "pools.canary.role",
     "role must be one of both, prefill, decode, got 'prefil'"),
    (_bad("weight: 80", "weight: 80\n    role: prefill").replace("weight: 20", "weight: 0"), 2, "pools",
     "no regular (not long_context) pool has a weight above 0"),
    ("pools: {}\n", 1, "pools", "at least one pool"),
    ("pool:\n  a: {}\n", 1, "pool", "unknown field (the file holds pools, degradation)"),
    ("", 1, "", "the file is empty"),
    ("pools: [\n", 2, "", "not valid YAML"),
])
def test_each_error_names_file_line_and_field(text, line, field, problem):
    with pytest.raises(ConfigFileError) as e:
        parse_pools(text, "pools.yaml")
    assert (e.value.line, e.value.field) == (line, field), str(e.value)
    assert problem in str(e.value)
    assert str(e.value).startswith(f"pools.yaml:{line}: {field + ': ' if field else ''}")


def test_no_regular_pool_with_weight_is_an_error():
    text = _bad("weight: 80", "weight: 0").replace("weight: 20", "weight: 0")
    with pytest.raises(ConfigFileError, match=r"pools\.yaml:2: pools: no regular \(not long_context\) pool"):
        parse_pools(text, "pools.yaml")


def test_the_file_reloads_and_keeps_the_pools_in_force_on_a_bad_change(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(GOOD)
    seen = []
    f = PoolsFile(str(path), on_reload=seen.append)
    first = f.value
    path.write_text(_bad("weight: 20", "weight: 0"))
    assert f.poll() and f.value.pools[1].spec.weight == 0
    path.write_text(_bad("weight: 20", "weight: -1"))
    assert not f.poll() and f.value.pools[1].spec.weight == 0 and f.value is not first
    assert seen == [True, False]


def test_models_engines_and_tokenizers_per_pool():
    cfg = parse_pools(textwrap.dedent("""\
        pools:
          small:
            version: v1
            weight: 1
            model: smollm2
            replicas: [http://h:1]
          large:
            version: v1
            weight: 1
            models: [llama-70b, llama-70b-chat]
            engine: vllm
            kv_events: "tcp://{host}:5557|tcp://{host}:5558"
            tokenizer: /models/llama
            replicas: [http://10.0.0.5:8000]
        """))
    small, large = cfg.pools
    assert (small.spec.models, small.engine, small.kv_events, small.tokenizer) == (("smollm2",), "auto", None, None)
    assert large.spec.models == ("llama-70b", "llama-70b-chat") and large.engine == "vllm"
    assert large.kv_events.endpoints("http://10.0.0.5:8000") == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert large.tokenizer == "/models/llama"


def test_a_pools_latency_targets_are_read_in_milliseconds():
    cfg = parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    slo_ttft_ms: 750\n    slo_tpot_ms: 60\n"
                      "    replicas: [http://127.0.0.1:8001]\n", "pools.yaml")
    assert (cfg.pools[0].spec.slo_ttft_s, cfg.pools[0].spec.slo_tpot_s) == (0.75, 0.06)
    assert parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    replicas: [http://127.0.0.1:8001]\n",
                       "pools.yaml").pools[0].spec.slo_tpot_s is None
    assert parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    slo_unattainable: best_effort\n"
                       "    replicas: [http://127.0.0.1:8001]\n", "pools.yaml").pools[0].spec.slo_unattainable == \
        "best_effort"
    with pytest.raises(Exception, match="slo_unattainable must be one of refuse, best_effort, got 'later'"):
        parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    slo_unattainable: later\n"
                    "    replicas: [http://127.0.0.1:8001]\n", "pools.yaml")
    with pytest.raises(Exception, match="slo_tpot_ms: must be a number >= 1"):
        parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    slo_tpot_ms: 0.5\n"
                    "    replicas: [http://127.0.0.1:8001]\n", "pools.yaml")
    with pytest.raises(Exception, match="slo_ttft_ms: must be a number >= 1"):
        parse_pools("pools:\n  p:\n    version: v1\n    weight: 1\n    slo_ttft_ms: 0\n"
                    "    replicas: [http://127.0.0.1:8001]\n", "pools.yaml")
