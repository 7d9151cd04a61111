"""A kernel change measured against its base in one process: the native library built from a git
revision's C files (`--base`, default HEAD) and from the working tree, both loaded with ctypes,
the bf16 and float32 small-batch linears (`hkv_bf16_linear`, `hkv_f32_linear`) of both timed in
alternating rounds on the same weights. Alternating in one process is what makes a 5-15% change
visible on a machine whose memory bandwidth drifts by more than that over minutes (a run per
build, minutes apart, compares two machines).

Weights stream from memory as in a decode step: each timed call takes the next copy of a pool
(`--pool-mib`) larger than the last-level cache. Per layer: both builds' median microseconds,
GB/s of weight, base / tree (the median of the rounds' paired ratios; above 1: the working tree
is faster) and the largest difference between the two builds' outputs relative to the largest
output (a changed summation order moves bfloat16 results by an ulp, 2^-8 of a value, at most).
Code that did not change reads 0.96-1.05 here (layout and noise): include such a row (another M,
the other dtype) as the control.

    python benchmarks/native_ab.py [--base HEAD] [--ms 1 4] [--dtype bf16 f32] [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridkv.ops import native  # noqa: E402
from hybridkv.ops.native import CFLAGS, compile_library, sources  # noqa: E402

NATIVE = "hybridkv/ops/native"
SHAPES = ["768x3224", "1536x768", "768x3072", "768x768", "768x256", "768x32000"]
KERNELS = {"bf16": ("hkv_bf16_linear", torch.bfloat16), "f32": ("hkv_f32_linear", torch.float32)}


def build(files: list[Path], out: Path) -> ctypes.CDLL:
    """The library of `files` and the working tree's generated program adapters (the table of
    native kernels a captured step calls, which program.c links against)."""
    native._declare_all()
    adapters = out.with_suffix(".adapters.c")
    adapters.write_text(native._adapters_source(sorted(native._SIGNATURES)))
    compile_library("gcc", CFLAGS, [*files, adapters], out)
    return ctypes.CDLL(str(out))


def build_revision(rev: str, folder: Path) -> ctypes.CDLL:
    """The library of `rev`'s C files and headers (written to `folder`)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{NATIVE}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if name.endswith((".c", ".h")):
            text = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{rev}:{NATIVE}/{name}"],
                check=True, capture_output=True,
            ).stdout  # fmt: skip
            (folder / name).write_bytes(text)
    return build(sorted(folder.glob("*.c")), folder / "base.so")


def bind(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]
    fn.restype = None
    return fn


def call(fn, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    (m, k), n = x.shape, w.shape[0]
    fn(x.data_ptr(), k, w.data_ptr(), None, m, n, k, y.data_ptr(), n)


def measure(fns, m: int, k: int, n: int, dtype, pool_mib: int, rounds: int):
    """Median seconds per call of each fn (alternating rounds), the median of the rounds'
    base / tree ratios (each round's pair runs back to back, so a drift of the machine between
    rounds cancels) and the outputs' difference."""
    g = torch.Generator().manual_seed(0)
    copies = max(2, pool_mib * 2**20 // (n * k * dtype.itemsize))
    ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
    x = torch.randn(m, k, generator=g).to(dtype)
    outs = [torch.empty(m, n, dtype=dtype) for _ in fns]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            for w in ws:
                call(fns[i], x, w, outs[i])
            times[i].append((time.perf_counter() - start) / len(ws))
    for i, fn in enumerate(fns):
        call(fn, x, ws[0], outs[i])
    scale = float((x.double() @ ws[0].double().T).abs().max())
    diff = float((outs[0].double() - outs[1].double()).abs().max()) / scale
    ratio = statistics.median(a / b for a, b in zip(*times, strict=True))
    return [statistics.median(t) for t in times], ratio, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare with (default HEAD)")
    p.add_argument("--ms", type=int, nargs="+", default=[1])
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(KERNELS))
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="KxN")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_revision(args.base, Path(tmp))
        tree = build(sources(), Path(tmp) / "tree.so")
        print(f"# base {args.base} against the working tree, {torch.get_num_threads()} threads")
        print("| kernel | K -> N | M | base us | tree us | tree GB/s | base / tree | max diff |")
        print("|---|---|---|---|---|---|---|---|")
        for kind in args.dtype:
            name, dtype = KERNELS[kind]
            fns = [bind(base, name), bind(tree, name)]
            for shape in args.shapes:
                k, n = map(int, shape.split("x"))
                for m in args.ms:
                    (t0, t1), ratio, diff = measure(
                        fns, m, k, n, dtype, args.pool_mib, args.rounds
                    )
                    gbs = n * k * dtype.itemsize / t1 / 1e9
                    print(
                        f"| {kind} | {k} -> {n} | {m} | {t0 * 1e6:.1f} | {t1 * 1e6:.1f} | "
                        f"{gbs:.1f} | {ratio:.3f} | {diff:.1e} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
