"""GPU paged attention: decode and prefill time and bandwidth per kernel block size and page size.

    python benchmarks/gpu_attention.py            # a table
    python benchmarks/gpu_attention.py --json     # the same numbers as JSON
    python benchmarks/gpu_attention.py --json-out F   # the table, and the JSON written to F
    python benchmarks/gpu_attention.py --sweep    # also other tilings, for tuning defaults

For kernel_block_size 16/32/64/128 and blocks_per_page 1/17/33 it times hybridkv's Triton
kernels (bf16, batch 64, context 4k by default) on page-mode block tables: each request owns
random pages, page p expanded to kernel blocks p*r .. p*r+r-1. The reference bandwidth is a
device-to-device torch copy of a large tensor (bytes read + bytes written per second).

Targets: decode reaches >= 70% of the copy bandwidth, and for one kernel_block_size decode times
differ by <= 5% across blocks_per_page (the page size must not matter to the kernel).
Times are medians of CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
BLOCKS_PER_PAGE = (1, 17, 33)
DECODE_TARGET = 0.70  # of the copy bandwidth
SPREAD_TARGET = 0.05  # across blocks_per_page


@dataclass
class Row:
    kernel_block_size: int
    blocks_per_page: int
    page_tokens: int
    decode_us: float
    decode_gbps: float
    decode_of_copy: float
    prefill_ms: float
    prefill_tflops: float
    prefill_gbps: float


def median_ms(fn: Callable[[], object], warmup: int, iters: int, device: str) -> float:
    """Median wall time of `fn` in milliseconds: CUDA events on a GPU, the host clock on the
    CPU (the interpreter smoke run, whose times mean nothing)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth_gbps(gib: float, iters: int, device: str) -> float:
    """Device-to-device copy: (read + write) bytes per second, in GB/s."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(partial(dst.copy_, src), 3, iters, device)
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def page_mode_table(
    batch: int, context: int, kbs: int, ratio: int, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, int]:
    """Random pages per request expanded to kernel-block ids: [batch, blocks] int32."""
    pages_per_seq = -(-context // (kbs * ratio))
    num_pages = batch * pages_per_seq
    pages = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq)
    blocks = pages[:, :, None] * ratio + torch.arange(ratio)  # [batch, pages, ratio]
    n_blocks = -(-context // kbs)
    return blocks.reshape(batch, -1)[:, :n_blocks].int().to(device), num_pages


@dataclass
class Inputs:
    """One configuration's device tensors: a bf16 paged cache holding `context` tokens for each
    of `batch` requests, a decode batch and a prefill batch over it."""

    cache: torch.Tensor  # [num_kernel_blocks, 2, kbs, kv_heads, head_dim]
    table: torch.Tensor  # [batch, blocks per request] int32
    seq_lens: torch.Tensor  # [batch] int32, all `context`
    q: torch.Tensor  # decode queries: [batch, heads, head_dim]
    qsl: torch.Tensor  # [batch + 1]
    qp: torch.Tensor  # prefill queries: [batch * prefill_chunk, heads, head_dim]
    qslp: torch.Tensor  # [batch + 1]
    kv_bytes: int  # K and V bytes of every request's context

    def decode(self, args: argparse.Namespace, **kwargs) -> Callable[[], torch.Tensor]:
        from hybridkv.ops import triton_attention as tri

        return partial(tri.paged_attention, self.q, self.cache, self.table, self.qsl,
                       self.seq_lens, args.head_dim**-0.5, None, 1, args.context,
                       **kwargs)  # fmt: skip

    def prefill(self, args: argparse.Namespace, **kwargs) -> Callable[[], torch.Tensor]:
        from hybridkv.ops import triton_attention as tri

        return partial(tri.paged_attention, self.qp, self.cache, self.table, self.qslp,
                       self.seq_lens, args.head_dim**-0.5, None, args.prefill_chunk,
                       args.context, **kwargs)  # fmt: skip

    def decode_gbps(self, ms: float) -> float:
        return (self.kv_bytes + 2 * self.q.numel() * self.q.element_size()) / (ms * 1e-3) / 1e9

    def prefill_rates(self, args: argparse.Namespace, ms: float) -> tuple[float, float]:
        """(TFLOP/s, GB/s) of a prefill call that took `ms`."""
        b, ctx, c = args.batch, args.context, args.prefill_chunk
        keys_seen = b * sum(range(ctx - c + 1, ctx + 1))  # causal: query at p sees p + 1 keys
        tflops = 4 * args.heads * args.head_dim * keys_seen / (ms * 1e-3) / 1e12
        gbps = (self.kv_bytes + 2 * self.qp.numel() * self.qp.element_size()) / (ms * 1e-3) / 1e9
        return tflops, gbps


def make_inputs(args: argparse.Namespace, kbs: int, ratio: int) -> Inputs:
    gen = torch.Generator().manual_seed(kbs * 100 + ratio)
    b, ctx, h, kvh, d = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    dev = args.device
    table, num_pages = page_mode_table(b, ctx, kbs, ratio, gen, dev)
    cache = torch.empty(num_pages * ratio, 2, kbs, kvh, d, dtype=torch.bfloat16, device=dev)
    cache.normal_()
    c = args.prefill_chunk
    return Inputs(
        cache=cache,
        table=table,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
        q=torch.randn(b, h, d, dtype=torch.bfloat16, device=dev),
        qsl=torch.arange(b + 1, dtype=torch.int32, device=dev),
        qp=torch.randn(b * c, h, d, dtype=torch.bfloat16, device=dev),
        qslp=torch.arange(0, b * c + 1, c, dtype=torch.int32, device=dev),
        kv_bytes=b * ctx * 2 * kvh * d * cache.element_size(),
    )


def spot_check(x: Inputs, args: argparse.Namespace) -> None:
    """The first requests' decode output against the PyTorch reference."""
    from hybridkv.ops import attention as ref
    from hybridkv.ops import triton_attention as tri

    n, scale = 4, args.head_dim**-0.5
    xs = (x.q[:n], x.cache, x.table[:n], x.qsl[: n + 1], x.seq_lens[:n], scale)
    got, want = tri.paged_attention(*xs), ref.paged_attention(*xs)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def bench_config(args: argparse.Namespace, kbs: int, ratio: int, copy_gbps: float) -> Row:
    x = make_inputs(args, kbs, ratio)
    if args.check:
        spot_check(x, args)
    dec_ms = median_ms(x.decode(args), args.warmup, args.iters, args.device)
    dec_gbps = x.decode_gbps(dec_ms)
    pre_ms = median_ms(x.prefill(args), args.warmup, max(3, args.iters // 4), args.device)
    pre_tflops, pre_gbps = x.prefill_rates(args, pre_ms)
    del x
    empty_cache()
    return Row(kbs, ratio, kbs * ratio, dec_ms * 1e3, dec_gbps, dec_gbps / copy_gbps, pre_ms,
               pre_tflops, pre_gbps)  # fmt: skip


# Launch configurations the sweep times, defaults included: (block_m, tile_n, warps, stages).
DECODE_SWEEP = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 128, 4, 2), (16, 128, 8, 2),
                (16, 64, 4, 3)]  # fmt: skip
PREFILL_SWEEP = [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2),
                 (128, 32, 8, 2)]  # fmt: skip


def sweep(args: argparse.Namespace, copy_gbps: float) -> list[dict[str, object]]:
    """Time decode and prefill per launch configuration at the smallest and largest kernel
    block sizes (blocks_per_page 1): tuning data for `default_launch`. Each configuration's
    output is compared with the default launch's (`max_abs_diff`)."""
    from hybridkv.ops import triton_attention as tri

    rows: list[dict[str, object]] = []
    for kbs in sorted({min(args.kernel_block_sizes), max(args.kernel_block_sizes)}):
        x = make_inputs(args, kbs, 1)
        for kind, grid in (("decode", DECODE_SWEEP), ("prefill", PREFILL_SWEEP)):
            make = x.decode if kind == "decode" else x.prefill
            want = make(args)()
            for cfg in grid:
                row = time_launch(args, x, kind, make, want, tri.LaunchConfig(*cfg), copy_gbps)
                rows.append({"kernel_block_size": kbs, **row})
        del x
        empty_cache()
    return rows


def time_launch(args, x: Inputs, kind: str, make, want, launch, copy_gbps) -> dict[str, object]:
    row: dict[str, object] = {"kind": kind, **asdict(launch)}
    try:
        fn = make(args, launch=launch)
        row["max_abs_diff"] = float((fn().float() - want.float()).abs().max())
        iters = args.iters if kind == "decode" else 3
        ms = median_ms(fn, args.warmup, iters, args.device)
    except Exception as e:  # a configuration that does not compile or launch
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    row["ms"] = ms
    if kind == "decode":
        row["gbps"] = x.decode_gbps(ms)
        row["of_copy"] = x.decode_gbps(ms) / copy_gbps
    else:
        row["tflops"] = x.prefill_rates(args, ms)[0]
    return row


def print_sweep(rows: list[dict[str, object]]) -> None:
    print("\nlaunch sweep (blocks_per_page 1): block_m x tile_n, warps, stages")
    for r in rows:
        cfg = (f"{r['kind']:>7} kbs {r['kernel_block_size']:>3} {r['block_m']:>3} x "
               f"{r['tile_n']:>3} w{r['num_warps']} s{r['num_stages']}")  # fmt: skip
        if "error" in r:
            print(f"{cfg}: {r['error']}")
        elif r["kind"] == "decode":
            print(f"{cfg}: {r['ms'] * 1e3:8.1f} us {r['gbps']:6.0f} GB/s "
                  f"{100 * r['of_copy']:5.1f}% of copy")  # fmt: skip
        else:
            print(f"{cfg}: {r['ms']:8.2f} ms {r['tflops']:6.1f} TFLOP/s")


def targets(rows: list[Row]) -> dict[str, object]:
    decode_ok = all(r.decode_of_copy >= DECODE_TARGET for r in rows)
    spread = {}
    for kbs in sorted({r.kernel_block_size for r in rows}):
        times = [r.decode_us for r in rows if r.kernel_block_size == kbs]
        spread[kbs] = (max(times) - min(times)) / min(times)
    return {
        "decode_at_least_70pct_of_copy": decode_ok,
        "decode_spread_across_blocks_per_page": spread,
        "spread_within_5pct": all(s <= SPREAD_TARGET for s in spread.values()),
    }


def print_table(device: str, copy_gbps: float, rows: list[Row], t: dict[str, object]) -> None:
    print(f"device: {device}; device-to-device copy: {copy_gbps:,.0f} GB/s (read + write)")
    head = (f"{'kbs':>5} {'r':>3} {'page':>5} | {'decode us':>10} {'GB/s':>7} {'%copy':>6} | "
            f"{'prefill ms':>10} {'TFLOP/s':>8} {'GB/s':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.kernel_block_size:>5} {r.blocks_per_page:>3} {r.page_tokens:>5} | "
              f"{r.decode_us:>10.1f} {r.decode_gbps:>7.0f} {100 * r.decode_of_copy:>5.1f}% | "
              f"{r.prefill_ms:>10.2f} {r.prefill_tflops:>8.1f} {r.prefill_gbps:>7.0f}")  # fmt: skip
    ok = "met" if t["decode_at_least_70pct_of_copy"] else "MISSED"
    print(f"target decode >= {DECODE_TARGET:.0%} of copy bandwidth: {ok}")
    spread = t["decode_spread_across_blocks_per_page"]
    assert isinstance(spread, dict)
    parts = ", ".join(f"kbs {k}: {100 * s:.1f}%" for k, s in spread.items())
    ok = "met" if t["spread_within_5pct"] else "MISSED"
    print(f"target decode spread across blocks_per_page <= {SPREAD_TARGET:.0%}: {ok} ({parts})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--json-out", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time other launch configurations (tile sizes, warps, stages)",
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=512, help="queries per request")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernel-block-sizes", type=int, nargs="+", default=list(KERNEL_BLOCK_SIZES))
    p.add_argument("--blocks-per-page", type=int, nargs="+", default=list(BLOCKS_PER_PAGE))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the correctness spot check against the PyTorch reference",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run through Triton's interpreter (TRITON_INTERPRET=1; times mean "
        "nothing), for tests",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_attention.py needs a CUDA device and found none", file=sys.stderr)
        return 2

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    copy_gbps = copy_bandwidth_gbps(2.0 if args.device == "cuda" else 0.01, args.iters, args.device)
    rows = [
        bench_config(args, kbs, ratio, copy_gbps)
        for kbs in args.kernel_block_sizes
        for ratio in args.blocks_per_page
    ]
    t = targets(rows)
    swept = sweep(args, copy_gbps) if args.sweep else []
    names = ("batch", "context", "prefill_chunk", "heads", "kv_heads", "head_dim")
    report = {
        "device": device,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": "bfloat16",
        "shape": {k: getattr(args, k) for k in names},
        "copy_gbps": copy_gbps,
        "rows": [asdict(r) for r in rows],
        "targets": t,
        "sweep": swept,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(device, copy_gbps, rows, t)
        if swept:
            print_sweep(swept)
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
