"""`kvfleet capacity` against figures computed by hand for Llama-3-8B and Qwen2.5-7B (configs vendored in
data/, sources in data/README.md), 80 GiB GPU, 0.9 utilization, bf16, 16-token blocks, 8192 batched tokens,
256 sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet import capacity
from kvfleet.capacity import Arch, Budget, load_model, plan

DATA = Path(__file__).parent / "data"
USABLE = 77_309_411_328  # int(80 * 2**30 * 0.9)


def test_llama3_8b_by_hand():
    arch, weights, _ = load_model(str(DATA / "llama3_8b_config.json"))
    # params: embed 128256*4096 = 525,336,576 (x2: untied LM head)
    # per layer: q 4096*4096 + k,v 2*4096*(8*128) + o 4096*4096 + MLP 3*4096*14336 + 2 norms 2*4096
    #   = 16,777,216 + 8,388,608 + 16,777,216 + 176,160,768 + 8,192 = 218,112,000; x32 = 6,979,584,000
    # total = 2*525,336,576 + 6,979,584,000 + 4,096 (final norm) = 8,030,261,248
    assert arch.num_params() == 8_030_261_248
    assert weights == 0  # no safetensors: main() uses params x 2 bytes
    # KV bytes/token: 2 * 32 layers * 8 KV heads * 128 * 2 bytes = 131,072 (a 32-head MHA would be 524,288)
    assert arch.kv_bytes_per_token("bfloat16") == 131_072
    assert arch.kv_bytes_per_token("fp8") == 65_536
    r = plan(arch, 8_030_261_248 * 2, Budget(80), {"p50": 1200, "p95": 1250}, 10, 250, 1000)
    # activations: 8192 * (4*4096 + 2*14336) * 2 = 738,197,504; logits 256 * 128256 * 4 = 131,334,144
    assert r["activation_reserve_bytes"] == 869_531_648
    # KV budget: 77,309,411,328 - 16,060,522,496 - 869,531,648 = 60,379,357,184; / (16 * 131,072) = 28,791.3
    assert r["kv_budget_bytes"] == 60_379_357_184
    assert r["blocks"] == 28_791 and r["kv_tokens"] == 460_656
    # 1200 tokens = 75 blocks exactly (no waste): 28,791 // 75 = 383; 1250 -> 79 blocks, 14 of 1264 slots unused
    assert r["at_lengths"]["p50"] == {"tokens": 1200, "blocks_per_seq": 75, "concurrent_seqs": 383, "block_waste": 0.0}
    assert r["at_lengths"]["p95"]["concurrent_seqs"] == 364
    assert r["at_lengths"]["p95"]["block_waste"] == pytest.approx(14 / 1264)
    # 10 req/s * 250 output tokens = 2,500 tok/s over 1,000 tok/s per replica = 2.5 -> 3
    assert r["replicas"]["replicas_needed"] == 3


def test_qwen2_5_7b_by_hand():
    arch, _, _ = load_model(str(DATA / "qwen2_5_7b_config.json"))
    assert arch.qkv_bias and arch.kv_heads == 4 and arch.head_dim == 128
    # embed 152064*3584 = 544,997,376 (x2, untied)
    # per layer: q 3584*3584 + bias 3584 + k,v 2*(3584*512 + 512) + o 3584*3584 + MLP 3*3584*18944 + norms 2*3584
    #   = 12,845,056 + 3,584 + 3,671,040 + 12,845,056 + 203,685,888 + 7,168 = 233,057,792; x28 = 6,525,618,176
    # total = 1,089,994,752 + 6,525,618,176 + 3,584 = 7,615,616,512 (Qwen's model card: 7.61 B)
    assert arch.num_params() == 7_615_616_512
    # KV: 2 * 28 * 4 * 128 * 2 = 57,344 bytes/token (float32: 114,688)
    assert arch.kv_bytes_per_token("bfloat16") == 57_344
    assert arch.kv_bytes_per_token("float32") == 114_688
    r = plan(arch, 7_615_616_512 * 2, Budget(80), {"p95": 1250}, 8, 250, 1000)
    # activations: 8192 * (4*3584 + 2*18944) * 2 = 855,638,016; logits 256 * 152064 * 4 = 155,713,536
    assert r["activation_reserve_bytes"] == 1_011_351_552
    # 77,309,411,328 - 15,231,233,024 - 1,011,351,552 = 61,066,826,752; / (16 * 57,344 = 917,504) = 66,557.6
    assert r["blocks"] == 66_557
    assert r["at_lengths"]["p95"]["concurrent_seqs"] == 842  # 66,557 // 79
    assert r["replicas"]["replicas_needed"] == 2  # 8 * 250 = 2,000 tok/s over 1,000 exactly


def test_safetensors_sizes_are_the_weights(tmp_path):
    (tmp_path / "config.json").write_text((DATA / "llama3_8b_config.json").read_text())
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 24)
    _, weights, source = load_model(str(tmp_path))
    assert weights == 1024 and "2 safetensors" in source


def test_cli_uses_profile_and_reports_errors_by_flag(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"prompt_tokens": {"p50": 1000, "p95": 1050, "p99": 1100, "mean": 1},
                                "output_tokens": {"p50": 200, "p95": 200, "p99": 200, "mean": 250}}))
    assert capacity.main(["--model", str(DATA / "llama3_8b_config.json"), "--gpu-memory-gib", "80", "--profile",
                          str(prof), "--target-rps", "10", "--replica-throughput", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blocks"] == 28_791 and out["at_lengths"]["p50"]["concurrent_seqs"] == 383
    assert out["replicas"]["replicas_needed"] == 3
    assert capacity.main(["--model", "/nonexistent/dir", "--gpu-memory-gib", "80"]) == 2
    assert "--model" in capsys.readouterr().err
    assert capacity.main(["--model", str(DATA / "llama3_8b_config.json"), "--gpu-memory-gib", "-1"]) == 2
    assert "--gpu-memory-gib" in capsys.readouterr().err
    assert capacity.main(["--model", str(DATA / "llama3_8b_config.json"), "--gpu-memory-gib", "80",
                          "--target-rps", "5"]) == 2
    assert "--replica-throughput" in capsys.readouterr().err


def test_too_small_a_gpu_does_not_fit():
    arch = Arch.from_config(json.loads((DATA / "llama3_8b_config.json").read_text()))
    r = plan(arch, 8_030_261_248 * 2, Budget(16), {"x": 100})
    assert not r["fits"] and r["blocks"] == 0
