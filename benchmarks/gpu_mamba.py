"""GPU Mamba2 decode step: hybridkv's Triton kernels against the PyTorch path, per layer.

    python benchmarks/gpu_mamba.py            # a table
    python benchmarks/gpu_mamba.py --json     # the same numbers as JSON

One decode step of one Mamba2 layer at Granite-4.0-H-Small's sizes (128 heads, head dim 64,
state 128, one group, a 4-tap conv over 8448 channels) for batches of 64 and 256 requests whose
state pages lie scattered in a pool twice that size, with bfloat16 and float32 state pages:

- state update: `triton_mamba.ssm_decode` (one pass over each state, in its page) against the
  PyTorch route the GPU took before it (`_initial_ssm_state` gather, `ssd_step`, `index_copy_`
  scatter), which is also the reference the outputs are checked against;
- conv update: `triton_mamba.conv1d_decode` against `conv1d.causal_conv1d_decode`;
- gated delta rule (Qwen3-Next's linear attention, 32 value heads of 128 x 128 per layer):
  `triton_gdn.gdn_decode` against the PyTorch route (`gated_delta.decode_rows`).

Bandwidth counts each state byte read once and written once; `%copy` relates it to a
device-to-device copy measured in the same run. Times are medians of CUDA-event timings.
`--device cpu` runs the same code through Triton's interpreter at tiny sizes (a smoke test; its
times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention import copy_bandwidth_gbps, empty_cache, median_ms  # noqa: E402

GRANITE_H_SMALL = dict(heads=128, head_dim=64, d_state=128, groups=1, d_conv=4)
TINY = dict(heads=4, head_dim=8, d_state=16, groups=2, d_conv=4)
QWEN3_NEXT_GDN = dict(v_heads=32, k_heads=16, k_dim=128, v_dim=128)
TINY_GDN = dict(v_heads=4, k_heads=2, k_dim=16, v_dim=8)


@dataclass
class Row:
    op: str
    batch: int
    state_dtype: str
    torch_us: float
    triton_us: float
    speedup: float
    triton_gbps: float
    triton_of_copy: float
    max_abs_diff: float


def _inputs(shape: dict[str, int], batch: int, dtype: torch.dtype, device: str):
    h, p, n, g = shape["heads"], shape["head_dim"], shape["d_state"], shape["groups"]
    gen = torch.Generator().manual_seed(batch)
    num_pages = 2 * batch
    pages = torch.randperm(num_pages, generator=gen)[:batch].to(device)
    has_state = torch.ones(batch, dtype=torch.bool, device=device)
    state = torch.randn(num_pages, h, p, n, generator=gen).to(device, dtype)
    x = torch.randn(batch, h, p, generator=gen).to(device)
    dt = torch.rand(batch, h, generator=gen).to(device) * 0.1
    A = -torch.rand(h, generator=gen).to(device)
    B = torch.randn(batch, g, n, generator=gen).to(device)
    C = torch.randn(batch, g, n, generator=gen).to(device)
    D = torch.randn(h, generator=gen).to(device)
    return state, pages, has_state, (x, dt, A, B, C, D)


def bench_ssm(args, shape, batch: int, dtype: torch.dtype, copy_gbps: float) -> Row:
    from hybridkv.ops import mamba2, triton_mamba

    state, pages, has_state, inputs = _inputs(shape, batch, dtype, args.device)
    torch_step = partial(mamba2._decode_rows, state.clone(), pages, has_state, inputs, None)
    triton_step = partial(triton_mamba.ssm_decode, state, pages, has_state, *inputs)
    diff = float((torch_step() - triton_step()).abs().max())  # both from the same old states
    t_torch = median_ms(torch_step, args.warmup, args.iters, args.device)
    t_triton = median_ms(triton_step, args.warmup, args.iters, args.device)
    state_bytes = 2 * batch * state[0].numel() * state.element_size()  # read + write
    gbps = state_bytes / (t_triton * 1e-3) / 1e9
    del state
    empty_cache()
    return Row("ssm_decode", batch, str(dtype).removeprefix("torch."), t_torch * 1e3,
               t_triton * 1e3, t_torch / t_triton, gbps, gbps / copy_gbps, diff)  # fmt: skip


def bench_conv(args, shape, batch: int, copy_gbps: float) -> Row:
    from hybridkv.ops import conv1d, triton_mamba

    h, p, n, g, k = (shape[key] for key in ("heads", "head_dim", "d_state", "groups", "d_conv"))
    channels = h * p + 2 * g * n
    gen = torch.Generator().manual_seed(batch + 1)
    dev, bf16 = args.device, torch.bfloat16
    state = torch.randn(2 * batch, channels, k - 1, generator=gen).to(dev, bf16)
    pages = torch.randperm(2 * batch, generator=gen)[:batch].to(dev)
    has_state = torch.ones(batch, dtype=torch.bool, device=dev)
    x = torch.randn(batch, channels, generator=gen).to(dev, bf16)
    weight = torch.randn(channels, k, generator=gen).to(dev, bf16)
    bias = torch.randn(channels, generator=gen).to(dev, bf16)
    common = (x, weight, bias)
    torch_step = partial(conv1d.causal_conv1d_decode, *common, state.clone(), pages, has_state)
    triton_step = partial(triton_mamba.conv1d_decode, *common, state, pages, has_state)
    diff = float((torch_step().float() - triton_step().float()).abs().max())
    t_torch = median_ms(torch_step, args.warmup, args.iters, dev)
    t_triton = median_ms(triton_step, args.warmup, args.iters, dev)
    moved = 2 * batch * state[0].numel() * state.element_size() + 2 * x.numel() * x.element_size()
    gbps = moved / (t_triton * 1e-3) / 1e9
    return Row("conv1d_decode", batch, "bfloat16", t_torch * 1e3, t_triton * 1e3,
               t_torch / t_triton, gbps, gbps / copy_gbps, diff)  # fmt: skip


def bench_gdn(args, shape, batch: int, dtype: torch.dtype, copy_gbps: float) -> Row:
    from hybridkv.ops import gated_delta, triton_gdn

    hv, hk, kd, vd = (shape[key] for key in ("v_heads", "k_heads", "k_dim", "v_dim"))
    gen = torch.Generator().manual_seed(batch + 2)
    dev = args.device
    state = torch.randn(2 * batch, hv, kd, vd, generator=gen).to(dev, dtype)
    pages = torch.randperm(2 * batch, generator=gen)[:batch].to(dev)
    has_state = torch.ones(batch, dtype=torch.bool, device=dev)
    q, k = (torch.randn(batch, hk, kd, generator=gen).to(dev) for _ in range(2))
    v = torch.randn(batch, hv, vd, generator=gen).to(dev)
    g = -torch.rand(batch, hv, generator=gen).to(dev)
    beta = torch.rand(batch, hv, generator=gen).to(dev)
    inputs = gated_delta.rule_inputs(q, k, v, g, beta)
    torch_step = partial(gated_delta.decode_rows, state.clone(), pages, has_state, inputs)
    triton_step = partial(triton_gdn.gdn_decode, state, pages, has_state, inputs)
    diff = float((torch_step() - triton_step()).abs().max())
    t_torch = median_ms(torch_step, args.warmup, args.iters, dev)
    t_triton = median_ms(triton_step, args.warmup, args.iters, dev)
    moved = 2 * batch * state[0].numel() * state.element_size()  # read + write
    gbps = moved / (t_triton * 1e-3) / 1e9
    del state
    empty_cache()
    return Row("gdn_decode", batch, str(dtype).removeprefix("torch."), t_torch * 1e3,
               t_triton * 1e3, t_torch / t_triton, gbps, gbps / copy_gbps, diff)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run through Triton's interpreter at tiny sizes")  # fmt: skip
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_mamba.py needs a CUDA device and found none", file=sys.stderr)
        return 2
    shape = GRANITE_H_SMALL if args.device == "cuda" else TINY
    copy_gbps = copy_bandwidth_gbps(2.0 if args.device == "cuda" else 0.01, args.iters, args.device)
    rows = []
    for batch in args.batches:
        for dtype in (torch.bfloat16, torch.float32):
            rows.append(bench_ssm(args, shape, batch, dtype, copy_gbps))
        rows.append(bench_conv(args, shape, batch, copy_gbps))
        gdn = QWEN3_NEXT_GDN if args.device == "cuda" else TINY_GDN
        for dtype in (torch.bfloat16, torch.float32):
            rows.append(bench_gdn(args, gdn, batch, dtype, copy_gbps))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    if args.json:
        report = {"device": device, "shape": shape, "copy_gbps": copy_gbps,
                  "rows": [asdict(r) for r in rows]}  # fmt: skip
        print(json.dumps(report, indent=2))
        return 0
    print(f"device: {device}; shape {shape}; device-to-device copy {copy_gbps:,.0f} GB/s")
    head = (f"{'op':<14} {'batch':>5} {'state':>8} | {'torch us':>9} {'triton us':>9} "
            f"{'speedup':>7} | {'GB/s':>6} {'%copy':>6} | {'max diff':>8}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.op:<14} {r.batch:>5} {r.state_dtype:>8} | {r.torch_us:>9.1f} "
              f"{r.triton_us:>9.1f} {r.speedup:>6.2f}x | {r.triton_gbps:>6.0f} "
              f"{100 * r.triton_of_copy:>5.1f}% | {r.max_abs_diff:>8.1e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
