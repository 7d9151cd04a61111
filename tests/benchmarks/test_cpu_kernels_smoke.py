"""`benchmarks/cpu_kernels.py` runs every op through both paths, which agree, and reports each."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kernels.py"


def test_cpu_kernels_run(capsys, monkeypatch):
    from hybridkv.ops import native

    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    spec = importlib.util.spec_from_file_location("cpu_kernels_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setenv("HYBRIDKV_NATIVE", "1")  # the script sets it per run; restored after
    assert module.main(["--repeat", "1", "--threads", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == list(module.cases())
    assert len(rows) == 18
    assert module.GDN_PREFILL in module.cases() and module.SCAN_PREFILL in module.cases()
    assert module.per_token_us(rows, module.GDN_PREFILL) > 0  # the comparison the text prints
    for r in rows:
        assert r["torch_ms"] > 0 and r["native_ms"] > 0
        # the two paths computed the same thing (float32 rounding apart)
        assert r["rel_diff"] < 1e-4, r
