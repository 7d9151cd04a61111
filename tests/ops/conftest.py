"""Run Triton kernels through the interpreter when there is no CUDA device.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test
module of this folder imports a kernels module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Run a test with the native CPU kernels (hybridkv.ops.native) and with the PyTorch path."""
    from hybridkv.ops import native

    if request.param == "torch":
        monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    elif native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    return request.param
