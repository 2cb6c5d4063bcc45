"""Circuit breaker transitions, replica load bookkeeping and the engine metrics parser; config validation."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from contract.errors import ConfigError
from router.config import RouterConfig, ScoringConfig
from router.routing.replicas import CircuitBreaker, EngineLoad, ReplicaState, parse_engine_metrics
from router.states import CircuitState

CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


def test_circuit_breaker_transitions():
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    assert b.state(0) == CLOSED and b.can_try(0)
    b.on_failure(1)
    b.on_failure(2)
    b.on_success()  # consecutive failures only
    b.on_failure(3)
    b.on_failure(4)
    assert b.state(4) == CLOSED
    b.on_failure(5)
    assert b.state(5) == OPEN and not b.can_try(5) and not b.can_try(9.9)
    assert b.state(10) == HALF_OPEN and b.can_try(10)
    b.on_attempt(10)  # the one probe
    assert not b.can_try(10.5)
    b.on_failure(11)  # probe failed → open again, for another open_s
    assert b.state(11) == OPEN and b.state(15.9) == OPEN and b.state(16) == HALF_OPEN
    b.on_attempt(16)
    assert not b.can_try(16)
    b.on_abandoned()  # the probe's client hung up: no verdict, the next request may probe
    assert b.can_try(16) and b.state(16) == HALF_OPEN
    b.on_attempt(16)
    b.on_success()
    assert b.state(16) == CLOSED and b.can_try(16) and b.failures == 0


def test_replica_load_between_scrapes_is_neither_lost_nor_double_counted():
    st = ReplicaState("http://a:1", CircuitBreaker(3, 5.0), grace_s=0.2)
    assert not st.routable(0)  # not ready until /ready said so
    st.ready = True
    st.on_scrape(EngineLoad(kv_usage=0.5, running=2, waiting=1), sent_at=100.0)
    t1 = st.on_dispatch(300, now=100.5)
    t2 = st.on_dispatch(50, now=101.9)
    v = st.view(now=102.0, stale_s=3.0, cached_tokens=64)
    assert (v.load_known, v.running, v.waiting, v.new_requests, v.new_tokens, v.inflight, v.cached_tokens) == \
        (True, 2, 1, 2, 350, 2, 64)
    # a scrape sent at 102.0 counts t1 (sent 1.5 s before) but maybe not t2 (0.1 s before: still in transit)
    st.on_scrape(EngineLoad(running=3), sent_at=102.0, now=102.01)
    v = st.view(now=102.5, stale_s=3.0)
    assert (v.running, v.new_requests, v.new_tokens, v.finished, v.inflight) == (3, 1, 50, 0, 2)
    st.on_done(t1)  # counted by the scrape, finished since: subtracted until the next scrape
    t3 = st.on_dispatch(10, now=102.6)
    v = st.view(now=102.6, stale_s=3.0)
    assert (v.running, v.finished, v.new_requests, v.new_tokens, v.inflight) == (3, 1, 2, 60, 2)
    st.on_done(t3)  # never counted by a scrape: just leaves the new load
    st.on_done(t2)
    v = st.view(now=105.1, stale_s=3.0)
    assert (v.load_known, v.running, v.new_requests, v.finished, v.inflight) == (False, 0, 0, 1, 0)  # stale
    st.on_scrape(EngineLoad(running=0), sent_at=106.0)
    assert st.view(now=106.0, stale_s=3.0).finished == 0
    assert st.view(now=103.0, stale_s=3.0, excluded=True).routable is False


def test_parse_engine_metrics_reads_vllm_names():
    reg = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=reg).labels("smollm2").set(0.25)
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=reg).labels("smollm2").set(3)
    Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=reg).labels("smollm2").set(2)
    Counter("vllm:prefix_cache_queries", "q", ["model_name"], registry=reg).labels("smollm2").inc(1000)
    Counter("vllm:prefix_cache_hits", "h", ["model_name"], registry=reg).labels("smollm2").inc(640)
    Gauge("vllm:num_requests_running_other", "decoy", registry=reg).set(99)
    text = generate_latest(reg).decode()
    assert parse_engine_metrics(text) == EngineLoad(kv_usage=0.25, running=3, waiting=2, prefix_queries=1000,
                                                    prefix_hits=640, engine="vllm")
    info = ('vllm:cache_config_info{model_name="m",block_size="16",num_gpu_blocks="512",'
            'enable_prefix_caching="True"} 1.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    load = parse_engine_metrics(info)
    assert (load.kv_capacity_tokens, load.kv_tokens) == (8192, 2048)
    assert parse_engine_metrics('vllm:num_requests_running{model_name="a b}"} 4 1700000000\n') == \
        EngineLoad(running=4, engine="vllm")
    assert parse_engine_metrics("garbage\n\n# HELP x\nvllm:num_requests_waiting nan-ish\n") == \
        EngineLoad(engine="vllm")


def test_config_validation_names_the_field():
    cases = [
        (dict(policy="fastest", replicas=("http://a:1",)), "policy"),
        (dict(replicas=()), "replicas"),
        (dict(replicas=("ftp://a:1",)), "replicas"),
        (dict(replicas=("http://a:1/v1",)), "replicas"),
        (dict(discovery="dns"), "dns_name"),
        (dict(discovery="k8s"), "k8s_service"),
        (dict(replicas=("http://a:1",), port=70000), "port"),
        (dict(replicas=("http://a:1",), scrape_interval_s=0), "scrape_interval_s"),
        (dict(replicas=("http://a:1",), scrape_stale_s=0.1, scrape_interval_s=0.5), "scrape_stale_s"),
        (dict(replicas=("http://a:1",), max_attempts=0), "max_attempts"),
        (dict(replicas=("http://a:1",), scoring=ScoringConfig(overload_kv_usage=1.5)), "overload_kv_usage"),
        (dict(replicas=("http://a:1",), scoring=ScoringConfig(session_load_factor=1.0)), "session_load_factor"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError) as e:
            RouterConfig(**kwargs)
        assert e.value.field == field, kwargs
    cfg = RouterConfig(replicas=("http://127.0.0.1:8001", "http://[::1]:8002"))
    assert cfg.policy == "kv" and cfg.discovery == "static"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "session"  # type: ignore[misc]


def test_cli_errors_name_the_flag(capsys):
    from router.main import build_parser, config_from_args, main

    assert main(["--replicas", "http://a:1", "--scrape-stale", "0.1"]) == 2
    assert "--scrape-stale: must be >= scrape_interval_s" in capsys.readouterr().err
    assert main(["--replicas", "ftp://x"]) == 2
    assert "--replicas: not an http(s) base URL" in capsys.readouterr().err
    cfg = config_from_args(build_parser().parse_args(["--dns-name", "engine.ns.svc", "--policy", "session"]))
    assert (cfg.discovery, cfg.dns_name, cfg.policy) == ("dns", "engine.ns.svc", "session")
    cfg = config_from_args(build_parser().parse_args(["--replicas", "http://a:1/, http://b:2", "--model", ""]))
    assert cfg.replicas == ("http://a:1", "http://b:2") and cfg.model is None and cfg.access_log is False
    assert config_from_args(build_parser().parse_args(["--replicas", "http://a:1", "--access-log"])).access_log
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "fastest"])
    assert "(choose from 'kv', 'approx-prefix', 'session', 'least-load', 'round-robin')" in capsys.readouterr().err
