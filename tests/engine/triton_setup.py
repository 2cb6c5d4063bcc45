"""Load the Triton kernels for tests: compiled on CUDA when TRITON_INTERPRET=0 is set explicitly and a
GPU is present (loadtest/gpu_check.sh), otherwise in Triton's interpreter on CPU tensors.

Triton decides at decoration time whether a kernel is interpreted, and reads the variable again while
launching, so it is set while the kernel modules are (re)imported and, through the `triton_mode` fixture
(use it autouse, module-scoped), while the tests of that module run; it is restored in between.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

KERNEL_MODULES = ("engine.kernels.kv_write", "engine.kernels.paged_decode", "engine.kernels.extend_attention",
                  "engine.attention.triton_backend")

COMPILED = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if COMPILED else "cpu"


def load_kernels() -> dict[str, object]:
    """Import the kernel modules in the mode this run needs (reloading them if imported the other way)."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if COMPILED else "1"
    try:
        from triton.runtime.interpreter import InterpretedFunction

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
