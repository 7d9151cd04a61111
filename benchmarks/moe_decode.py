"""Decode tokens/s of a small GraniteMoeHybrid MoE model (issue 29: native MoE on every CPU).

`--model nemotron_h`: a Nemotron-H-like MoE instead (NEMOTRON_H: 10 layers M E M * E M E M * E,
hidden 768, top-6 of 32 relu2 experts (intermediate 256) in 4 groups of which 2 are kept,
sigmoid scores with a choice bias, a shared expert of 512; a float32 router, as transformers
keeps it).

The model: benchmarks/throughput.py's 100m layout (8 Mamba2 + 2 attention layers, hidden 768)
with a MoE on every layer: top-4 of 16 routed SwiGLU experts (intermediate 256) beside the
shared MLP (1024), random weights (~140M parameters). Prompts of 16 tokens; a batch of B
requests generates 1 token (the prefill) and then 1 + N tokens; decode tokens/s = B * N over
the difference of the two times (medians of --repeats, after a warm-up run that captures the
decode steps).

    python benchmarks/moe_decode.py --dtype float32 bfloat16 --batch 1 8

Run it at two commits (a `git worktree` of the commit before, PYTHONPATH pointing at it) for
before / after; under the AVX2 simulation with HYBRIDKV_NATIVE_MARCH=x86-64-v3
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2.
`--no-amx-moe`: bfloat16 without the AMX router and experts (what an AVX-512 CPU without AMX
runs for the MoE; the other layers keep their AMX kernels)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=256, shared_intermediate_size=1024,
    num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
    layer_types=["mamba"] * 4 + ["attention"] + ["mamba"] * 4 + ["attention"],
    mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=128,
    num_local_experts=16, num_experts_per_tok=4, position_embedding_type="rope",
    max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
)  # fmt: skip


NEMOTRON_H = dict(
    vocab_size=32000, hidden_size=768, hybrid_override_pattern="MEM*EMEM*E",
    num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=1024,
    mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=64, n_groups=8, chunk_size=128,
    n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=256,
    moe_shared_expert_intermediate_size=512, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, max_position_embeddings=2048, tie_word_embeddings=True,
    initializer_range=0.02, mamba_ssm_cache_dtype="float32",
)  # fmt: skip


def save(folder: Path, model_name: str = "granite") -> Path:
    import transformers

    from tests.models.utils import save_tokenizer

    torch.manual_seed(0)
    if model_name == "nemotron_h":
        cfg = transformers.NemotronHConfig(**NEMOTRON_H)
        model = transformers.NemotronHForCausalLM(cfg)
        with torch.no_grad():  # a choice bias that matters
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.05)
    else:
        cfg = transformers.GraniteMoeHybridConfig(**CONFIG)
        model = transformers.GraniteMoeHybridForCausalLM(cfg)
    model.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    return folder


def measure(folder: Path, dtype: str, batch: int, new: int, repeats: int) -> tuple[float, str]:
    from hybridkv import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, CONFIG["vocab_size"], (batch, 16), generator=g).tolist()

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(new + 1)  # warm-up: packs, captures
    rates = []
    for _ in range(repeats):
        prefill, full = run(1), run(new + 1)
        rates.append(batch * new / (full - prefill))
    graphs = llm.engine.runner.graphs
    how = "captured" if graphs.disabled is None and graphs.replays else "eager"
    return statistics.median(rates), how


def layer_times(dtype: torch.dtype, tokens: int, reps: int) -> dict[str, float]:
    """Median microseconds of one MoE layer of CONFIG's shape (router + experts) on T tokens:
    the native router and experts (moe.c, one call each) against the PyTorch chains, the
    calls interleaved so that a noisy machine slows both alike."""
    from hybridkv.layers import mlp, moe
    from hybridkv.ops.native import moe as native_moe

    hidden, experts, k = CONFIG["hidden_size"], CONFIG["num_local_experts"], 4
    inter = CONFIG["intermediate_size"]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = torch.nn.Linear(hidden, experts, bias=False).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / 28).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / 16).to(dtype)
    rule = moe.RoutingRule(k, "topk_softmax")

    def native() -> None:
        chosen, weights = native_moe.vector_route(x, gate.weight, k, rule.native_mode)
        native_moe.vector_experts(x, chosen, weights, gate_up, down)

    def pytorch() -> None:
        routing = moe.torch_route(x, gate, rule, None)
        pairs = mlp.ExpertPairs(routing.experts, routing.weights.to(dtype), experts)
        mlp.torch_experts(x, pairs, gate_up, down)

    times: dict[str, list[float]] = {"native": [], "torch": []}
    with torch.inference_mode():
        for _ in range(reps):
            for name, fn in (("native", native), ("torch", pytorch)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-amx-moe", action="store_true")
    p.add_argument("--model", choices=["granite", "nemotron_h"], default="granite")
    p.add_argument("--layer", action="store_true", help="one MoE layer, native vs PyTorch")
    args = p.parse_args()
    if args.layer:
        for dtype in args.dtype:
            for batch in args.batch:
                t = layer_times(getattr(torch, dtype), batch, 200)
                print(
                    f"{dtype:9s} T {batch:2d}: native {t['native']:7.0f} us, PyTorch "
                    f"{t['torch']:7.0f} us ({t['torch'] / t['native']:.2f}x)",
                    flush=True,
                )
        return
    if args.no_amx_moe:
        from hybridkv.layers import mlp, moe

        mlp.amx_experts_fit = lambda *a, **k: False
        moe.native_route_fits = lambda *a, **k: False
    with tempfile.TemporaryDirectory() as tmp:
        folder = save(Path(tmp) / args.model, args.model)
        for dtype in args.dtype:
            for batch in args.batch:
                rate, how = measure(folder, dtype, batch, args.new_tokens, args.repeats)
                print(f"{dtype:9s} batch {batch:2d}: {rate:7.1f} tokens/s ({how})", flush=True)


if __name__ == "__main__":
    main()
