"""CPU kernel benchmark: the native kernels (hybridkv.ops.native) vs the PyTorch path, per op.

Shapes are those of the ~100M GraniteMoeHybrid in benchmarks/throughput.py (hidden 768, Mamba2
with 24 heads of 64 x 64 state, conv width 4, SwiGLU 1536): a prefill step of 2048 tokens (8
requests of 256) and a decode step of 64 requests. The gated delta rule (Qwen3-Next, Qwen3.5)
runs at Qwen3-Next's proportions scaled to hidden 768: 12 key heads and 24 value heads of 64
(key dim = hidden, value dim = 2 x hidden, as in Qwen3-Next-80B), so its state, 24 x 64 x 64
floats per request and layer, equals the Mamba2 layer's and the two prefill scans compare per
token at equal state size. The Mamba1 scan (Mamba, FalconMamba, Jamba) runs at the Mamba1
proportions of hidden 768: d_inner 1536 (expand 2), d_state 16. Each op runs through its public
function in hybridkv.ops / hybridkv.layers (the state ops through the ops classes the plan
chooses between: native or torch), once with the native kernels and once with
`HYBRIDKV_NATIVE=0`, alternating, on the same inputs; medians of `--repeat` runs. float32
unless a row says bf16, `--threads` threads. Before timing, both paths run once on fresh copies
of the same inputs and the largest difference of their outputs, relative to the largest output,
is reported (`rel_diff`).

    python benchmarks/cpu_kernels.py [--repeat 15] [--threads 2] [--calls 1] [--json]

`--calls N`: each sample is the mean of N calls in a row (the decode rows take microseconds to
a few milliseconds: single calls are noisy on a shared machine). The table starts with the CPU
record (`hybridkv.ops.native.cpu.line()`): which instruction sets the native build has, e.g.
`HYBRIDKV_NATIVE_MARCH=x86-64-v3` for an AVX2-only CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridkv.forward_batch import StateMetadata  # noqa: E402
from hybridkv.layers.mlp import silu_and_mul  # noqa: E402
from hybridkv.ops import native  # noqa: E402
from hybridkv.ops.gated_delta import gdn_gates  # noqa: E402
from hybridkv.ops.gdn_ops import NativeGDNOps, TorchGDNOps  # noqa: E402
from hybridkv.ops.mamba1_ops import Mamba1Params, NativeMamba1Ops, TorchMamba1Ops  # noqa: E402
from hybridkv.ops.mamba2_ops import NativeMamba2Ops, ScanParams, TorchMamba2Ops  # noqa: E402
from hybridkv.ops.native import cpu  # noqa: E402
from hybridkv.ops.norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, D_STATE, CONV_WIDTH, INTER = 768, 24, 64, 64, 4, 1536
CONV_DIM = HEADS * HEAD_DIM + 2 * D_STATE
GDN_K_HEADS, GDN_V_HEADS, GDN_DIM = 12, 24, 64  # Hk, Hv, K = V: Hv * K * V = HEADS * 64 * 64
GDN_PREFILL, SCAN_PREFILL = "gated delta rule, prefill 8 x 256", "mamba2 scan, prefill 8 x 256"
M1_INNER, M1_STATE, M1_RANK = 2 * HIDDEN, 16, HIDDEN // 16  # Mamba1: d_inner, d_state, dt_rank


def mamba2_ops() -> TorchMamba2Ops:
    """The ops class a Mamba2 group runs: native unless `HYBRIDKV_NATIVE=0` (read per call)."""
    return NativeMamba2Ops() if native.library() is not None else TorchMamba2Ops()


def gdn_ops() -> TorchGDNOps:
    """The ops class a gated-delta-net group runs: native unless `HYBRIDKV_NATIVE=0`."""
    return NativeGDNOps() if native.library() is not None else TorchGDNOps()


def mamba1_ops() -> TorchMamba1Ops:
    """The ops class a Mamba1 group runs: native unless `HYBRIDKV_NATIVE=0`."""
    return NativeMamba1Ops() if native.library() is not None else TorchMamba1Ops()


def state_problem(num_reqs: int, tokens_each: int, gen: torch.Generator) -> dict:
    """Packed requests with initial states on distinct pages."""
    lens = torch.full((num_reqs,), tokens_each)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    return dict(
        pages=torch.randperm(num_reqs * 2, generator=gen)[:num_reqs],
        has=torch.ones(num_reqs, dtype=torch.bool),
        qsl=qsl,
        max_len=tokens_each,
        num_pages=num_reqs * 2,
    )


def _meta(p: dict) -> StateMetadata:
    return StateMetadata(p["pages"], p["has"], p["qsl"], p["max_len"])


def scan_case(num_reqs: int, tokens_each: int, gen: torch.Generator) -> Callable[[], object]:
    p = state_problem(num_reqs, tokens_each, gen)
    t = num_reqs * tokens_each
    x = torch.randn(t, HEADS, HEAD_DIM, generator=gen)
    dt = torch.randn(t, HEADS, generator=gen)
    A, D = -torch.rand(HEADS, generator=gen) - 0.1, torch.randn(HEADS, generator=gen)
    B, C = torch.randn(t, 1, D_STATE, generator=gen), torch.randn(t, 1, D_STATE, generator=gen)
    params = ScanParams(A, D, torch.zeros(HEADS), 128, (0.0, float("inf")))
    state = torch.randn(p["num_pages"], HEADS, HEAD_DIM, D_STATE, generator=gen)
    return lambda: mamba2_ops().scan(x, dt, B, C, state, _meta(p), params, torch.float32)


def conv_case(num_reqs: int, tokens_each: int, gen: torch.Generator) -> Callable[[], object]:
    p = state_problem(num_reqs, tokens_each, gen)
    # x: the conv's columns of in_proj's output, rows strided as in the mixer
    projected = torch.randn(num_reqs * tokens_each, INTER + CONV_DIM + HEADS, generator=gen)
    x = projected[:, INTER : INTER + CONV_DIM]
    weight = torch.randn(CONV_DIM, CONV_WIDTH, generator=gen)
    bias = torch.randn(CONV_DIM, generator=gen)
    state = torch.randn(p["num_pages"], CONV_DIM, CONV_WIDTH - 1, generator=gen)
    return lambda: mamba2_ops().conv1d(x, weight, bias, state, _meta(p), "silu")


def gdn_case(
    num_reqs: int, tokens_each: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> Callable[[], object]:
    """The gated delta rule of a layer: q, k, v as column slices of the conv's output (token
    rows strided, as in the layer), gates from `gdn_gates`; inputs and state in `dtype`."""
    p = state_problem(num_reqs, tokens_each, gen)
    t, hk, hv, d = num_reqs * tokens_each, GDN_K_HEADS, GDN_V_HEADS, GDN_DIM
    qkv = torch.randn(t, (2 * hk + hv) * d, generator=gen).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hk * d, hk * d, hv * d], dim=-1))
    a, b = torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)
    g, beta = gdn_gates(a, b, torch.randn(hv, generator=gen) * 0.5, torch.zeros(hv))
    state = torch.randn(p["num_pages"], hv, d, d, generator=gen).to(dtype)
    return lambda: gdn_ops().rule(q, k, v, g, beta, state, _meta(p))


def row_cases(rows: int, gen: torch.Generator) -> dict[str, Callable[[], object]]:
    x, h = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, HIDDEN, generator=gen)
    w = torch.randn(HIDDEN, generator=gen)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen)
    y, wi = torch.randn(rows, INTER, generator=gen), torch.randn(INTER, generator=gen)
    gate = torch.randn(rows, INTER + CONV_DIM + HEADS, generator=gen)[:, :INTER]  # strided
    return {
        f"rms_norm [{rows}, {HIDDEN}]": lambda: rms_norm(x, w, 1e-5),
        f"add + rms_norm [{rows}, {HIDDEN}]": lambda: add_rms_norm(x, h, 1.0, w, 1e-5),
        f"silu_and_mul [{rows}, {2 * INTER}]": lambda: silu_and_mul(gate_up),
        f"gated_rms_norm [{rows}, {INTER}]": lambda: gated_rms_norm(y, gate, wi, 1e-5, INTER),
    }


def mamba1_case(num_reqs: int, tokens_each: int, gen: torch.Generator) -> Callable[[], object]:
    """The Mamba1 scan of a layer: x (the conv's output) and dt (dt_proj's) [T, Di], z a column
    slice of in_proj's output and B, C of x_proj's (token rows strided, as in the mixer)."""
    p = state_problem(num_reqs, tokens_each, gen)
    t, di, n = num_reqs * tokens_each, M1_INNER, M1_STATE
    x, dt = torch.randn(t, di, generator=gen), torch.randn(t, di, generator=gen)
    z = torch.randn(t, 2 * di, generator=gen)[:, di:]
    dbc = torch.randn(t, M1_RANK + 2 * n, generator=gen)
    B, C = dbc[:, M1_RANK : M1_RANK + n], dbc[:, M1_RANK + n :]
    A = -torch.exp(torch.randn(di, n, generator=gen))
    params = Mamba1Params(A, torch.randn(di, generator=gen), torch.randn(di, generator=gen))
    state = torch.randn(p["num_pages"], di, n, generator=gen)
    return lambda: mamba1_ops().scan(x, dt, B, C, z, state, _meta(p), params, torch.float32)


def cases() -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    out = {
        "mamba2 scan, prefill 8 x 256": scan_case(8, 256, gen),
        "mamba2 scan, decode 64 x 1": scan_case(64, 1, gen),
        "conv1d + silu, prefill 8 x 256": conv_case(8, 256, gen),
        "conv1d + silu, decode 64 x 1": conv_case(64, 1, gen),
        GDN_PREFILL: gdn_case(8, 256, gen),
        "gated delta rule, decode 64 x 1": gdn_case(64, 1, gen),
        "gated delta rule bf16, prefill 8 x 256": gdn_case(8, 256, gen, torch.bfloat16),
        "gated delta rule bf16, decode 64 x 1": gdn_case(64, 1, gen, torch.bfloat16),
        "mamba1 scan, prefill 8 x 256": mamba1_case(8, 256, gen),
        "mamba1 scan, decode 64 x 1": mamba1_case(64, 1, gen),
    }
    out.update(row_cases(2048, gen))
    out.update(row_cases(64, gen))
    return out


def _flat(out: object) -> torch.Tensor:
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([t.reshape(-1).double() for t in parts])


def agreement() -> dict[str, float]:
    """Per op: max |native - torch| / max |torch| over the outputs of one call each, on two
    identical sets of inputs (the state ops update their states in place)."""
    os.environ["HYBRIDKV_NATIVE"] = "0"
    reference = {name: _flat(fn()) for name, fn in cases().items()}
    os.environ["HYBRIDKV_NATIVE"] = "1"
    diffs = {}
    for name, fn in cases().items():
        ref = reference[name]
        diffs[name] = float((_flat(fn()) - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    return diffs


def time_once(fn: Callable[[], object], use_native: bool, calls: int = 1) -> float:
    """Seconds per call, the mean of `calls` calls in a row."""
    os.environ["HYBRIDKV_NATIVE"] = "1" if use_native else "0"
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--calls", type=int, default=1, help="calls per sample (their mean time)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if native.library() is None:
        print("native kernels unavailable here (no C compiler, or HYBRIDKV_NATIVE=0)")
        return 2
    rows = []
    with torch.no_grad():
        diffs = agreement()
        for name, fn in cases().items():
            times: dict[bool, list[float]] = {True: [], False: []}
            for use_native in (True, False):  # warm-up
                time_once(fn, use_native)
            for _ in range(args.repeat):
                for use_native in (True, False):
                    times[use_native].append(time_once(fn, use_native, args.calls))
            torch_ms = statistics.median(times[False]) * 1e3
            native_ms = statistics.median(times[True]) * 1e3
            rows.append(
                dict(op=name, torch_ms=torch_ms, native_ms=native_ms,
                     speedup=torch_ms / native_ms, rel_diff=diffs[name])
            )  # fmt: skip
    os.environ.pop("HYBRIDKV_NATIVE", None)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(cpu.line())  # (HYBRIDKV_NATIVE_MARCH=x86-64-v3: the AVX2 build)
    print(f"{'op':40s} {'torch ms':>10s} {'native ms':>10s} {'speedup':>8s} {'rel_diff':>9s}")
    for r in rows:
        print(
            f"{r['op']:40s} {r['torch_ms']:10.3f} {r['native_ms']:10.3f} {r['speedup']:7.2f}x"
            f" {r['rel_diff']:9.1e}"
        )
    gdn, scan = per_token_us(rows, GDN_PREFILL), per_token_us(rows, SCAN_PREFILL)
    print(
        f"native prefill per token at equal state ({HEADS * HEAD_DIM * D_STATE} floats): "
        f"gated delta rule {gdn:.2f} us, mamba2 scan {scan:.2f} us, ratio {gdn / scan:.2f}"
    )
    return 0


def per_token_us(rows: list[dict], op: str) -> float:
    """The native time of a prefill row (2048 tokens) per token, in microseconds."""
    (row,) = (r for r in rows if r["op"] == op)
    return row["native_ms"] * 1e3 / (8 * 256)


if __name__ == "__main__":
    raise SystemExit(main())
