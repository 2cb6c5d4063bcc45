"""Triton decides when it is first imported whether its own library functions are interpreted, so the
Triton tests (tests/engine/kernels/test_triton_*.py, tests/engine/test_triton_engine.py) need
TRITON_INTERPRET=1 set before anything imports triton on machines without CUDA. This conftest, above both,
does it. loadtest/gpu_check.sh sets TRITON_INTERPRET=0 to run them compiled.
Nothing else in the engine tests uses Triton (the engine's "auto" backend is torch on CPUs).
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
