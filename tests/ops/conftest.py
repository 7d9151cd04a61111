"""Run Triton kernels through the interpreter when there is no CUDA device.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test
module of this folder imports a kernels module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
