"""The fused CPU kernels, one library `kvfleet_cpu_ops` built from SOURCES: the layer glue
(`layer_ops.cpp`), paged attention (`attention_ops.cpp`, `prefill_attention.cpp`), the 4/8-bit and tile-order
bf16 matmuls (`quant_gemm.cpp`), the batch-invariant float32 matmul (`f32_gemm.cpp`), the LoRA products of
decode steps (`lora_ops.cpp`) and a decode step's decoder layers in one call (`decode_stack.cpp`).

Everyone reaches them through `ops()`, which loads them first (their ops register as torch.ops.kvfleet_cpu).
The C++ sources are compiled once per machine with the system's C++ compiler (through torch's extension
builder and ninja) into $KVFLEET_CACHE_DIR (default ~/.cache/kvfleet)/cpu_ops/<hash>, then loaded from there;
concurrent engines starting together build it once (torch locks the build folder). Where no compiler is
present or the build fails, `load()` says why once and returns False, and the engine keeps the plain
PyTorch path. `KVFLEET_CPU_KERNELS=torch` turns the kernels off; `python -m engine.kernels.cpu_ops`
builds them ahead of time (the Makefile does, so the first engine start does not wait for the compiler).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# one library: layer_ops.cpp defines it (TORCH_LIBRARY), the others add to it (TORCH_LIBRARY_FRAGMENT)
SOURCES = tuple(_HERE / name for name in ("layer_ops.cpp", "attention_ops.cpp", "prefill_attention.cpp", "quant_gemm.cpp",
                                           "f32_gemm.cpp", "lora_ops.cpp", "decode_stack.cpp"))
HEADERS = tuple(_HERE / name for name in ("cpu_common.h", "paged_scores.h", "amx.h", "quant_formats.h"))
ENV = "KVFLEET_CPU_KERNELS"  # "auto" (default) or "torch" (off)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17"]  # -fopenmp: ATen's parallel_for
# KVFLEET_CPU_ISA=portable builds the kernels as for a CPU with neither AMX nor AVX-512 (their portable loops,
# which the compiler vectorizes with what is left, AVX2 on x86), so that those paths run and are tested here
ISA_ENV = "KVFLEET_CPU_ISA"  # "native" (default) or "portable"
PORTABLE_CFLAGS = ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


def cflags() -> list[str]:
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ("native", "portable"):
        raise ValueError(f"{ISA_ENV} must be 'native' or 'portable', got {isa!r}")
    return CFLAGS + (PORTABLE_CFLAGS if isa == "portable" else [])

_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags (a build made on one CPU can hold
    instructions another lacks, and ~/.cache may be shared between machines)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = f.read().split(b"\n\n", 1)[0].splitlines()
        return b"\n".join(x for x in lines if x.startswith((b"vendor_id", b"model name", b"flags")))
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}".encode()


def build_dir() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(cflags()).encode()
                            + torch.__version__.encode() + cpu_identity())
    root = Path(os.environ.get("KVFLEET_CACHE_DIR") or Path.home() / ".cache" / "kvfleet")
    return root / "cpu_ops" / digest.hexdigest()[:16]


def load() -> bool:
    """True once the kernels are usable; False (with one logged reason) where they are not."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = _load()
        _state["ok"], _state["why"] = ok, why
        if not ok:
            logger.warning("fused CPU kernels not used (%s): the engine runs plain PyTorch ops", why)
        return ok


def ops():
    """torch.ops.kvfleet_cpu, loaded (built first if need be); RuntimeError with the reason where unavailable."""
    if not _state.get("ok") and not load():
        raise RuntimeError(f"the fused CPU kernels are unavailable: {_state['why']}")
    return torch.ops.kvfleet_cpu


def decode_stack_class():
    """The DecodeStack class (decode_stack.cpp: a decode step's decoder layers in one call), loaded like ops()."""
    ops()
    return torch.classes.kvfleet_cpu.DecodeStack


def loaded() -> bool:
    """Whether an earlier load() made the kernels usable (never builds anything itself)."""
    return bool(_state.get("ok"))


def unavailable_reason() -> str | None:
    return None if load() else str(_state["why"])


def _load() -> tuple[bool, str]:
    mode = os.environ.get(ENV, "auto")
    if mode == "torch":
        return False, f"{ENV}=torch"
    if mode != "auto":
        return False, f"{ENV} must be 'auto' or 'torch', got {mode!r}"
    try:
        cflags()
    except ValueError as e:
        return False, str(e)
    if hasattr(torch.ops, "kvfleet_cpu") and hasattr(torch.ops.kvfleet_cpu, "rms_norm"):
        return True, ""
    lib = build_dir()
    so = lib / "kvfleet_cpu_ops.so"
    try:
        if not so.exists():
            from torch.utils import cpp_extension

            _put_ninja_on_path()
            lib.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name="kvfleet_cpu_ops", sources=[str(p) for p in SOURCES], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
                               build_directory=str(lib), is_python_module=False, verbose=False)
        else:
            torch.ops.load_library(str(so))
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: keep the torch path
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return False, f"building the CPU kernels failed: {first[:300]}"
    return True, ""


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits in this environment's bin folder, which is
    not on PATH when the environment's python is run directly (as `make test` does)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d not in path] + path)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load():
        print(f"kvfleet CPU kernels ready in {build_dir()}")
        return 0
    print(f"kvfleet CPU kernels unavailable: {_state['why']}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
