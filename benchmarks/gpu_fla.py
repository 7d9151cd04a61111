"""hybridkv's gated-delta-net ops against flash-linear-attention (fla-core) on a GPU.

    python benchmarks/gpu_fla.py            # a table (needs `fla` importable: fla-core)
    python benchmarks/gpu_fla.py --json     # the same numbers as JSON

One gated-delta-rule call of one layer at Qwen3-Next's sizes (16 query/key heads, 32 value
heads, 128 x 128 states), float32 state pages scattered in a pool twice the batch, q/k/v in
bfloat16, g and beta in float32:

- prefill (ragged chunks from an initial state): hybridkv's `triton` GDN ops (the chunked rule
  in PyTorch, `ops.gated_delta`) and its `fla` ops (`FlaGDNOps`: fla's kernel behind hybridkv's
  paging) against fla's `chunk_gated_delta_rule` (Triton, the kernel vLLM and SGLang run)
  called directly, timed with the gather of the initial states from their pages and the
  scatter of the final ones back, and alone ("kern");
- decode (one token per request): hybridkv's Triton decode kernel (`triton_gdn.gdn_decode`,
  in the pages) against fla's `fused_recurrent_gated_delta_rule`, with and without that
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
TINY = dict(k_heads=2, v_heads=4, k_dim=16, v_dim=16)
PREFILL = [(1, 4096), (4, 1024), (16, 256), (64, 64)]  # (requests, tokens each)
DECODE = [64, 256]  # requests
TINY_CASES = [(2, 40), (3, 1)]


@dataclass
class Row:
    case: str
    requests: int
    tokens_each: int
    hybridkv_us: float
    fla_ops_us: float  # hybridkv's `fla` ops (FlaGDNOps): fla's prefill, our decode, in pages
    fla_us: float
    fla_kernel_us: float  # fla without the gather/scatter of states (contiguous states)
    fla_over_hybridkv: float  # > 1: hybridkv faster
    max_diff: float


def _inputs(requests: int, tokens_each: int, gen: torch.Generator, shape: dict, device: str):
    """Random rule inputs and a page pool -> (q, k, v, g, beta, state, pages, qsl)."""
    hk, hv, kd, vd = (shape[n] for n in ("k_heads", "v_heads", "k_dim", "v_dim"))
    t = requests * tokens_each

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = rand(t, hk, kd).bfloat16(), rand(t, hk, kd).bfloat16()
    v = rand(t, hv, vd).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(t, hv) + 3)  # decays near 1, as trained
    beta = torch.sigmoid(rand(t, hv))
    state = 0.1 * rand(2 * requests, hv, kd, vd)
    pages = torch.randperm(2 * requests, generator=gen)[:requests]
    qsl = torch.arange(requests + 1, dtype=torch.int32) * tokens_each
    return tuple(x.to(device) for x in (q, k, v, g, beta, state, pages, qsl))


def bench(requests: int, tokens_each: int, args) -> Row:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from hybridkv.forward_batch import StateMetadata
    from hybridkv.ops.gdn_ops import FlaGDNOps, TritonGDNOps

    gen = torch.Generator().manual_seed(requests * 7919 + tokens_each)
    shape = QWEN3_NEXT if args.device == "cuda" else TINY
    q, k, v, g, beta, state0, pages, qsl = _inputs(requests, tokens_each, gen, shape, args.device)
    has = torch.ones(requests, dtype=torch.bool, device=args.device)
    meta = StateMetadata(pages, has, qsl, tokens_each)
    ops = TritonGDNOps()
    state = state0.clone()
    ours = ops.rule(q, k, v, g, beta, state, meta)  # [T, Hv, V] float32
    fla_fn = chunk_gated_delta_rule if tokens_each > 1 else fused_recurrent_gated_delta_rule
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
    fla_ops = FlaGDNOps()
    t_ops = median_ms(lambda: fla_ops.rule(q, k, v, g, beta, state, meta), 3, iters, dev)
    t_fla = median_ms(fla_paged, 3, iters, dev)
    t_kernel = median_ms(fla_kernel, 3, iters, dev)
    empty_cache()
    case = "prefill" if tokens_each > 1 else "decode"
    return Row(case, requests, tokens_each, t_ours * 1e3, t_ops * 1e3, t_fla * 1e3,
               t_kernel * 1e3, t_fla / t_ours, diff)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median)")
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
    rows = [bench(r, n, args) for r, n in cases]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(f"{'case':8} {'reqs':>5} {'tok/req':>7} {'triton ops us':>13} {'fla ops us':>10} "
          f"{'fla us':>10} {'fla kern us':>11} {'fla/triton':>10} {'max diff':>9}")  # fmt: skip
    for r in rows:
        print(f"{r.case:8} {r.requests:5d} {r.tokens_each:7d} {r.hybridkv_us:13.1f} "
              f"{r.fla_ops_us:10.1f} {r.fla_us:10.1f} {r.fla_kernel_us:11.1f} "
              f"{r.fla_over_hybridkv:10.2f} {r.max_diff:9.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
