"""`one_torch_thread`: a module fixture for tests that compare tokens with Hugging Face (use it with
`pytestmark = pytest.mark.usefixtures("one_torch_thread")` or autouse in the module).

Triton decides when it is first imported whether its own library functions are interpreted, so the
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


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread: on a shared 2-core machine OpenMP barriers across busy cores cost 5-20x."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
