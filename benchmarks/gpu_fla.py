"""hybridkv's linear-attention state ops (gated delta net, KDA) against flash-linear-attention
(fla-core) on a GPU.

    python benchmarks/gpu_fla.py                 # a table (needs `fla` importable: fla-core)
    python benchmarks/gpu_fla.py --json          # the same numbers as JSON (a list of rows)
    python benchmarks/gpu_fla.py --kinds kda     # one kind only (default: gdn kda)

One rule call of one layer, float32 state pages scattered in a pool twice the batch, q/k/v in
bfloat16, g and beta in float32: the gated delta rule at Qwen3-Next's sizes (16 query/key heads,
32 value heads, 128 x 128 states), KDA at Kimi-Linear's (32 heads, 128 x 128 states, g a
per-channel log decay from `ops.kda.kda_gate`):

- prefill (ragged chunks from an initial state): hybridkv's `triton` ops (the chunked rule in
  PyTorch: `ops.gated_delta`, `ops.kda`) and its `fla` ops (`FlaGDNOps`, `FlaKdaOps`: fla's
  kernel behind hybridkv's paging) against fla's chunked kernel (`chunk_gated_delta_rule`,
  `chunk_kda`) called directly, timed with the gather of the initial states from their pages
  and the scatter of the final ones back, and alone ("kern");
- decode (one token per request): hybridkv's Triton decode kernels (`triton_gdn.gdn_decode`,
  `triton_kda.kda_decode`, in the pages) against fla's fused recurrent kernels
  (`fused_recurrent_gated_delta_rule`, `fused_recurrent_kda`), with and without that
  gather/scatter.

Both sides L2-normalise q and k (fla: `use_qk_l2norm_in_kernel`) and scale q by 1/sqrt(K);
`max_diff` is the largest absolute difference of the outputs. Times are medians of CUDA-event
timings. Without a GPU or without fla the script says so and exits 2; `--device cpu` runs tiny
sizes through Triton's interpreter (TRITON_INTERPRET=1) to check the wiring.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention import empty_cache, median_ms  # noqa: E402

QWEN3_NEXT = dict(k_heads=16, v_heads=32, k_dim=128, v_dim=128)
KIMI_LINEAR = dict(k_heads=32, v_heads=32, k_dim=128, v_dim=128)  # KDA: no grouped values
SHAPES = {"gdn": QWEN3_NEXT, "kda": KIMI_LINEAR}
TINY = {"gdn": dict(k_heads=2, v_heads=4, k_dim=16, v_dim=16),
        "kda": dict(k_heads=4, v_heads=4, k_dim=16, v_dim=16)}  # fmt: skip
PREFILL = [(1, 4096), (4, 1024), (16, 256), (64, 64)]  # (requests, tokens each)
DECODE = [64, 256]  # requests
TINY_CASES = [(2, 40), (3, 1)]


@dataclass
class Row:
    kind: str  # gdn or kda
    case: str
    requests: int
    tokens_each: int
    hybridkv_us: float
    fla_ops_us: float  # hybridkv's `fla` ops: fla's prefill, our decode, in pages
    fla_us: float
    fla_kernel_us: float  # fla without the gather/scatter of states (contiguous states)
    fla_over_hybridkv: float  # > 1: hybridkv faster
    max_diff: float


def _inputs(kind: str, requests: int, tokens_each: int, gen: torch.Generator, shape: dict,
            device: str):  # fmt: skip
    """Random rule inputs and a page pool -> (q, k, v, g, beta, state, pages, qsl); g: [T, Hv]
    for the gated delta net, [T, H, K] (per key channel) for KDA."""
    from hybridkv.ops.kda import kda_gate

    hk, hv, kd, vd = (shape[n] for n in ("k_heads", "v_heads", "k_dim", "v_dim"))
    t = requests * tokens_each

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = rand(t, hk, kd).bfloat16(), rand(t, hk, kd).bfloat16()
    v = rand(t, hv, vd).bfloat16()
    if kind == "gdn":
        g = torch.nn.functional.logsigmoid(rand(t, hv) + 3)  # decays near 1, as trained
    else:  # -exp(A_log) * softplus(f + dt_bias): decays near 1 too
        g = kda_gate(rand(t, hv * kd), 0.5 * rand(hv) - 1, 0.5 * rand(hv * kd) - 2)
    beta = torch.sigmoid(rand(t, hv))
    state = 0.1 * rand(2 * requests, hv, kd, vd)
    pages = torch.randperm(2 * requests, generator=gen)[:requests]
    qsl = torch.arange(requests + 1, dtype=torch.int32) * tokens_each
    return tuple(x.to(device) for x in (q, k, v, g, beta, state, pages, qsl))


def _kernels(kind: str):
    """(fla's chunked kernel, its fused recurrent one, hybridkv's triton ops, its fla ops): the
    fla kernels of both kinds take the same arguments."""
    if kind == "gdn":
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )

        from hybridkv.ops.gdn_ops import FlaGDNOps, TritonGDNOps

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, TritonGDNOps, FlaGDNOps
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    from hybridkv.ops.kda_ops import FlaKdaOps, TritonKdaOps

    return chunk_kda, fused_recurrent_kda, TritonKdaOps, FlaKdaOps


def bench(kind: str, requests: int, tokens_each: int, args) -> Row:
    from hybridkv.forward_batch import StateMetadata

    chunk, recurrent, triton_ops, fla_ops_class = _kernels(kind)
    gen = torch.Generator().manual_seed(requests * 7919 + tokens_each)
    shape = SHAPES[kind] if args.device == "cuda" else TINY[kind]
    q, k, v, g, beta, state0, pages, qsl = _inputs(kind, requests, tokens_each, gen, shape,
                                                   args.device)  # fmt: skip
    has = torch.ones(requests, dtype=torch.bool, device=args.device)
    meta = StateMetadata(pages, has, qsl, tokens_each)
    ops = triton_ops()
    state = state0.clone()
    ours = ops.rule(q, k, v, g, beta, state, meta)  # [T, Hv, V] float32
    fla_fn = chunk if tokens_each > 1 else recurrent
    fla_state = state0.clone()
    h0 = fla_state.index_select(0, pages)
    cu = qsl.long()

    def fla_kernel() -> torch.Tensor:
        o, ht = fla_fn(q[None], k[None], v[None], g=g[None], beta=beta[None],
                       initial_state=h0, output_final_state=True, cu_seqlens=cu,
                       use_qk_l2norm_in_kernel=True)  # fmt: skip
        return o, ht

    def fla_paged() -> torch.Tensor:
        o, ht = fla_fn(q[None], k[None], v[None], g=g[None], beta=beta[None],
                       initial_state=fla_state.index_select(0, pages), output_final_state=True,
                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)  # fmt: skip
        fla_state.index_copy_(0, pages, ht)
        return o

    o, _ = fla_kernel()
    diff = (ours - o[0].float()).abs().max().item()
    dev, iters = args.device, args.iters
    t_ours = median_ms(lambda: ops.rule(q, k, v, g, beta, state, meta), 3, iters, dev)
    fla_ops = fla_ops_class()
    t_ops = median_ms(lambda: fla_ops.rule(q, k, v, g, beta, state, meta), 3, iters, dev)
    t_fla = median_ms(fla_paged, 3, iters, dev)
    t_kernel = median_ms(fla_kernel, 3, iters, dev)
    empty_cache()
    case = "prefill" if tokens_each > 1 else "decode"
    return Row(kind, case, requests, tokens_each, t_ours * 1e3, t_ops * 1e3, t_fla * 1e3,
               t_kernel * 1e3, t_fla / t_ours, diff)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median)")
    ap.add_argument("--kinds", nargs="+", choices=["gdn", "kda"], default=["gdn", "kda"],
                    help="the layer kinds to time (default: both)")  # fmt: skip
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: tiny sizes through Triton's interpreter (a smoke run; set "
                         "TRITON_INTERPRET=1 before the start; times mean nothing)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_fla.py: no CUDA GPU here; this benchmark needs one", file=sys.stderr)
        return 2
    try:
        import fla  # noqa: F401
    except ImportError:
        print("gpu_fla.py: flash-linear-attention is not installed (pip install fla-core)",
              file=sys.stderr)  # fmt: skip
        return 2
    cases = [*PREFILL, *((r, 1) for r in DECODE)] if args.device == "cuda" else TINY_CASES
    if args.device == "cpu":
        args.iters = 1
    rows = [bench(kind, r, n, args) for kind in args.kinds for r, n in cases]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(f"{'kind':4} {'case':8} {'reqs':>5} {'tok/req':>7} {'triton ops us':>13} "
          f"{'fla ops us':>10} {'fla us':>10} {'fla kern us':>11} {'fla/triton':>10} "
          f"{'max diff':>9}")  # fmt: skip
    for r in rows:
        print(f"{r.kind:4} {r.case:8} {r.requests:5d} {r.tokens_each:7d} {r.hybridkv_us:13.1f} "
              f"{r.fla_ops_us:10.1f} {r.fla_us:10.1f} {r.fla_kernel_us:11.1f} "
              f"{r.fla_over_hybridkv:10.2f} {r.max_diff:9.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
