"""Benchmark scripts without a model: http_bench's pooled ratios over alternating rounds, decode_step's flags,
cpu_kernels_bench on tiny sizes."""

from __future__ import annotations

import pytest

from loadtest.http_bench import LevelResult, main, print_pooled_ratios


def level(target: str, c: int, tokens: int, wall: float) -> LevelResult:
    return LevelResult(target, c, 10, 0, wall, tokens, tokens / wall, 10 / wall, 0.1, 0.2, 0.01, 0.02)


def test_pooled_ratio_is_tokens_over_total_time(capsys):
    results = [level("kvfleet#1", 16, 1000, 4.0), level("vllm#1", 16, 1000, 5.0),
               level("kvfleet#2", 16, 1000, 6.0), level("vllm#2", 16, 1000, 5.0)]
    print_pooled_ratios(results, ["kvfleet", "vllm"])
    out = capsys.readouterr().out
    # kvfleet 2000 tokens / 10 s = 200.0; vllm 2000 / 10 s = 200.0; per round 250/200 and 166.7/200
    assert "c=16  out tok/s 200.0 vs 200.0 = x1.00" in out
    assert "[x1.25, x0.83]" in out


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        main(["--target", "a=http://127.0.0.1:1", "--rounds", "0"])


def test_decode_step_rejects_bad_flags(capsys):
    from loadtest import decode_step

    for argv in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            decode_step.main(argv)
        assert "--batch-sizes" in capsys.readouterr().err or "--steps" in argv


def test_cpu_kernels_bench_small_runs(capsys):

    from engine.kernels import cpu_ops
    from loadtest import cpu_kernels_bench

    assert cpu_ops.load()
    rc = cpu_kernels_bench.main(["projections", "--rows", "1,17", "--layers", "1", "--rounds", "1", "--hidden", "64",
                                 "--intermediate", "96", "--kv-dim", "32"])
    out = capsys.readouterr()
    if cpu_ops.ops().quant_path() != "portable":
        assert rc == 0 and "   17 " in out.out and "x" in out.out.splitlines()[-1]
    else:
        assert rc == 1 and "neither AMX nor AVX-512 BF16" in out.err
    assert cpu_kernels_bench.main(["attention", "--batch", "2", "--context", "20", "--layers", "1", "--rounds", "1"]) == 0
    assert "of the measured read bandwidth" in capsys.readouterr().out


def test_cpu_kernels_bench_rejects_bad_flags(capsys):
    from loadtest import cpu_kernels_bench

    for argv, flag in ((["projections", "--rows", "0"], "--rows"), (["projections", "--hidden", "40"], "--hidden"),
                       (["attention", "--batch", "0"], "--batch")):
        with pytest.raises(SystemExit):
            cpu_kernels_bench.main(argv)
        assert flag in capsys.readouterr().err


def test_long_stream_windows_and_pooling():
    from loadtest.long_stream import StreamResult, pooled, summarize

    times = [0.010 * (k + 1) + (0.005 * (k - 100) if k > 100 else 0.0) for k in range(300)]  # 10 ms, then 15 ms
    r = summarize("a", 0.01, times, (10, 60), 100)
    assert r.tokens == 300 and r.ttft_ms == 10.0
    assert round(r.early_ms, 6) == 10.0 and round(r.late_ms, 6) == 15.0 and round(r.growth, 6) == 1.5
    both = pooled([StreamResult("a#1", 300, 10, 20, 5), StreamResult("a#2", 300, 20, 30, 7)])
    assert both == {"a": StreamResult("a", 300, 15, 25, 6)}


def test_long_stream_rejects_overlapping_windows():
    from loadtest import long_stream

    with pytest.raises(SystemExit):
        long_stream.main(["--target", "a=http://127.0.0.1:1", "--tokens", "2000", "--window", "1024"])
    with pytest.raises(SystemExit):
        long_stream.main(["--target", "a=http://127.0.0.1:1", "--rounds", "0"])


def test_mixed_step_rejects_bad_flags(capsys):
    from loadtest import mixed_step

    for argv, says in ((["--prompts", "65,x"], "--prompts must be comma-separated"),
                       (["--repeats", "0"], "--repeats must be >= 1"),
                       (["--context", "2000"], "--context 2000 leaves too little room")):
        with pytest.raises(SystemExit):
            mixed_step.main(argv)
        assert says in capsys.readouterr().err


def test_host_share_sorts_ops_and_rejects_bad_flags(capsys):
    from loadtest import host_share

    assert host_share.is_compute("kvfleet_cpu::q4_linear") and host_share.is_compute("aten::mm")
    assert not host_share.is_compute("aten::slice") and not host_share.is_compute("aten::empty")
    for argv in (["--batch-sizes", "0"], ["--batch-sizes", "a"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            host_share.main(argv)
        assert "--batch-sizes" in capsys.readouterr().err
    row = {"batch": 1, "wall_ms": 17.0, "kernels_ms": 11.5, "host_share": 0.32, "glue_ops_ms": 0.6,
           "ops_per_step": 987.0, "other_ms": 0.1, "host_ms_per_layer": 0.17, "threads": 2,
           "phases_ms": {"schedule": 0.02, "forward": 16.6, "sample": 0.1, "update": 0.04},
           "top_kernels_ms": {"kvfleet_cpu::q4_linear": 8.6}}
    text = host_share.report([row])
    assert "   17.00    11.50    32%" in text and "kvfleet_cpu::q4_linear 8.60" in text
