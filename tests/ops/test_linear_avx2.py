"""The AVX2 paths of the native linears (f32_linear.c, bf16_linear.c, int8_linear.c), whatever
this machine's own build is: a child process builds the library for x86-64-v3 (AVX2 + FMA +
F16C, no AVX-512: HYBRIDKV_NATIVE_MARCH) and checks every kernel against a float64 reference
within float32 accumulation error (bfloat16 outputs: plus one rounding) on odd shapes: K not a
multiple of 8, 16 or 32 (and longer than a 256-value piece of the GEMM), N not a multiple of
any tile (8, 4, 2 weight rows; the GEMM's 6), M = 1..40 and 70 (every tile and last tile, the
tiles' 20-row limit and the GEMM's panels of 16 rows and of 8 or fewer past them), with and
without bias, x rows at a stride, 1 and 2 threads; a NaN and an infinity in x reaching their
rows only; and its probes. A second child does the
same for the portable build (x86-64: plain loops, probes saying no fast path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.ops.native import cpu

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
import torch
from hybridkv.ops import native
from hybridkv.ops.native import bf16_linear, cpu, f32_linear, int8_linear
from hybridkv.layers.quantization import dequantize_rows, quantize_rows

U = 2.0**-24  # float32 unit roundoff
HALF = 2.0**-8  # bfloat16: a rounding moves a value by at most this, relative
lib = native.library()
probes = {name: int(getattr(lib.cdll, name)()) for name in
          ("hkv_f32_linear_fast", "hkv_bf16_linear_fast", "hkv_int8_vectorized")}
worst, cases = {}, 0


def note(name, y, exact, bound):
    global cases
    cases += 1
    ratio = float(((y.double() - exact).abs() / bound).max()) if y.numel() else 0.0
    worst[name] = max(worst.get(name, 0.0), ratio)


def check(m, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, k + 7, generator=g)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    b = torch.randn(n, generator=g) if bias else None
    for dtype, small, fn in ((torch.float32, f32_linear, lib.hkv_f32_linear),
                             (torch.bfloat16, bf16_linear, lib.hkv_bf16_linear)):
        x = rows.to(dtype)[:, 3 : 3 + k]  # row stride k + 7, unaligned start
        wd, bd = w.to(dtype), None if b is None else b.to(dtype)
        y = small.run(fn, x, wd, bd)
        exact = x.double() @ wd.double().T
        mag = x.double().abs() @ wd.double().abs().T
        if bd is not None:
            exact, mag = exact + bd.double(), mag + bd.double().abs()
        bound = mag * (k + 2) * U + 1e-30
        if dtype == torch.bfloat16:
            bound = bound * (1 + HALF) + HALF * exact.abs()
        note(f"{dtype}", y, exact, bound)
    q, scale = quantize_rows(w)
    wq = dequantize_rows(q, scale).double()
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype)[:, 3 : 3 + k]
        y = int8_linear.run(lib.hkv_int8_linear, x, q, scale)
        exact = x.double() @ wq.T
        bound = (x.double().abs() @ wq.abs().T) * (k + 3) * U + 1e-30
        if dtype == torch.bfloat16:
            bound = bound * (1 + HALF) + HALF * exact.abs()
        note(f"int8 {dtype}", y, exact, bound)


seed = 0
for threads in (1, 2):
    torch.set_num_threads(threads)
    for k, n in ((5, 3), (37, 13), (100, 37), (771, 29)):
        for m in [*range(1, 41), 70]:
            for bias in (False, True):
                seed += 1
                check(m, k, n, bias, seed)
    for m in (1, 2, 3, 7, 20, 21, 40):  # weights past every parallel threshold
        seed += 1
        check(m, 771, 331, True, seed)
# a NaN and an infinity in x reach their rows only (tiles: M = 5; the GEMM: M = 40)
isolated = 0
for m in (5, 40):
    rows, w = torch.randn(m, 100), torch.randn(37, 100)
    q, scale = quantize_rows(w)
    runs = [
        (torch.float32, lambda x: f32_linear.run(lib.hkv_f32_linear, x, w, None)),
        (torch.bfloat16, lambda x: bf16_linear.run(lib.hkv_bf16_linear, x, w.bfloat16(), None)),
        (torch.float32, lambda x: int8_linear.run(lib.hkv_int8_linear, x, q, scale)),
        (torch.bfloat16, lambda x: int8_linear.run(lib.hkv_int8_linear, x, q, scale)),
    ]
    for dtype, run in runs:
        x = rows.to(dtype)
        bad = x.clone()
        bad[1, 7], bad[m - 2, 50] = float("nan"), float("inf")
        clean, y = run(x), run(bad)
        keep = [i for i in range(m) if i not in (1, m - 2)]
        assert y[1].isnan().all() and not y[m - 2].isfinite().any()
        assert torch.equal(y[keep], clean[keep])
        isolated += 1
print("RESULT " + json.dumps({"probes": probes, "built": sorted(cpu.record().built),
                              "worst": worst, "cases": cases, "isolated": isolated}))
"""


def run_child(march: str) -> dict:
    env = {**os.environ, "HYBRIDKV_NATIVE_MARCH": march}
    env.pop("HYBRIDKV_NATIVE", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


CASES = 2 * (4 * 41 * 2 + 7) * 4  # threads x (shapes x M x bias + the large shape) x kernels


@pytest.mark.skipif(
    "avx2" not in cpu.record().has, reason="this CPU has no AVX2 (+ FMA, F16C) to run the build"
)
def test_avx2_build_matches_float64_on_odd_shapes():
    result = run_child("x86-64-v3")
    built = set(result["built"])
    assert "avx2" in built and "avx512" not in built and "avx512_bf16" not in built
    assert result["probes"] == {
        "hkv_f32_linear_fast": 1, "hkv_bf16_linear_fast": 1, "hkv_int8_vectorized": 1,
    }  # fmt: skip
    assert result["cases"] == CASES
    assert set(result["worst"]) == {
        "torch.float32", "torch.bfloat16", "int8 torch.float32", "int8 torch.bfloat16",
    }  # fmt: skip
    assert all(ratio <= 1.0 for ratio in result["worst"].values()), result["worst"]
    assert result["isolated"] == 8


def test_portable_build_has_no_fast_path_and_matches_float64():
    result = run_child("x86-64")
    assert not {"avx2", "avx512"} & set(result["built"])
    assert set(result["probes"].values()) == {0}
    assert result["cases"] == CASES
    assert all(ratio <= 1.0 for ratio in result["worst"].values()), result["worst"]
    assert result["isolated"] == 8
