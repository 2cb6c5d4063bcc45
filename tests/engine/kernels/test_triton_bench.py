"""Smoke run of loadtest/bench_paged_decode.py at tiny sizes (interpreter on CPU, compiled on a GPU), so the
GPU check does not discover a broken benchmark; and the target arithmetic it reports."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_paged_decode as bench
from tests.engine.triton_setup import load_kernels, triton_mode  # noqa: F401 (fixture)

load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")


def test_bench_smoke_writes_rows_targets_and_sweep(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--batches", "1,2", "--contexts", "24", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                     "--block-size", "8", "--sweep", "1,24", "--copy-gib", "0.01", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 24), (2, 24)]
    for r in result["rows"]:
        assert r["paged_ms"] > 0 and r["sdpa_ms"] > 0 and r["kv_bytes"] == 2 * r["batch"] * 24 * 2 * 64 * 2
    assert len(result["sweep"]) == 18 and all("paged_ms" in r for r in result["sweep"])
    assert "paged us" in capsys.readouterr().out


def test_targets_select_long_contexts_and_batches():
    rows = [
        {"batch": 1, "context": 8192, "paged_gbs": 1, "paged_frac_copy": 0.1, "paged_vs_sdpa_time": 3.0},
        {"batch": 16, "context": 512, "paged_gbs": 1, "paged_frac_copy": 0.2, "paged_vs_sdpa_time": 2.0},
        {"batch": 16, "context": 2048, "paged_gbs": 1, "paged_frac_copy": 0.85, "paged_vs_sdpa_time": 1.05},
        {"batch": 64, "context": 8192, "paged_gbs": 1, "paged_frac_copy": 0.9, "paged_vs_sdpa_time": 0.8},
    ]
    t = bench.targets(rows)
    assert t == {"shapes": 2, "min_frac_copy": 0.85, "frac_copy_ok": True, "max_time_vs_sdpa": 1.05,
                 "vs_sdpa_ok": True}
    rows[2]["paged_frac_copy"] = 0.84  # issue 19's mark: >= 85% of copy bandwidth
    assert bench.targets(rows)["frac_copy_ok"] is False


def test_bad_cli_values_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--heads", "6", "--kv-heads", "4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--sweep", "64"])
