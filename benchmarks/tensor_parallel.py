"""Tensor parallelism on this machine: bytes all-reduced per decode step and per prefill token
(counted by the all-reduce wrapper, `TensorParallel.counter`, on rank 0: every rank makes the
same collectives), and generation throughput at TP=1 vs TP=2 (gloo, 2 processes).

On a 2-core CPU this is a correctness-and-overhead figure, not a speed-up claim: both ranks
share the same cores, and every all-reduce is a gloo round trip through the kernel.

    .venv/bin/python benchmarks/tensor_parallel.py [--requests 16] [--new-tokens 32] [--json]

Measured 2026-12-01 on the 2-core development CPU (float32, 16 requests, prompts 32..128, 32
new tokens, medians of 2 runs, other jobs sharing the machine), TP=2 over gloo:

    model        TP    tok/s  prefill B/tok  decode B/tok  AR/decode  logits B
    granite-moe   2     61.9         34,840        34,840         23     8,192
    granite-moe   1     66.2
    llama         2    340.0         18,432        18,432          9     8,192
    llama         1    646.9

Bytes per token are exact: one hidden vector (hidden x 4 bytes) per all-reduce of the
embedding, each mixer (attention / Mamba2) and each MLP or MoE (shared MLP and experts
reduced together), plus 4 bytes per Mamba2 layer whose one norm group spans the ranks
(granite-moe: 17 x 2,048 + 6 x 4); "logits B" is what each rank sends to rank 0 per sampled
token (its half of the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridkv.engine import Engine  # noqa: E402
from hybridkv.entrypoints.bench import random_prompts, run_hybridkv  # noqa: E402
from hybridkv.sampling_params import SamplingParams  # noqa: E402


def granite_moe(folder: Path) -> Path:
    """A random GraniteMoeHybrid (8 layers: 6 Mamba2 + 2 attention, hidden 512, 8 experts)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=256, shared_intermediate_size=1024,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
        mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
    )  # fmt: skip
    return _save(GraniteMoeHybridForCausalLM(cfg), folder / "granite-moe")


def llama(folder: Path) -> Path:
    """A random Llama (4 layers, hidden 512, 8 heads over 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    return _save(LlamaForCausalLM(cfg), folder / "llama")


def qwen3_next(folder: Path) -> Path:
    """A random Qwen3-Next (8 layers: 6 gated delta net + 2 gated attention, hidden 512, 8
    experts of which 2 per token plus the gated shared expert; 4 key / 8 value linear heads)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=512, decoder_sparse_step=1,
        full_attention_interval=4, max_position_embeddings=2048,
    )  # fmt: skip
    return _save(Qwen3NextForCausalLM(cfg), folder / "qwen3-next")


MODELS = {"granite-moe": granite_moe, "llama": llama, "qwen3-next": qwen3_next}


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def bytes_per_token(folder: Path, size: int, prompt_len: int = 64) -> dict[str, float]:
    """All-reduce bytes of one prefill of `prompt_len` tokens (per token) and of one decode
    step of one request; also the logits gathered per sampled token."""
    engine = Engine(str(folder), dtype="float32", tensor_parallel_size=size)
    try:
        counter = engine.tp.counter
        ids = list(range(1, prompt_len + 1))
        engine.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True))
        counter.reset()
        engine.step()  # the whole prompt in one step
        prefill = counter.all_reduce_bytes / prompt_len
        calls_prefill = counter.all_reduce_calls
        counter.reset()
        engine.step()  # one decode token
        decode, calls, gather = (
            counter.all_reduce_bytes, counter.all_reduce_calls, counter.gather_bytes
        )  # fmt: skip
        while engine.has_unfinished:
            engine.step()
        return {
            "prefill_bytes_per_token": prefill,
            "prefill_all_reduces": calls_prefill,
            "decode_bytes_per_token": decode,
            "decode_all_reduces": calls,
            "logits_gathered_bytes": gather,
        }
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--sizes", nargs="*", type=int, default=[2, 4], help="sizes whose bytes are counted"
    )
    parser.add_argument(
        "--timed-sizes", nargs="*", type=int, default=[2, 1], help="sizes whose tokens/s is timed"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            torch.manual_seed(0)
            folder = MODELS[name](Path(tmp))
            prompts = random_prompts(4096, args.requests, args.min_prompt, args.max_prompt, 0)
            tokens = args.requests * args.new_tokens
            for size in sorted(set(args.sizes) | set(args.timed_sizes), reverse=True):
                row: dict = {"model": folder.name, "tensor_parallel_size": size}
                if size > 1 and size in args.sizes:
                    row.update(bytes_per_token(folder, size))
                if size in args.timed_sizes:
                    seconds = run_hybridkv(
                        str(folder), prompts, args.new_tokens, repeat=args.repeat,
                        tensor_parallel_size=size,
                    )  # fmt: skip
                    row["tokens_per_s"] = round(tokens / seconds, 1)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<12} {'TP':>2} {'tok/s':>8} {'prefill B/tok':>14} {'decode B/tok':>13} "
          f"{'AR/decode':>9} {'logits B':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:<12} {r['tensor_parallel_size']:>2} {r.get('tokens_per_s', '-'):>8} "
            f"{r.get('prefill_bytes_per_token', 0):>14,.0f} "
            f"{r.get('decode_bytes_per_token', 0):>13,} {r.get('decode_all_reduces', 0):>9} "
            f"{r.get('logits_gathered_bytes', 0):>9,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
