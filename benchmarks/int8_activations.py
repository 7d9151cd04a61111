"""8-bit activations against hybridkv's int8 and bfloat16 linears, one layer.

    python benchmarks/int8_activations.py [--shape 768 3224] [--rows 1 4 16 32 64 512]

hybridkv's `quantization="int8"` is weight-only: int8 weights, float32 (or bfloat16) x. Its
prefill rows on an AMX Xeon run a bfloat16 GEMM after converting the weight (`int8_matmul`),
about 1.5x the bfloat16 layer (benchmarks/README.md). llama.cpp's Q8_0 and vLLM / SGLang's
CPU w8a8 round activations to 8 bits and multiply int8 by int8 (AMX-INT8, VNNI). This script
times, per rows of x (float32), medians of repeated calls on the machine's threads:

- `bf16`: the bfloat16 layer (`F.linear`, x rounded first);
- `int8 now`: hybridkv's int8 layer as it runs today (`int8_matmul`: the native kernel up to
  its rows, then the converted-weight bfloat16 GEMM);
- `w8a8 gemm`: oneDNN's int8 x int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, weight
  prepacked once) on x already quantized: the floor of that route;
- `w8a8 all`: the same plus per-row dynamic quantization of x and per-row rescaling of the
  output in PyTorch ops (what a Python implementation would pay; a native pass would cut it);
- `hkv w8a8`: hybridkv's quantization="w8a8" linear (`w8a8_linear.c` on AMX-INT8: the
  rounding of x, the tiles and the scaling in one native call; the reference elsewhere);
- `rel err`: w8a8's largest error relative to the exact product with the int8 weight.

Needs a PyTorch whose oneDNN has the quantized linear (x86-64; it reports where not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridkv.layers.quantization import (  # noqa: E402
    W8A8_LINEAR,
    dequantize_rows,
    int8_matmul,
    pack_w8a8,
    quantize_rows,
)


def median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (int8 [M, K], scale float32 [M, 1]): symmetric, per row."""
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[768, 3224], metavar=("IN", "OUT"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    qlinear = getattr(torch.ops.onednn, "qlinear_pointwise", None)
    if qlinear is None:
        print("int8_activations.py: this PyTorch has no onednn.qlinear_pointwise", file=sys.stderr)
        return 2
    k, n = args.shape
    q, scale = quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))
    w_bf16 = dequantize_rows(q, scale).to(torch.bfloat16)
    packed = torch.ops.onednn.qlinear_prepack(q, [max(args.rows), k])
    w_scale, w_zero = scale.float(), torch.zeros(n, dtype=torch.long)
    wp = pack_w8a8(q)

    def gemm(xq: torch.Tensor) -> torch.Tensor:
        return qlinear(xq, 1.0, 0, packed, w_scale, w_zero, None, 1.0, 0, torch.float32,
                       "none", [], "")  # fmt: skip

    def w8a8(x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_activations(x)
        return gemm(xq).mul_(xs)

    print(f"{k} -> {n}, {torch.get_num_threads()} threads, microseconds (medians of {args.reps})")
    hkv = W8A8_LINEAR.chain(torch.device("cpu"), torch.float32)
    print(f"hkv w8a8: {hkv.describe()}")
    print(f"{'rows':>5} {'bf16':>8} {'int8 now':>9} {'w8a8 gemm':>10} {'w8a8 all':>9} "
          f"{'hkv w8a8':>9} {'now/bf16':>9} {'all/bf16':>9} {'hkv/bf16':>9} "
          f"{'rel err':>8}")  # fmt: skip
    for m in args.rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        xq, _ = quantize_activations(x)
        exact = x @ dequantize_rows(q, scale).T
        err = float((w8a8(x) - exact).abs().max() / exact.abs().max())
        t_bf16 = median_us(lambda x=x: F.linear(x.to(torch.bfloat16), w_bf16), args.reps)
        t_now = median_us(lambda x=x: int8_matmul(x, q, scale), args.reps)
        t_gemm = median_us(lambda xq=xq: gemm(xq), args.reps)
        t_all = median_us(lambda x=x: w8a8(x), args.reps)
        run = hkv.for_rows(m)
        t_hkv = median_us(lambda x=x, run=run: run(x, wp, scale, n, k), args.reps)
        print(f"{m:5d} {t_bf16:8.0f} {t_now:9.0f} {t_gemm:10.0f} {t_all:9.0f} {t_hkv:9.0f} "
              f"{t_now / t_bf16:9.2f} {t_all / t_bf16:9.2f} {t_hkv / t_bf16:9.2f} "
              f"{err:8.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
