"""`benchmarks/gpu_mamba.py` end to end: on a GPU when there is one, else through Triton's
interpreter on the CPU at tiny sizes (times then mean nothing; the code paths are the same)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_mamba.py"

pytestmark = pytest.mark.triton


def test_gpu_mamba_runs(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_mamba_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--device", device, "--batches", "2", "--warmup", "0", "--iters", "1", "--json"]
    assert module.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["op"], r["state_dtype"]) for r in rows] == [
        ("ssm_decode", "bfloat16"), ("ssm_decode", "float32"), ("conv1d_decode", "bfloat16"),
        ("gdn_decode", "bfloat16"), ("gdn_decode", "float32"),
    ]  # fmt: skip
    assert all(r["torch_us"] > 0 and r["triton_us"] > 0 for r in rows)
    # the kernels and the PyTorch route agree: float32 math on the same inputs, except that
    # PyTorch's conv computes in the weights' bfloat16 (a bf16 step at values of a few units)
    assert rows[0]["max_abs_diff"] < 1e-4 and rows[1]["max_abs_diff"] < 1e-4
    assert rows[2]["max_abs_diff"] < 0.1
    assert rows[4]["max_abs_diff"] < 1e-4  # the gated delta step, float32 pages
