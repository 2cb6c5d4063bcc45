"""Load the Triton kernels for tests: compiled on CUDA when TRITON_INTERPRET=0 is set explicitly and a
GPU is present (loadtest/gpu_check.sh), otherwise in Triton's interpreter on CPU tensors.

Triton decides whether a function is interpreted when it is decorated (its own library functions: when
triton is first imported; tests/engine/conftest.py sets TRITON_INTERPRET=1 early for that) and reads the
variable again while launching. So it is set while the kernel modules are (re)imported and, through the
`triton_mode` fixture (use it module-wide), while the tests of that module run.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

KERNEL_MODULES = ("engine.kernels.kv_write", "engine.kernels.fused_layers", "engine.kernels.paged_decode", "engine.kernels.extend_attention",
                  "engine.kernels.lora",
                  "engine.attention.triton_backend")

COMPILED = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if COMPILED else "cpu"


def load_kernels() -> dict[str, object]:
    """Import the kernel modules in the mode this run needs (reloading them if imported the other way)."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if COMPILED else "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if not COMPILED and isinstance(tl.standard.sum, JITFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its library functions "
                               "cannot run in the interpreter; set TRITON_INTERPRET=1 in the environment "
                               "(tests/engine/conftest.py does it on machines without CUDA)")
        mods = [importlib.import_module(name) for name in KERNEL_MODULES]
        interpreted = isinstance(mods[0]._kv_write_kernel, InterpretedFunction)
        if interpreted == COMPILED:
            mods = [importlib.reload(m) for m in mods]
        return {m.__name__.rsplit(".", 1)[1]: m for m in mods}
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


@pytest.fixture(scope="module")
def triton_mode():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0" if COMPILED else "1")
        yield DEVICE
