"""The native kernels built for other x86-64 targets than this CPU's best: x86-64-v3 (AVX2 + FMA
+ F16C, what AMD Zen 2/3 and most laptops run) and x86-64 (the portable C loops).

The rest of the suite runs the library built for this machine (`-march=native`: AVX-512 and AMX
on the development box), so the 8-lane AVX2 paths (hkv_common.h's `#if HKV_AVX2` helpers, the
`HKV_AVX2` branches of decode_attention.c, kernels.c, gdn_decode.c) and the plain loops would
go untested there. Here each target runs in a subprocess with `HYBRIDKV_NATIVE_MARCH` set (the
library is built once per process, for that target, and cached by its flags) through a
compact set of the op tests of the kernels with such paths, against their references:
decode attention (float32 and bfloat16 caches; odd head counts; head dims that are not
multiples of 8 or 16; block tables spanning many kernel blocks, lengths ending anywhere in a
block; windows, sinks and logit soft-capping; a request split over two threads), the gated
delta rule's decode step (with its fused gated norm), the Mamba1 scan, silu-and-mul, the gated
RMSNorm and relu2; and that hkv_silu8 gives hkv_silu's bits, specials included. A target the
CPU lacks is skipped, as is a machine without a compiler.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.ops.test_native import needs_compiler

ROOT = Path(__file__).resolve().parents[2]
# target: (the CPU flags it needs, the instruction sets the CPU record must say it was built for)
TARGETS = {
    "x86-64-v3": ({"avx2", "fma", "f16c"}, {"avx2"}),
    "x86-64": (set(), set()),
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@needs_compiler
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64")
@pytest.mark.parametrize("march", list(TARGETS))
def test_kernels_built_for_another_target(march):
    needs, _ = TARGETS[march]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    env = {**os.environ, "HYBRIDKV_NATIVE_MARCH": march}
    env.pop("HYBRIDKV_NATIVE", None)
    code = "from tests.ops.test_native_targets import run_checks; run_checks()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"{len(checks())} checks passed" in proc.stdout, proc.stdout[-3000:]


def silu_lanes_equal_the_scalar_tail() -> None:
    """Rows of 9 equal gates times 1 through hkv_silu_mul_f32: lanes 0..7 go through its
    8-lane loop (hkv_silu8 where the build has AVX2), lane 8 through hkv_silu, so both must
    give the same bits; the values are torch's silu within float32 rounding."""
    from hybridkv.ops import native

    special = [
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        -86.9,
        -87.0,
        -87.5,
        -88.0,
        -100.0,
        -1e30,
        -3e38,
        3e38,
        1e30,
        88.7,
        float("inf"),
        -float("inf"),
        float("nan"),
    ]
    values = torch.cat([torch.linspace(-120.0, 40.0, 4001), torch.tensor(special)])
    gate = values[:, None].expand(-1, 9).contiguous()
    up, out = torch.ones_like(gate), torch.empty_like(gate)
    fn = native.library().cdll.hkv_silu_mul_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_int64]
    fn(gate.data_ptr(), 9, up.data_ptr(), 9, out.data_ptr(), out.shape[0], 9)
    bits = out.view(torch.int32)
    assert torch.equal(bits[:, :8], bits[:, 8:].expand(-1, 8))
    finite = values.isfinite()
    want = torch.nn.functional.silu(values.double())
    torch.testing.assert_close(out[finite, 8].double(), want[finite], rtol=1e-6, atol=1e-30)
    assert out[values == -float("inf"), 8].isnan().all()  # -inf * 0, as torch's silu
    assert out[values.isnan(), 8].isnan().all()
    assert out[values == float("inf"), 8].eq(float("inf")).all()


def gated_norm_matches() -> None:
    """The gated RMSNorm (float32, and bfloat16 rows into a float32 scan's norm) with groups of
    12 and 20 channels (8-lane vectors and a tail), both gate orders."""
    from hybridkv.ops.norm import _gated_rms_norm, gated_rms_norm

    g = torch.Generator().manual_seed(3)
    for group, groups in ((12, 2), (20, 3)):
        channels = group * groups
        for dtype in (torch.float32, torch.bfloat16):
            for before in (False, True):
                x = (torch.randn(5, channels, generator=g) * 3).to(dtype)
                z = (torch.randn(5, channels + 7, generator=g) * 4)[:, :channels].to(dtype)
                w = torch.randn(channels, generator=g) + 1
                wt = w.to(dtype)
                args = (group, before, before)
                out = gated_rms_norm(x, z, wt, 1e-5, *args)
                ref = _gated_rms_norm(x, z, wt, 1e-5, *args)
                tol = 2e-6 if dtype == torch.float32 else 2**-7
                torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=1e-6)


def checks() -> list:
    """(name, function) pairs: the existing op tests of the kernels with per-target paths, at a
    compact set of their parameters, and the checks above."""
    from tests.ops import test_decode_attention as da
    from tests.ops import test_elementwise as ew
    from tests.ops import test_gdn_decode as gd
    from tests.ops import test_mamba1 as m1

    out = [("silu lanes", silu_lanes_equal_the_scalar_tail), ("gated norm", gated_norm_matches)]
    # heads, kv_heads, head_dim: odd groups and head counts, dims not multiples of 8 or 16
    shapes = [(8, 2, 128), (6, 2, 80), (10, 2, 24), (16, 2, 32), (7, 1, 40), (6, 3, 7),
              (5, 5, 20), (9, 3, 100)]  # fmt: skip
    m1_cases = [(70, 5, m1.MIXED), (128, 32, dict(lens=[20, 1, 5], has_init=[True, True, False]))]
    for dtype in (torch.float32, torch.bfloat16):
        for shape, kbs in itertools.product(shapes, (3, 16)):  # lengths 1, 17, 45, 200, 33
            out.append(
                (
                    f"attention {shape} {kbs}",
                    partial(da.test_matches_float64_softmax, shape, kbs, dtype),
                )
            )
        for window, sinks in ((5, True), (40, False)):
            out.append(
                (
                    f"attention window {window}",
                    partial(da.test_windows_and_sinks, window, sinks, dtype),
                )
            )
            out.append(
                (
                    f"attention softcap window {window}",
                    partial(da.test_softcap_with_windows_and_sinks, window, sinks, dtype),
                )
            )
        for shape in ((6, 2, 80), (7, 1, 40), (6, 3, 7)):
            out.append(
                (
                    f"attention softcap {shape}",
                    partial(da.test_softcap_matches_float64_softmax, shape, 16, dtype),
                )
            )
        out.append(("attention softcap extremes", partial(da.test_softcap_extremes, dtype)))
        for softcap in (None, 0.5):
            out.append(
                (
                    f"attention on two threads (softcap {softcap})",
                    partial(da.test_long_request_split_over_two_threads, dtype, None, softcap),
                )
            )
        for state in (torch.float32, torch.bfloat16):
            for dims in ((1, 3, 24, 40), (1, 2, 33, 17), (2, 2, 128, 128)):
                out.append(
                    (
                        f"gdn decode {dims}",
                        partial(
                            gd.test_decode_matches_float64_and_the_reference, *dims, dtype, state
                        ),
                    )
                )
            for di, n, case in m1_cases:
                out.append(
                    (
                        f"mamba1 {di} x {n}",
                        partial(m1.test_native_matches_reference, di, n, case, dtype, state),
                    )
                )
        for test in (
            ew.test_silu_mul_of_separate_projections,
            ew.test_relu2_rounds_as_pytorch,
            ew.test_relu2_keeps_nan_as_pytorch,
            ew.test_mul_of_projection_slices,
        ):
            out.append((test.__name__, partial(test, dtype)))
    for hv, vd in ((3, 40), (4, 128)):
        out.append(
            (
                f"gdn decode norm {hv} x {vd}",
                partial(gd.test_fused_gated_norm_equals_rule_then_norm, hv, vd),
            )
        )
    out.append(("gdn decode extreme gates", gd.test_extreme_gates))
    return [(f"{name} {getattr(fn, 'args', '')}", fn) for name, fn in out]


def run_checks() -> None:
    """In the subprocess: the library built for HYBRIDKV_NATIVE_MARCH, then every check."""
    from hybridkv.ops import native
    from hybridkv.ops.native import cpu

    march = os.environ["HYBRIDKV_NATIVE_MARCH"]
    assert native.library() is not None, f"no native library built for {march}"
    record = cpu.record()
    built = set(record.built) & {"avx2", "avx512", "amx_bf16"}
    assert built == TARGETS[march][1], (march, record.line())
    torch.set_num_threads(1)
    for name, fn in checks():
        try:
            fn()
        except Exception as e:
            raise AssertionError(f"{march}: {name}") from e
    print(f"{len(checks())} checks passed ({record.line()})")
