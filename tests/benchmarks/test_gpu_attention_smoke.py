"""`benchmarks/gpu_attention.py` end to end at tiny shapes: on a GPU when there is one, else
through Triton's interpreter on the CPU (times then mean nothing; the code paths are the same)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_attention.py"

pytestmark = pytest.mark.triton


def test_gpu_attention_runs_with_sweep(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_attention_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report_file = tmp_path / "report.json"
    argv = ["--device", device, "--batch", "2", "--context", "40", "--prefill-chunk", "8",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--kernel-block-sizes", "16",
            "32", "--blocks-per-page", "1", "3", "--warmup", "0", "--iters", "1", "--sweep",
            "--json-out", str(report_file)]  # fmt: skip
    assert module.main(argv) == 0  # includes the spot check against the PyTorch reference
    table = capsys.readouterr().out
    assert "launch sweep" in table and "target decode" in table
    report = json.loads(report_file.read_text())
    rows = report["rows"]
    assert [(r["kernel_block_size"], r["blocks_per_page"]) for r in rows] == [
        (16, 1), (16, 3), (32, 1), (32, 3)
    ]  # fmt: skip
    assert all(r["decode_us"] > 0 and r["prefill_ms"] > 0 for r in rows)
    assert set(report["targets"]["decode_spread_across_blocks_per_page"]) == {"16", "32"}
    sweep = report["sweep"]
    assert len(sweep) == 2 * (len(module.DECODE_SWEEP) + len(module.PREFILL_SWEEP))
    assert not [r for r in sweep if "error" in r]
    assert all(r["ms"] > 0 for r in sweep)
    # every tiling computes what the default one does (bf16 outputs: a rounding step apart)
    assert max(r["max_abs_diff"] for r in sweep) < 2e-2
