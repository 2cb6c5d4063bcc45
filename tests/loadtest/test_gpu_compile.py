"""`python -m loadtest.gpu_compile`: every Triton variant the engine compiles (engine/kernels/variants.py), compiled
for sm_90 and sm_100 on this CPU machine, none spilling, overflowing shared memory or missing the tensor cores;
and the same check failing, naming the variant, on the engine's decode kernel launched to spill or to overflow
shared memory. Both run in fresh processes: Triton fixes compiled-vs-interpreted mode when first imported, and
tests/engine/conftest.py sets TRITON_INTERPRET=1 for the interpreter tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from loadtest.gpu_compile import ARCHS, DTYPES, MODELS, dot_lowering, occupancy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"add_rms_norm", "rotary_kv_write", "silu_and_mul", "paged_decode_split", "paged_decode_reduce", "extend",
           "lora", "kv_write"}


def _run(args: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict:
    """The full run, cold: Triton's cache and the ptxas/cuobjdump readings in fresh folders, so every variant is
    compiled and read here (`make gpu-compile`, which .ci/run calls, has 3 minutes for it)."""
    tmp = tmp_path_factory.mktemp("gpu_compile")
    out = tmp / "rows.json"
    t0 = time.monotonic()
    res = _run(["loadtest.gpu_compile", "--jobs", "2", "--json", str(out), "--markdown", str(tmp / "table.md")],
               timeout=400,
               env={"TRITON_CACHE_DIR": str(tmp / "triton"), "KVFLEET_GPU_COMPILE_CACHE": str(tmp / "readings")})
    print(f"gpu_compile: every variant, cold, in {time.monotonic() - t0:.0f} s")
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    data["rc"], data["stdout"], data["markdown"] = res.returncode, res.stdout, (tmp / "table.md").read_text()
    return data


@pytest.mark.slow  # all 234 variants, cold: make gpu-compile (.ci/run) runs it beside make test
def test_every_variant_compiles_for_hopper_and_blackwell(table):
    assert table["failures"] == [] and table["rc"] == 0, "\n".join(table["failures"])
    rows = table["rows"]
    for arch in ARCHS:
        for model in MODELS:
            for dtype in DTYPES:
                kernels = {r["kernel"] for r in rows if (r["arch"], r["model"], r["dtype"]) == (arch, model, dtype)}
                assert kernels == KERNELS, (arch, model, dtype, kernels)
    assert "| sm_100 | qwen2.5-7b | paged_decode_split bf16 G=7" in table["stdout"]


@pytest.mark.slow  # all 234 variants, cold: make gpu-compile (.ci/run) runs it beside make test
def test_the_table_in_the_docs_is_what_the_compiler_makes_today(table):
    from loadtest.gpu_compile import docs_table

    assert docs_table() == table["markdown"].strip(), \
        "docs/engine-internals.md's variant table is stale: python -m loadtest.gpu_compile --docs"


@pytest.mark.slow  # all 234 variants, cold: make gpu-compile (.ci/run) runs it beside make test
def test_16_bit_products_run_on_tensor_cores_and_fp32_on_fma(table):
    for r in table["rows"]:
        if r["kernel"] in ("paged_decode_split", "extend"):
            assert r["dots"] == 2, r
            if r["dtype"] == "float32":  # IEEE float32 (no TF32): FMA by design
                assert r["tc_dots"] == 0 and not r["tensor_cores_expected"], r
            else:
                assert r["tc_dots"] == 2 and r["ptx_tc"] > 0 and r["sass_tc"] > 0, r
        else:  # no tl.dot: nothing for the tensor cores, and no disassembly needed to show it
            assert r["dots"] == 0 and r["ptx_tc"] == 0 and r["sass_tc"] is None, r


@pytest.mark.slow  # all 234 variants, cold: make gpu-compile (.ci/run) runs it beside make test
def test_registers_come_from_ptxas_and_agree_with_the_cubin(table):
    for r in table["rows"]:
        assert 0 < r["registers"] <= 255 and r["registers"] == r["cubin_registers"], r
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["shared"] <= ARCHS[r["arch"]].smem_per_block and r["occupancy"] > 0, r


@pytest.mark.slow  # all 234 variants, cold: make gpu-compile (.ci/run) runs it beside make test
def test_decode_and_prefill_carry_an_expected_time_per_call(table):
    for r in table["rows"]:
        if r["kernel"] in ("paged_decode_split", "extend"):
            devices = {d.name for d in ARCHS[r["arch"]].devices}
            assert set(r["expected_us"]) == devices and min(r["expected_us"].values()) > 0, r
    llama = next(r for r in table["rows"] if (r["arch"], r["model"], r["kernel"], r["dtype"])
                 == (90, "llama3-8b", "paged_decode_split", "bfloat16"))
    # 64 sequences x 2048 tokens x 8 KV heads x 128 x (K, V) x 2 bytes = 537 MB: memory-bound at 3.35 TB/s
    assert llama["expected_us"]["H100"] == pytest.approx(160.6, abs=0.5)


@pytest.mark.slow  # two cold compiles (~20 s): make gpu-compile (.ci/run) runs it beside make test
def test_a_variant_that_spills_or_overflows_shared_memory_fails_by_name():
    res = _run(["tests.loadtest._bad_variants"], timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    failures = json.loads(res.stdout.strip().splitlines()[-1])["failures"]
    assert len(failures) == 4, failures  # two variants, two architectures
    for arch in (90, 100):
        spill = [f for f in failures if f.startswith(f"sm_{arch} bad-spills paged_decode_split bf16 ")]
        smem = [f for f in failures if f.startswith(f"sm_{arch} bad-overflows-shared-memory paged_decode_split ")]
        assert len(spill) == 1 and "BLOCK_N=128" in spill[0] and "w1" in spill[0] and "spills" in spill[0], spill
        assert len(smem) == 1 and "shared memory, over the 232448 B" in smem[0], smem


def test_occupancy_from_registers_shared_memory_and_warps():
    a = ARCHS[90]
    # 80 registers -> 2560 per warp -> 25 warps -> 6 blocks of 4; 38 KB + 1 KB reserved -> 5 blocks: 20 of 64 warps
    assert occupancy(a, 80, 38912, 4) == {"blocks_per_sm": 5, "occupancy": 20 / 64, "limited_by": "shared"}
    assert occupancy(a, 192, 81920, 4) == {"blocks_per_sm": 2, "occupancy": 8 / 64, "limited_by": "registers"}
    assert occupancy(a, 255, 0, 16)["blocks_per_sm"] == 0  # 255 x 512 threads: more than 64K registers
    assert occupancy(a, 16, 0, 1) == {"blocks_per_sm": 32, "occupancy": 0.5, "limited_by": "blocks"}


def test_dot_lowering_counts_each_ttir_dot_once():
    ttir = "%a = tt.dot %x, %y, %z\n%b = tt.dot %p, %q, %r\n"
    mma = "#mma = #ttg.nvidia_mma<{versionMajor = 2}>\n#blocked = #ttg.blocked<{}>\n"
    on_tc = mma + "%a = tt.dot %x, %y : tensor<16x64xbf16> -> tensor<16x64xf32, #mma>\n" * 3
    assert dot_lowering(ttir, on_tc, "mma.sync.aligned") == {"dots": 2, "tc_dots": 2, "ptx_tc": 1}
    one_fma = on_tc + "%b = tt.dot %p, %q : tensor<16x64xf32> -> tensor<16x64xf32, #blocked>\n"
    assert dot_lowering(ttir, one_fma, "mma.sync.aligned")["tc_dots"] == 1
    assert dot_lowering(ttir, mma.replace("#mma = ", "#x = ") + "ttng.tc_gen5_mma %a\n", "")["tc_dots"] == 2


def test_gpu_check_report_carries_the_device_compile_table(tmp_path):
    from loadtest import gpu_check_report

    row = "| sm_90 | llama3-8b | paged_decode_split bf16 G=4 | 80 | 0 | 38912 | 128 | 5 (shared) | 31% | 2/2 |"
    (tmp_path / "gpu_compile.md").write_text("| arch | model |\n|---|---|\n" + row + "\n")
    (tmp_path / "gpu_compile.json").write_text(json.dumps(
        {"rows": [{"arch": 90}, {"arch": 90}], "failures": ["sm_90 llama3-8b extend bf16: spills 8 B"]}))
    assert gpu_check_report.main([str(tmp_path), "NVIDIA H200", "passed", "passed", "passed", "FAILED (rc=1)"]) == 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "- variant compile table: **FAILED (rc=1)**" in md
    assert "compiled for this device (2 variants, 1 failing)" in md
    assert "- FAIL sm_90 llama3-8b extend bf16: spills 8 B" in md and row in md
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["compile_failures"] == ["sm_90 llama3-8b extend bf16: spills 8 B"]


def test_the_written_down_smollm2_shape_is_the_bundled_ggufs(monkeypatch):
    """A GPU machine has no bundled GGUF: gpu_compile then compiles for SHAPES["smollm2"], which must be the shape
    the GGUF's own config gives (every field a kernel variant depends on)."""
    import engine.model.registry as registry
    from loadtest.gpu_compile import model_config

    fields = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    from_gguf = model_config("smollm2")

    def missing(*_a, **_k):
        raise registry.ModelNotFoundError("no GGUF on this machine")

    monkeypatch.setattr(registry, "resolve_model", missing)
    written = model_config("smollm2")
    assert {f: getattr(written, f) for f in fields} == {f: getattr(from_gguf, f) for f in fields}
