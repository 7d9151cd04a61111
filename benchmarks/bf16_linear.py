"""The native bfloat16 linear for small batches (issue 19) against oneDNN's packed linears, on
the linear shapes of the 100m GraniteMoeHybrid of benchmarks/throughput.py, weights out of cache.

For each shape [K -> N], thread count (`--threads`) and M (`--ms`), microseconds per call
(median of `--repeats` passes; a pass calls every weight of a pool once) of:
- fp32 oneDNN: PackedLinear's float32 path (`_linear_pointwise` on the packed weight), what a
  float32 model runs;
- bf16 oneDNN: the same for bfloat16, what a bfloat16 model ran before this kernel;
- bf16 native: `hybridkv/ops/native/bf16_linear.c` on the unpacked weight, what PackedLinear
  runs now up to SMALL_M rows.
The weights of each are a pool of distinct copies of at least `--pool-mib` MiB (default 128,
four times the 32 MiB L3; at least 4 copies), so every call streams its weight from memory.
GB/s is the weight bytes streamed per call over its time (bf16: 2 bytes a value, fp32: 4);
native/oneDNN is bf16 oneDNN's time over the native kernel's; bf16/fp32 is fp32 oneDNN's time
over the native kernel's. The three run alternately, pass by pass, on the same input rows.

Timing: 1 thread by the process's CPU time (time.process_time: a neighbour taking the CPU does
not count), 2 threads by wall time (CPU time would sum both threads). The machine is shared:
the load average is printed with every table.

    python benchmarks/bf16_linear.py [--threads 1 2] [--ms 1 2 4 8 16] [--repeats 15]
        [--shapes 768x3224 1536x768 ...] [--pool-mib 128]
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

from hybridkv.layers.linear import _OPS, prepack_available  # noqa: E402
from hybridkv.ops.native import bf16_linear as native_bf16  # noqa: E402

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


def measure(runs, weights, repeats: int, threads: int) -> dict[str, float]:
    clock = time.process_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in runs}
    for go in runs.values():  # warm-up (first touch of the pools, the team)
        go()
    for _ in range(repeats):
        for name, go in runs.items():
            start = clock()
            go()
            times[name].append((clock() - start) / len(weights[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="KxN, e.g. 768x3224")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--pool-mib", type=int, default=128)
    args = ap.parse_args(argv)
    if not prepack_available() or native_bf16.kernel() is None:
        print("needs oneDNN and the native kernel built with AVX512-BF16")
        return 1
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s); load average before: {os.getloadavg()[0]:.2f}\n")
        print("| K -> N | M | fp32 oneDNN us | bf16 oneDNN us | bf16 native us | native GB/s "
              "| oneDNN bf16 GB/s | native/oneDNN | bf16/fp32 |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            weights = pools(k, n, args.pool_mib)
            for m in args.ms:
                t = measure(cases(weights, k, m), weights, args.repeats, threads)
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
