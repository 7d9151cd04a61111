"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

For each model, workload and batch size: decode tokens/s (the steps after the prompts': every
token but each request's first, over the time of the steps without prompt tokens; `e2e`: the
speedup of whole requests, prompts included) without drafts and with
`num_speculative_tokens` k in --ks (prompt_lookup_min 2, max 5), k drafts every step or
`adaptive_k` (--policies; "-rewind": with the state ops' per-position states turned off, so
a rejection on a state model restores and recomputes, as before they existed), greedy, EOS
ignored, prefix caching off; the speedup over plain
decoding, the acceptance rate and the mean accepted length (tokens per verify step and request,
the bonus token included). Medians of --repeat rounds after a warm-up pass over the same
workload; every engine of a row is built first and their rounds interleave (the order rotated
each round), so a load that comes and goes on the machine hits plain and speculative alike.
Each run also checks that the tokens equal plain decoding's.

Workloads:
- "repeat": documents that repeat passages (three random 48-token passages, then the first two
  again, then the start of the third): the continuation copies, as in code editing or quoting,
  where prompt lookup shines;
- "random": random token ids: nothing to look up, so almost no drafts (the cost of having
  speculation on when it cannot help);
- "code" (the built-in default model only, which has a tokenizer and was trained on code):
  four Python sources that define similar functions; at batch 1 the four one after another
  (two of them the model continues by repeating itself, two not), at batch b cycled to b.

    python benchmarks/speculative.py                       # default model + "100m", ~5 minutes
    python benchmarks/speculative.py --models default --batches 1 --repeat 1   # quick

`--method mtp`: the checkpoint's multi-token-prediction layer drafts instead (model
"qwen3.5-100m": a Qwen3.5 dense hybrid of 100M parameters, 3 gated-delta-net layers per
gated attention layer, with one MTP layer; random weights, so the drafts the MTP passes compute
are replaced by the plain run's tokens, every --oracle N-th call with a wrong one, default 0:
all right). What it measures: the MTP passes (they run, their drafts are discarded) plus the
verify steps, against plain decoding, at a set acceptance:

    python benchmarks/speculative.py --method mtp --ks 1 2 --oracle 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "class Queue:\n    def __init__(self):",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):",
    "import os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n"
    "        return json.load(f)\n\n\ndef save(path, data):\n    with open(path, 'w') as f:",
]


def repeat_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = ([rng.randrange(vocab) for _ in range(48)] for _ in range(3))
        out.append(a + b + c + a + b + c[:8])
    return out


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(240)] for _ in range(n)]


class Oracle:
    """Drafts from a plain run's tokens (`--oracle`): every `spoil`-th draft is wrong, so the
    acceptance rate is set by the benchmark, not by how well the model copies (random weights
    never do). Measures what a verify step costs against the decode steps it replaces."""

    def __init__(self, prompts, tokens, spoil: int) -> None:
        self.refs = {tuple(p): t for p, t in zip(prompts, tokens, strict=True)}
        self.spoil = spoil
        self.calls = 0

    def __call__(self, req, max_drafts: int) -> list[int]:
        j = req.num_output_tokens
        drafts = list(self.refs[tuple(req.prompt_token_ids)][j : j + max_drafts])
        self.calls += 1
        if self.spoil and drafts and self.calls % self.spoil == 0:
            drafts[len(drafts) // 2] += 1  # a wrong draft in the middle
        return drafts


# Qwen3.5 dense (transformers' Qwen3_5TextConfig): 100M parameters, 12 layers (a gated
# attention layer every 4th), with one MTP layer written beside them (`--method mtp`)
QWEN35_100M = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
    max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
)  # fmt: skip


def save_mtp_checkpoint(folder: Path) -> tuple[Path, int]:
    """The "qwen3.5-100m" checkpoint with seeded random weights and an MTP layer; (folder,
    vocabulary size)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.models.utils import save_tokenizer
    from tests.spec_decode.mtp_checkpoints import add_mtp

    cfg = Qwen3_5TextConfig(**QWEN35_100M)
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(cfg)
    path = folder / "qwen3.5-100m"
    hf.save_pretrained(path)
    save_tokenizer(path, cfg.vocab_size)
    add_mtp(path, hf)
    return path, cfg.vocab_size


def oracle_mtp(llm, oracle: Oracle) -> None:
    """The MTP layer's passes run as always; the drafts they made are replaced by the
    oracle's (padded with the layer's own where the reference ends)."""
    from hybridkv.core.scheduler import replace_drafts

    drafter, scheduler = llm.engine.runner.mtp, llm.engine.scheduler
    step = drafter.step

    def with_oracle(chunks):  # type: ignore[no-untyped-def]
        chunks, drafts = step(chunks)
        chosen = {}
        for rid, made in drafts.items():
            right = list(oracle(scheduler.request(rid), len(made)))
            chosen[rid] = tuple(right + list(made[len(right) :]))
        return replace_drafts(chunks, chosen), chosen

    drafter.step = with_oracle


class Engine:
    """One engine of the comparison: built and warmed up once, then timed a round at a time,
    so that plain and speculative rounds interleave and the machine's drift hits both alike."""

    def __init__(
        self,
        model: str | None,
        groups: list[list],
        new_tokens: int,
        k: int,
        oracle: Oracle | None = None,
        adaptive: bool = False,
        rewind: bool = False,
        method: str = "ngram",
    ) -> None:
        """`rewind`: the engine built as if no state ops kept per-position states."""
        from hybridkv import LLM, SamplingParams
        from hybridkv.ops.mamba2_ops import NativeMamba2Ops

        spec = None
        if k and method == "mtp":
            spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_k": adaptive}
        elif k:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5, "adaptive_k": adaptive}  # fmt: skip
        kept = NativeMamba2Ops.keeps_positions
        NativeMamba2Ops.keeps_positions = kept and not rewind
        try:  # the plan reads it when the engine is built
            self.llm = LLM(model, dtype="float32", max_num_seqs=max(len(g) for g in groups),
                           enable_prefix_caching=False, speculative_config=spec)  # fmt: skip
        finally:
            NativeMamba2Ops.keeps_positions = kept
        self.k, self.groups, self.new_tokens = k, groups, new_tokens
        self.params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        if oracle is not None and method == "mtp":
            oracle_mtp(self.llm, oracle)
        elif oracle is not None:
            self.llm.engine.scheduler.drafter = oracle
        # warm-up: one pass over every group (adaptive_k also measures its shapes here)
        self.tokens = self._generate()
        self.steps = _time_steps(self.llm.engine)
        self.times: list[float] = []
        self.decode_times: list[float] = []

    def _generate(self) -> list[list[int]]:
        outs = [o for g in self.groups for o in self.llm.generate(g, self.params, use_tqdm=False)]
        return [o.outputs[0].token_ids for o in outs]

    def round(self) -> None:
        """One timed pass over every group; the acceptance counts are this pass's."""
        self.llm.engine.spec_stats = type(self.llm.engine.spec_stats)()
        self.steps.clear()
        start = time.perf_counter()
        self.tokens = self._generate()
        self.times.append(time.perf_counter() - start)
        self.decode_times.append(sum(s for s, prompt in self.steps if not prompt))

    def result(self) -> dict:
        stats = self.llm.engine.spec_stats
        seconds = statistics.median(self.times)
        decode_seconds = statistics.median(self.decode_times)
        num_requests = sum(len(g) for g in self.groups)
        return {
            # decode: the steps without prompt tokens, which make every token but each first one
            "tokens_per_s": num_requests * (self.new_tokens - 1) / decode_seconds,
            "e2e_tokens_per_s": num_requests * self.new_tokens / seconds,
            "seconds": seconds,
            "acceptance": stats.acceptance_rate if self.k else None,
            "mean_len": stats.mean_accepted_length if self.k else None,
            "tokens": self.tokens,
        }


def interleave(engines: list[Engine], repeat: int) -> None:
    """`repeat` rounds of every engine, the order rotated each time (plain first, then last)."""
    for i in range(repeat):
        for engine in engines[i % len(engines):] + engines[: i % len(engines)]:
            engine.round()


def _time_steps(engine) -> list[tuple[float, bool]]:
    """(seconds, whether it computed prompt tokens) of each engine step from now on."""
    steps: list[tuple[float, bool]] = []
    schedule, step = engine.scheduler.schedule, engine.step
    prompt = [False]

    def scheduled():
        out = schedule()
        prompt[0] = any(
            c.start < engine.scheduler.request(c.request_id).num_prompt_tokens for c in out.chunks
        )
        return out

    def timed():
        start = time.perf_counter()
        result = step()
        steps.append((time.perf_counter() - start, prompt[0]))
        return result

    engine.scheduler.schedule, engine.step = scheduled, timed
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=["ngram", "mtp"], default="ngram",
                   help="ngram: prompt lookup; mtp: the MTP layer of model qwen3.5-100m, with "
                   "the oracle's drafts (module docstring)")
    p.add_argument("--models", nargs="+", default=None,
                   help="default: 'default 100m' (ngram), 'qwen3.5-100m' (mtp)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--ks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--oracle", type=int, default=None, metavar="N",
                   help="drafts from the plain run's tokens, every N-th call with a wrong one "
                   "(0: all right); measures the verify step's cost at a set acceptance")
    p.add_argument("--policies", nargs="+", default=["k", "adaptive"],
                   choices=["k", "adaptive", "k-rewind", "adaptive-rewind"],
                   help="k: k drafts every step; adaptive: adaptive_k (at most k, chosen per "
                   "step from measured step times); -rewind: without per-position states")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.models is None:
        args.models = ["qwen3.5-100m"] if args.method == "mtp" else ["default", "100m"]
    if args.method == "mtp" and args.oracle is None:
        args.oracle = 0
    if args.method == "mtp" and args.models != ["qwen3.5-100m"]:
        p.error(f"--method mtp runs model 'qwen3.5-100m' only, got {args.models}")
    policies = [(p.startswith("adaptive"), p.endswith("-rewind")) for p in args.policies]

    import torch

    from hybridkv.ops.native.cpu import line

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "default":
                model, vocab = None, None
                workloads = ["code", "repeat", "random"]
            elif name == "qwen3.5-100m":
                path, vocab = save_mtp_checkpoint(Path(tmp))
                model, workloads = str(path), ["random"]
            else:
                from throughput import save_checkpoint

                path, _ = save_checkpoint(name, Path(tmp))
                model = str(path)
                vocab = json.loads((path / "config.json").read_text())["vocab_size"]
                workloads = ["repeat", "random"]
            if vocab is None:
                from hybridkv.engine import DEFAULT_MODEL

                vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
            for workload in workloads:
                for batch in args.batches:
                    if workload == "code":  # batch 1: the four sources one after another
                        groups = [[c] for c in CODE] if batch == 1 else [(CODE * batch)[:batch]]
                    elif workload == "repeat":
                        groups = [repeat_prompts(vocab, batch, seed=batch)]
                    else:
                        groups = [random_prompts(vocab, batch, seed=batch)]
                    prompts = [p for g in groups for p in g]
                    plain = Engine(model, groups, args.new_tokens, 0)
                    configs = [(k, a) for k in args.ks for a in policies]
                    spec = []
                    for k, (adaptive, rewind) in configs:
                        oracle = None
                        if args.oracle is not None:
                            oracle = Oracle(prompts, plain.tokens, args.oracle)
                        spec.append(Engine(model, groups, args.new_tokens, k, oracle, adaptive,
                                           rewind, args.method))  # fmt: skip
                    interleave([plain, *spec], args.repeat)
                    base = plain.result()
                    for (k, (adaptive, rewind)), engine in zip(configs, spec, strict=True):
                        r = engine.result()
                        rows.append({
                            "model": name, "method": args.method, "workload": workload,
                            "oracle": args.oracle,
                            "batch": batch, "k": k, "adaptive": adaptive, "rewind": rewind,
                            "plain_tok_s": base["tokens_per_s"], "spec_tok_s": r["tokens_per_s"],
                            "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                            "e2e_speedup": r["e2e_tokens_per_s"] / base["e2e_tokens_per_s"],
                            "acceptance": r["acceptance"], "mean_len": r["mean_len"],
                            "same_tokens": r["tokens"] == base["tokens"],
                        })  # fmt: skip
                        print_row(rows[-1], header=len(rows) == 1)
                    del plain, spec
    if args.json:
        print(json.dumps({"cpu": line(), "rows": rows}, indent=1))
    else:
        print(f"\n{line()}; threads {torch.get_num_threads()}")


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'model':8} {'workload':8} {'batch':>5} {'k':>2} {'policy':15} {'plain tok/s':>11} "
              f"{'spec tok/s':>10} {'speedup':>7} {'e2e':>6} {'accept':>6} {'mean len':>8} "
              "same")  # fmt: skip
    policy = ("adaptive" if r["adaptive"] else "k") + ("-rewind" if r["rewind"] else "")
    print(f"{r['model']:8} {r['workload']:8} {r['batch']:5d} {r['k']:2d} {policy:15} "
          f"{r['plain_tok_s']:11.1f} {r['spec_tok_s']:10.1f} {r['speedup']:6.2f}x "
          f"{r['e2e_speedup']:5.2f}x {r['acceptance']:6.2f} {r['mean_len']:8.2f} "
          f"{'yes' if r['same_tokens'] else 'NO'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
