"""The native bfloat16 linear for small batches (issue 19) against oneDNN's packed linears, on
the linear shapes of the 100m GraniteMoeHybrid of benchmarks/throughput.py, weights out of cache.

For each shape [K -> N], thread count (`--threads`) and M (`--ms`), microseconds per call
(median of `--repeats` passes; a pass calls every weight of a pool once) of:
- fp32 oneDNN: PackedLinear's float32 path (`_linear_pointwise` on the packed weight), what a
  float32 model runs;
- bf16 oneDNN: the same for bfloat16, what a bfloat16 model ran before this kernel;
- bf16 native: `hybridkv/ops/native/bf16_linear.c` on the unpacked weight, what PackedLinear
  runs now up to SMALL_M rows.
`--fp32`: the float32 kernel instead (issue 19, fp32 native linear), three ways again:
- fp32 oneDNN: as above;
- fp32 native: `hybridkv/ops/native/f32_linear.c` on the unpacked weight, what PackedLinear runs
  for float32 up to its SMALL_M rows;
- read: `w.sum()` over the same unpacked weights (PyTorch's vectorised reduction on the same
  threads), the plain read that the M = 1 stream is bounded by;
GB/s of each (4 bytes a value), and native/oneDNN: fp32 oneDNN's time over the native kernel's.
The weights of each are a pool of distinct copies of at least `--pool-mib` MiB (default 128,
four times the 32 MiB L3; at least 4 copies), so every call streams its weight from memory.
GB/s is the weight bytes streamed per call over its time (bf16: 2 bytes a value, fp32: 4);
native/oneDNN is bf16 oneDNN's time over the native kernel's; bf16/fp32 is fp32 oneDNN's time
over the native kernel's. The three run alternately, pass by pass, on the same input rows.

`--layers`: each precision's layer as the engine runs it now against what it ran before the
native kernels took it, on any build (AVX-512, or an AVX2 one: run under the AVX2 simulation,
`HYBRIDKV_NATIVE_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2`, where oneDNN has no bfloat16 and PyTorch's matmul its AVX2
kernels), microseconds per call at each M:
- fp32 oneDNN: the packed float32 linear; fp32 layer: PackedLinear's forward (the native
  kernel up to `native_rows`, oneDNN above);
- bf16 before: oneDNN's packed bfloat16 linear, or where oneDNN cannot pack bfloat16 (AVX2)
  `F.linear` on the bfloat16 weight (PyTorch's own bfloat16 matmul: what a bfloat16 model ran
  on an AVX2 CPU before its native path); bf16 layer: PackedLinear's forward now;
- int8 PyTorch: `int8_matmul`'s PyTorch paths for float32 x (float32 chunks from DEQUANT_M
  rows, else dequantize + bfloat16); int8 layer: `Int8Linear`'s forward on float32 x (the
  int8 engine's activations);
and the ratios the layers are judged by: bf16/fp32 (fp32 layer time over bf16 layer time: > 1
when bfloat16 is faster), int8/bf16 (bf16 layer time over int8 layer time), bf16/before.

Timing: 1 thread by the process's CPU time (time.process_time: a neighbour taking the CPU does
not count), 2 threads by wall time (CPU time would sum both threads). The machine is shared:
the load average is printed with every table.

    python benchmarks/bf16_linear.py [--threads 1 2] [--ms 1 2 4 8 16] [--repeats 15]
        [--shapes 768x3224 1536x768 ...] [--pool-mib 128] [--fp32 | --layers]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.layers import quantization as quant  # noqa: E402
from hybridkv.layers.linear import (  # noqa: E402
    _OPS,
    PackedLinear,
    prepack_available,
    prepack_dtypes,
)
from hybridkv.ops.native import bf16_linear as native_bf16  # noqa: E402
from hybridkv.ops.native import cpu  # noqa: E402
from hybridkv.ops.native import f32_linear as native_f32  # noqa: E402

# the 100m model's linears, [in -> out]: Mamba2 in_proj / out_proj, MLP input / output,
# attention q and o / k and v, lm_head
SHAPES = ["768x3224", "1536x768", "768x3072", "768x768", "768x256", "768x32000"]


def pool(n: int, k: int, dtype: torch.dtype, mib: int) -> list[torch.Tensor]:
    size = n * k * torch.empty((), dtype=dtype).element_size()
    count = max(4, -(-mib * 2**20 // size))
    return [torch.randn(n, k).to(dtype) for _ in range(count)]


def pools(k: int, n: int, mib: int) -> dict[str, list[torch.Tensor]]:
    """The weights each way reads: packed float32, packed bfloat16, plain bfloat16."""
    w16 = pool(n, k, torch.bfloat16, mib)
    return {
        "fp32 oneDNN": [
            _OPS._reorder_linear_weight(w, None) for w in pool(n, k, torch.float32, mib)
        ],
        "bf16 oneDNN": [_OPS._reorder_linear_weight(w, None) for w in w16],
        "bf16 native": w16,
    }


def fp32_pools(k: int, n: int, mib: int) -> dict[str, list[torch.Tensor]]:
    """The weights of `--fp32`: packed float32, and plain float32 (read by the kernel and by
    the plain read)."""
    w32 = pool(n, k, torch.float32, mib)
    return {
        "fp32 oneDNN": [_OPS._reorder_linear_weight(w, None) for w in w32],
        "fp32 native": w32,
        "read": w32,
    }


def fp32_cases(
    weights: dict[str, list[torch.Tensor]], k: int, m: int
) -> dict[str, Callable[[], None]]:
    """The three ways of `--fp32` at M rows, each over every weight of its pool once."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    fn = native_f32.kernel()

    def onednn() -> None:
        for p in weights["fp32 oneDNN"]:
            _OPS._linear_pointwise(x, p, None, "none", [], "")

    def native() -> None:
        for w in weights["fp32 native"]:
            native_f32.run(fn, x, w, None)

    def read() -> None:
        for w in weights["read"]:
            w.sum()

    return {"fp32 oneDNN": onednn, "fp32 native": native, "read": read}


def cases(weights: dict[str, list[torch.Tensor]], k: int, m: int) -> dict[str, Callable[[], None]]:
    """The three ways at M rows, each calling every weight of its pool once."""
    x32 = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x16 = x32.to(torch.bfloat16)
    fn = native_bf16.kernel()

    def onednn(x: torch.Tensor, packed: list[torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            for p in packed:
                _OPS._linear_pointwise(x, p, None, "none", [], "")

        return go

    def native() -> None:
        for w in weights["bf16 native"]:
            native_bf16.run(fn, x16, w, None)

    return {
        "fp32 oneDNN": onednn(x32, weights["fp32 oneDNN"]),
        "bf16 oneDNN": onednn(x16, weights["bf16 oneDNN"]),
        "bf16 native": native,
    }


LAYERS = ["fp32 oneDNN", "fp32 layer", "bf16 before", "bf16 layer", "int8 PyTorch", "int8 layer"]


def layer_pools(k: int, n: int, mib: int) -> dict[str, list]:
    """The weights of `--layers`, one pool of distinct copies each: float32 PackedLinears
    (their packed copy for oneDNN, the weight for the kernel), bfloat16 ones (without a packed
    weight where oneDNN cannot pack bfloat16) and the same weights in bfloat16 for `bf16
    before`, int8 layers quantized from the float32 weights."""

    def layers(dtype: torch.dtype) -> list[PackedLinear]:
        out = []
        for w in pool(n, k, dtype, mib):
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            out.append(PackedLinear.from_linear(lin))
        return out

    f32, b16 = layers(torch.float32), layers(torch.bfloat16)
    copies = max(4, -(-mib * 2**20 // (n * k)))  # int8: a byte a weight
    int8 = [quant.Int8Linear(*quant.quantize_rows(torch.randn(n, k)), None) for _ in range(copies)]
    return {"fp32 oneDNN": f32, "fp32 layer": f32, "bf16 before": b16, "bf16 layer": b16,
            "int8 PyTorch": int8, "int8 layer": int8}  # fmt: skip


def layer_cases(weights: dict[str, list], k: int, m: int) -> dict[str, Callable[[], None]]:
    """The six ways of `--layers` at M rows, each over every layer of its pool once."""
    x32 = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x16 = x32.to(torch.bfloat16)
    packs_bf16 = torch.bfloat16 in prepack_dtypes()

    def onednn(x: torch.Tensor, name: str) -> Callable[[], None]:
        def go() -> None:
            for lin in weights[name]:
                _OPS._linear_pointwise(x, lin.packed_weight, None, "none", [], "")

        return go

    def forward(x: torch.Tensor, name: str) -> Callable[[], None]:
        def go() -> None:
            for lin in weights[name]:
                lin(x)

        return go

    def bf16_torch() -> None:
        for lin in weights["bf16 before"]:
            torch.nn.functional.linear(x16, lin.weight)

    def int8_torch() -> None:
        for lin in weights["int8 PyTorch"]:
            if m >= quant.DEQUANT_M:
                quant.f32_int8_matmul(x32, lin.qweight, lin.scale)
            else:
                quant.bf16_int8_matmul(x32, lin.qweight, lin.scale)

    return {
        "fp32 oneDNN": onednn(x32, "fp32 oneDNN"),
        "fp32 layer": forward(x32, "fp32 layer"),
        "bf16 before": onednn(x16, "bf16 before") if packs_bf16 else bf16_torch,
        "bf16 layer": forward(x16, "bf16 layer"),
        "int8 PyTorch": int8_torch,
        "int8 layer": forward(x32, "int8 layer"),
    }


def measure(runs, weights, repeats: int, threads: int) -> dict[str, float]:
    clock = time.process_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in runs}
    for go in runs.values():  # warm-up (first touch of the pools, the team)
        go()
    with torch.inference_mode():  # (the layers' native paths need autograd off)
        for _ in range(repeats):
            for name, go in runs.items():
                start = clock()
                go()
                times[name].append((clock() - start) / len(weights[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_layers(weights: dict[str, list], k: int, n: int, ms: list[int], repeats: int,
                 threads: int) -> None:  # fmt: skip
    for m in ms:
        t = measure(layer_cases(weights, k, m), weights, repeats, threads)
        us = " | ".join(f"{t[c] * 1e6:.1f}" for c in LAYERS)
        f32, b16, i8 = t["fp32 layer"], t["bf16 layer"], t["int8 layer"]
        print(
            f"| {k} -> {n} | {m} | {us} | {f32 / b16:.2f} | {b16 / i8:.2f} "
            f"| {t['bf16 before'] / b16:.2f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="KxN, e.g. 768x3224")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--fp32", action="store_true", help="the float32 kernel against oneDNN")
    ap.add_argument("--layers", action="store_true", help="each precision's layer, now/before")
    args = ap.parse_args(argv)
    kernel = native_f32.kernel() if args.fp32 else native_bf16.kernel()
    if not prepack_available() or (kernel is None and not args.layers):
        print("needs oneDNN and the native kernel (bf16: AVX2 or AVX512-BF16, fp32: AVX2)")
        return 1
    if not args.fp32 and not args.layers and torch.bfloat16 not in prepack_dtypes():
        print("oneDNN has no bfloat16 here (an AVX2 CPU): --layers compares with PyTorch's")
        return 1
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}")
    print(f"# {cpu.line()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s); load average before: {os.getloadavg()[0]:.2f}\n")
        if args.layers:
            print("| K -> N | M | " + " | ".join(f"{c} us" for c in LAYERS)
                  + " | bf16/fp32 | int8/bf16 | bf16/before |")  # fmt: skip
            print("|---" * (2 + len(LAYERS) + 3) + "|")
            for shape in args.shapes:
                k, n = map(int, shape.split("x"))
                weights = layer_pools(k, n, args.pool_mib)
                print_layers(weights, k, n, args.ms, args.repeats, threads)
                del weights
            print(f"\nload average after: {os.getloadavg()[0]:.2f}")
            continue
        if args.fp32:
            print("| K -> N | M | fp32 oneDNN us | fp32 native us | read us | native GB/s "
                  "| oneDNN GB/s | read GB/s | native/oneDNN |")  # fmt: skip
        else:
            print("| K -> N | M | fp32 oneDNN us | bf16 oneDNN us | bf16 native us | native GB/s "
                  "| oneDNN bf16 GB/s | native/oneDNN | bf16/fp32 |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            weights = fp32_pools(k, n, args.pool_mib) if args.fp32 else pools(k, n, args.pool_mib)
            for m in args.ms:
                runs = fp32_cases(weights, k, m) if args.fp32 else cases(weights, k, m)
                t = measure(runs, weights, args.repeats, threads)
                if args.fp32:
                    dnn, nat, read = t["fp32 oneDNN"], t["fp32 native"], t["read"]
                    gb = n * k * 4 / 1e9
                    print(
                        f"| {k} -> {n} | {m} | {dnn * 1e6:.1f} | {nat * 1e6:.1f} "
                        f"| {read * 1e6:.1f} | {gb / nat:.1f} | {gb / dnn:.1f} | {gb / read:.1f} "
                        f"| {dnn / nat:.2f} |",
                        flush=True,
                    )
                    continue
                fp32, dnn, nat = t["fp32 oneDNN"], t["bf16 oneDNN"], t["bf16 native"]
                gbs = n * k * 2 / 1e9
                print(
                    f"| {k} -> {n} | {m} | {fp32 * 1e6:.1f} | {dnn * 1e6:.1f} | {nat * 1e6:.1f} "
                    f"| {gbs / nat:.1f} | {gbs / dnn:.1f} | {dnn / nat:.2f} | {fp32 / nat:.2f} |",
                    flush=True,
                )
            del weights
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
