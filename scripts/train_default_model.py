'''Train hybridkv's built-in default model: a tiny, real GraniteMoeHybrid (Mamba2 + attention).

Every ``hybridkv`` command falls back to this checkpoint when ``--model`` is not given. It is
trained from scratch on text that exists on any machine with Python, the standard library's own
``.py`` sources, so the whole thing can be rebuilt offline:

    .venv/bin/python scripts/train_default_model.py            # writes hybridkv/default_model/

Corpus: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted order, skipping
``test``/``tests``/``idlelib``/``site-packages`` folders and the two data-only packages
``encodings`` (codec tables) and ``pydoc_data`` (one 750 kB string of docs). About 3% of the files
(chosen by a hash of their relative path) are held out for validation. Files are joined with
``<|endoftext|>``. The corpus depends on the Python version, so bit-exact reproduction needs the
same Python (3.11.7 below), torch and tokenizers versions, and one thread.

Tokenizer: byte-level BPE (``tokenizers``), 4096 entries, ``<|endoftext|>`` = id 0 as bos/eos/pad.

Model (dense GraniteMoeHybrid: ``num_local_experts=0``, one shared SiLU-gated MLP per layer):
hidden 256, 6 layers ``mamba mamba attention mamba mamba attention``; attention: 4 query heads,
2 KV heads, head_dim 64, RoPE (theta 10000), ``attention_multiplier`` 0.125 (= 1/sqrt(64));
Mamba2: expand 2 (d_inner 512), ``mamba_n_heads`` 8, ``mamba_d_head`` 64, ``mamba_d_state`` 64,
``mamba_n_groups`` 1, ``mamba_d_conv`` 4, ``mamba_chunk_size`` 64; shared MLP 320; tied
embeddings; ``max_position_embeddings`` 2048; float32 weights.

Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to
10% of the peak LR, gradient clipping at 1.0, random windows of the tokenised training stream.

Recorded run (``--seed 0 --threads 1``, all other options at their defaults):

    python 3.11.7, torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3
    corpus              550 files, 9,182,422 bytes (535 train / 15 validation files)
    tokens              2,493,522 train, 48,508 validation (3.61 bytes/token), vocab 4096
    parameters          4,646,752 (model.safetensors 18,593,960 bytes, float32)
    steps               1700 x 8 sequences x 256 tokens (3.48M tokens, ~1.4 epochs), peak LR 2e-3
    final train loss    2.6956 (mean of the last 50 steps; 7.11 over steps 1-50)
    validation loss     2.8202 (perplexity 16.8; 96 windows of 256 tokens)
    wall time           2862 s (2842 s training; 1225-1480 tokens/s, one core of a shared machine)

    Greedy completion of "def fibonacci(n):", first 40 new tokens (the script prints 96; the
    rest keeps repeating ``normcase(``, as greedy decoding of a model this small does):

        def fibonacci(n):
            """Return a muman-aclished in the current one."""
            return _normcase(normcase(normcase(normcase(normcase(
'''

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "hybridkv" / "default_model"
EOS = "<|endoftext|>"
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "encodings", "pydoc_data"})
VAL_PERCENT = 3
SIZE_LIMIT_BYTES = 20_000_000
SAMPLE_PROMPT = "def fibonacci(n):"
# Legacy layer names, as the published Granite 4.0-H configs spell them; transformers 5 maps
# them to "linear_attention" / "full_attention" on load and older releases only know these.
LEGACY_LAYER_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


@dataclass
class Corpus:
    train_texts: list[str]
    val_texts: list[str]
    n_files: int
    n_bytes: int


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's ``.py`` files in a deterministic (sorted) order."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def build_corpus() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    n_bytes = 0
    files = stdlib_files(root)
    for path in files:
        raw = path.read_bytes()
        n_bytes += len(raw)
        text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
        (val if is_validation(path.relative_to(root).as_posix()) else train).append(text)
    return Corpus(train, val, len(files), n_bytes)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenised and joined, each followed by ``<|endoftext|>``."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, eos_id: int) -> GraniteMoeHybridConfig:
    hidden = 256
    return GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=6,
        layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_multiplier=1.0 / math.sqrt(hidden // 4),
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=320,
        shared_intermediate_size=320,
        hidden_act="silu",
        mamba_expand=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of ``stream``."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total = 0.0
    for i in range(0, n, 8):
        rows = [stream[j * seq_len : (j + 1) * seq_len] for j in range(i, min(n, i + 8))]
        batch = torch.stack(rows)
        total += model(input_ids=batch, labels=batch).loss.item() * len(rows)
    model.train()
    return total / n


def greedy_sample(model: GraniteMoeHybridForCausalLM, tok: Tokenizer, prompt: str, n: int) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
    )
    return tok.decode(out[0].tolist())


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text)


def legacy_layer_names(out: Path) -> None:
    """Write ``config.json`` as the published Granite 4.0-H checkpoints spell it."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["layer_types"] = [LEGACY_LAYER_NAMES.get(t, t) for t in cfg["layer_types"]]
    # (0, inf) is the default; transformers 5 would write the infinity as a tagged object.
    if cfg.get("time_step_limit") in ([0.0, {"__float__": "Infinity"}], [0.0, float("inf")]):
        del cfg["time_step_limit"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1700)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--val-windows", type=int, default=96)
    ap.add_argument("--sample-tokens", type=int, default=96)
    args = ap.parse_args()

    # Rayon (tokenizers) reads these when its pool first starts, which is after this point.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    corpus = build_corpus()
    tok = train_tokenizer(corpus.train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    train_ids = token_stream(tok, corpus.train_texts)
    val_ids = token_stream(tok, corpus.val_texts)
    train_bytes = sum(len(t.encode()) for t in corpus.train_texts)
    print(
        f"corpus: {corpus.n_files} files, {corpus.n_bytes:,} bytes "
        f"({len(corpus.train_texts)} train / {len(corpus.val_texts)} val files); "
        f"tokens: {len(train_ids):,} train, {len(val_ids):,} val; "
        f"{train_bytes / len(train_ids):.2f} bytes/token; vocab {tok.get_vocab_size()}",
        flush=True,
    )

    config = model_config(tok.get_vocab_size(), eos_id)
    torch.manual_seed(args.seed)
    model = GraniteMoeHybridForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, layer_types {config.layer_types}", flush=True)

    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    high = len(train_ids) - args.seq_len - 1
    t_train = time.time()
    window: list[float] = []
    last_train_loss = float("nan")
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, high, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            last_train_loss = sum(window) / len(window)
            elapsed = time.time() - t_train
            tok_s = (step + 1) * args.batch_size * args.seq_len / elapsed
            print(
                f"step {step + 1:5d}/{args.steps}  loss {last_train_loss:.4f}  lr {lr:.2e}  "
                f"{elapsed:7.1f}s  {tok_s:6.0f} tok/s",
                flush=True,
            )
            window = []
    train_time = time.time() - t_train

    val_loss = evaluate(model, val_ids, args.seq_len, args.val_windows)
    print(f"validation loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f})", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    model.save_pretrained(args.out)
    legacy_layer_names(args.out)
    save_tokenizer(tok, args.out, config.max_position_embeddings)

    sample = greedy_sample(model, tok, SAMPLE_PROMPT, args.sample_tokens)
    wall = time.time() - t_start
    files = ["config.json", "generation_config.json", "model.safetensors"]
    files += ["tokenizer.json", "tokenizer_config.json"]
    sizes = {name: (args.out / name).stat().st_size for name in files}
    total = sum(sizes.values())
    print(f"files in {args.out}: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
    print(f"total {total:,} bytes (limit {SIZE_LIMIT_BYTES:,})")
    if total > SIZE_LIMIT_BYTES:
        raise SystemExit("the saved model is over the size limit")
    print("--- summary ---")
    print(f"seed                {args.seed}")
    print(f"python / torch      {platform.python_version()} / {torch.__version__}")
    print(f"transformers        {transformers.__version__}, tokenizers {tokenizers.__version__}")
    print(f"corpus              {corpus.n_files} files, {corpus.n_bytes:,} bytes")
    print(f"tokens              {len(train_ids):,} train, {len(val_ids):,} validation")
    print(f"steps               {args.steps} x {args.batch_size} x {args.seq_len} tokens")
    print(f"final train loss    {last_train_loss:.4f} (mean of the last {args.log_every} steps)")
    print(f"validation loss     {val_loss:.4f}")
    print(f"wall time           {wall:.0f} s ({train_time:.0f} s training)")
    print(f"parameters          {n_params:,}")
    print(f"sample (greedy)     {SAMPLE_PROMPT!r} ->")
    print(sample)


if __name__ == "__main__":
    main()
