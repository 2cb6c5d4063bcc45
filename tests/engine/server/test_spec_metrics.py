"""vLLM's spec_decode counters: rendered from the engine's stats, and counting on a served engine with
--speculative-config (a real `kvfleet engine` process, its core in a process of its own)."""

from __future__ import annotations

import json
import signal

import httpx

from engine.server.metrics import EngineMetrics
from engine.stats import EngineStats
from tests.engine.server.conftest import start_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def stats(**kw) -> EngineStats:
    return EngineStats(kv_usage=0, num_running=0, num_waiting=0, num_total_blocks=1, block_size=16,
                       prefix_queries_tokens=0, prefix_hits_tokens=0, num_preemptions=0, alloc_failures=0,
                       evictions=0, prompt_tokens_total=0, generation_tokens_total=0, **kw)


def test_rendered_with_speculation_only():
    on = stats(spec_num_drafts=5, spec_num_draft_tokens=12, spec_num_accepted_tokens=7, spec_accepted_per_pos=(4, 2, 1),
               spec_gate_open=False, spec_gate_speedup=0.8, spec_gate_closed_steps=31)
    text = EngineMetrics("m", lambda: on).render().decode()
    for line in ('kvfleet:spec_decode_gate_open{model_name="m"} 0.0',
                 'kvfleet:spec_decode_gate_speedup{model_name="m"} 0.8',
                 'kvfleet:spec_decode_gate_closed_steps_total{model_name="m"} 31.0','vllm:spec_decode_num_drafts_total{model_name="m"} 5.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'):
        assert line in text
    assert "spec_decode" not in EngineMetrics("m", lambda: stats()).render().decode()


def test_a_served_engine_counts_drafts(tmp_path):
    server = start_engine(str(tmp_path), "--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "4",
                          "--speculative-config", json.dumps(SPEC))
    try:
        assert server.metric("vllm:spec_decode_num_drafts_total") == 0
        prompt = "Copy this list: red, green, blue, yellow, purple, orange.\nCopy: red, green, blue, yellow,"
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == r.json()["usage"]["completion_tokens"]
        drafts = server.metric("vllm:spec_decode_num_drafts_total")
        draft_tokens = server.metric("vllm:spec_decode_num_draft_tokens_total")
        accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total")
        per_pos = [server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                   for i in range(3)]
        assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        # every output token is a step's sampled token or an accepted draft
        assert server.metric("vllm:generation_tokens_total") == r.json()["usage"]["completion_tokens"]
        # streamed, the same text in chunks (a chunk per step: several tokens when drafts were kept)
        text, chunks = "", 0
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    chunks += 1
        assert text == choice["text"] and 0 < chunks < 24
        assert server.metric("vllm:spec_decode_num_drafts_total") > drafts
        # the gate measured what drafting gained (whether it paid is this machine's timing: tests/engine/spec/)
        assert server.metric("kvfleet:spec_decode_gate_speedup") > 0
        assert server.metric("kvfleet:spec_decode_gate_open") in (0, 1)
        assert server.metric("kvfleet:spec_decode_gate_closed_steps_total") >= 0
    finally:
        server.stop(signal.SIGTERM)
