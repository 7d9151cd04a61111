"""GPU paged attention: decode and prefill time and bandwidth per kernel block size and page size.

    python benchmarks/gpu_attention.py            # a table
    python benchmarks/gpu_attention.py --json     # the same numbers as JSON
    python benchmarks/gpu_attention.py --json-out F   # the table, and the JSON written to F

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


def median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall time of `fn` on the device, in milliseconds (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbps(gib: float, iters: int) -> float:
    """Device-to-device copy: (read + write) bytes per second, in GB/s."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(partial(dst.copy_, src), 3, iters)
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def page_mode_table(batch: int, context: int, kbs: int, ratio: int, gen: torch.Generator):
    """Random pages per request expanded to kernel-block ids: [batch, blocks] int32."""
    pages_per_seq = -(-context // (kbs * ratio))
    num_pages = batch * pages_per_seq
    pages = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq)
    blocks = pages[:, :, None] * ratio + torch.arange(ratio)  # [batch, pages, ratio]
    n_blocks = -(-context // kbs)
    return blocks.reshape(batch, -1)[:, :n_blocks].int().cuda(), num_pages


def bench_config(args: argparse.Namespace, kbs: int, ratio: int, copy_gbps: float) -> Row:
    from hybridkv.ops import attention as ref
    from hybridkv.ops import triton_attention as tri

    gen = torch.Generator().manual_seed(kbs * 100 + ratio)
    b, ctx, h, kvh, d = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    table, num_pages = page_mode_table(b, ctx, kbs, ratio, gen)
    cache = torch.empty(num_pages * ratio, 2, kbs, kvh, d, dtype=torch.bfloat16, device="cuda")
    cache.normal_()
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    kv_bytes = b * ctx * 2 * kvh * d * cache.element_size()

    # Decode: one query per request over the whole context.
    q = torch.randn(b, h, d, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    decode = partial(tri.paged_attention, q, cache, table, qsl, seq_lens, scale, None, 1, ctx)
    if args.check:  # a few requests against the PyTorch reference
        n = 4
        got = tri.paged_attention(q[:n], cache, table[:n], qsl[: n + 1], seq_lens[:n], scale)
        want = ref.paged_attention(q[:n], cache, table[:n], qsl[: n + 1], seq_lens[:n], scale)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    dec_ms = median_ms(decode, args.warmup, args.iters)
    dec_gbps = (kv_bytes + 2 * q.numel() * q.element_size()) / (dec_ms * 1e-3) / 1e9

    # Prefill: a chunk of `prefill_chunk` queries per request at the end of its context.
    c = args.prefill_chunk
    qp = torch.randn(b * c, h, d, dtype=torch.bfloat16, device="cuda")
    qslp = torch.arange(0, b * c + 1, c, dtype=torch.int32, device="cuda")
    prefill = partial(tri.paged_attention, qp, cache, table, qslp, seq_lens, scale, None, c, ctx)
    pre_ms = median_ms(prefill, args.warmup, max(3, args.iters // 4))
    keys_seen = b * sum(range(ctx - c + 1, ctx + 1))  # causal: query at p sees p + 1 keys
    pre_tflops = 4 * h * d * keys_seen / (pre_ms * 1e-3) / 1e12
    pre_gbps = (kv_bytes + 2 * qp.numel() * qp.element_size()) / (pre_ms * 1e-3) / 1e9
    del cache, table, decode, prefill
    torch.cuda.empty_cache()
    return Row(kbs, ratio, kbs * ratio, dec_ms * 1e3, dec_gbps, dec_gbps / copy_gbps, pre_ms,
               pre_tflops, pre_gbps)  # fmt: skip


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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_attention.py needs a CUDA device and found none", file=sys.stderr)
        return 2

    device = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps(2.0, args.iters)
    rows = [
        bench_config(args, kbs, ratio, copy_gbps)
        for kbs in args.kernel_block_sizes
        for ratio in args.blocks_per_page
    ]
    t = targets(rows)
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
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(device, copy_gbps, rows, t)
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
