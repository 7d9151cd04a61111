"""Grammar-mask cost per decode step: xgrammar against llguidance, side by side.

Why: structured outputs (response_format / guided_*) add a CPU step to every decode step of
every constrained request: fill the request's next-token bitmask, then advance its matcher by
the sampled token. At 64 concurrent requests that cost lands on the engine thread between two
forward passes, so the backend is chosen by this number, measured here on this CPU.

What it measures, for each tokenizer (the default model's 4096-token byte-level BPE and a
~150k-token byte-level BPE trained here on generated text, the shape of real LLM vocabularies):

* fill 1 / accept 1: one matcher walking a valid output of a medium JSON schema; median us per
  step of filling its bitmask row (and the 90th percentile: a batch of 64 rows almost always
  contains a slow row, so the tail sets the batch cost), and of accepting the next token;
* fill 64 seq / fill 64 par: 64 matchers, each walking its own valid output; median us per
  step to fill all 64 rows, one row after another (the per-row API) or with the library's
  own batch call (a thread pool);
* accept 64: median us per step to accept one token in each of the 64 matchers;
* compile cold / cached: the medium schema from nothing to a usable matcher, and again when
  the compiled grammar is cached (xgrammar: its compiler cache + a new matcher; llguidance:
  deep_copy of a template matcher, which is what hybridkv.structured does);
* tokenizer: one-off cost of building the library's tokenizer view.

Run: .venv/bin/python benchmarks/structured_mask.py [--steps N] [--skip-big]
Needs both `xgrammar` and `llguidance` installed (xgrammar also imports `transformers`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "hybridkv" / "default_model"
BATCH = 64
THREADS = 2

MEDIUM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "status": {"enum": ["new", "open", "closed", "archived"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{2,8}$"},
            "minItems": 1,
            "maxItems": 4,
        },
        "owner": {
            "type": "object",
            "properties": {
                "login": {"type": "string", "pattern": "^[a-z][a-z0-9]{2,10}$"},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "email": {"type": "string", "maxLength": 40},
            },
            "required": ["login", "age", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[0-9]{6}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 50},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "name", "code", "active", "score", "status", "tags", "owner", "items"],
    "additionalProperties": False,
}


def medium_instance(rng: random.Random) -> str:
    """A valid instance of MEDIUM_SCHEMA as compact JSON (both libraries are set to compact)."""

    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(lo, hi)))

    doc = {
        "id": rng.randint(0, 1000000),
        "name": f"{word(3, 8).title()} {word(3, 8).title()}",
        "code": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
        + f"-{rng.randint(0, 9999):04d}",
        "active": rng.random() < 0.5,
        "score": round(rng.uniform(0, 100), 2),
        "status": rng.choice(["new", "open", "closed", "archived"]),
        "tags": [word(2, 8) for _ in range(rng.randint(1, 4))],
        "owner": {
            "login": word(1, 1) + word(2, 8),
            "age": rng.randint(18, 99),
            "email": f"{word(3, 8)}@{word(3, 8)}.com",
        },
        "items": [
            {
                "sku": f"{rng.randint(0, 999999):06d}",
                "qty": rng.randint(1, 50),
                "price": round(rng.uniform(1, 500), 2),
            }
            for _ in range(rng.randint(1, 3))
        ],
    }
    return json.dumps(doc, separators=(",", ":"))


def big_tokenizer_json() -> str:
    """A ~150k-token byte-level BPE tokenizer.json, trained here on generated text (cached in
    the temp folder: training takes ~15 s on 2 cores)."""
    path = Path(tempfile.gettempdir()) / "hybridkv_bench_bpe150k.json"
    if path.is_file():
        return path.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwzqxy" for b in "aeiou"] + list("aeiou")
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 6))) for _ in range(400_000)
    ]
    json_bits = ['{"', '":', '",', '"}', "},", "],", ":[", '["', "true", "false", "null"]

    def lines() -> Any:
        for _ in range(200):
            parts = []
            for _ in range(20_000):
                r = rng.random()
                if r < 0.85:
                    parts.append(rng.choice(words))
                elif r < 0.95:
                    parts.append(str(rng.randint(0, 99999)))
                else:
                    parts.append(rng.choice(json_bits))
            yield " ".join(parts)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=150_000,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines(), trainer)
    text = tok.to_str()
    path.write_text(text)
    return text


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


class Backend:
    """What the benchmark needs from a library; one subclass per library."""

    name = ""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        raise NotImplementedError

    def compile_cold(self, schema: str) -> Any:
        raise NotImplementedError

    def compile_cached(self, schema: str) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class XGrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        j = json.loads(tokenizer_json)
        vocab: dict[str, int] = dict(j["model"]["vocab"])
        for added in j.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        encoded = [""] * (max(vocab.values()) + 1)
        for token, idx in vocab.items():
            encoded[idx] = token
        dec = j.get("decoder") or {}
        dec_types = {d["type"] for d in dec.get("decoders", [])} | {dec.get("type")}
        if "ByteLevel" in dec_types:
            vocab_type = xgr.VocabType.BYTE_LEVEL
        elif "ByteFallback" in dec_types:
            vocab_type = xgr.VocabType.BYTE_FALLBACK
        else:
            vocab_type = xgr.VocabType.RAW
        self.info = xgr.TokenizerInfo(
            encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=THREADS)
        self.tokenizer_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=THREADS)

    def _compile(self, compiler: Any, schema: str) -> Any:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        return self.xgr.GrammarMatcher(compiled)

    def compile_cold(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=THREADS, cache_enabled=False)
        return self._compile(compiler, schema)

    def compile_cached(self, schema: str) -> Any:
        return self._compile(self.compiler, schema)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class LLGuidanceBackend(Backend):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance as llg
        import llguidance.torch as llt

        self.llg = llg
        self.llt = llt
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=[eos])
        self.tokenizer_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor(num_threads=THREADS)
        self.templates: dict[str, Any] = {}

    def compile_cold(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def compile_cached(self, schema: str) -> Any:
        template = self.templates.get(schema)
        if template is None:
            template = self.templates[schema] = self.compile_cold(schema)
        return template.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_backend(
    backend: Backend,
    docs: list[list[int]],
    vocab_size: int,
    steps: int,
    snapshots: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """One library's row of the table. snapshots, if given, collects real 64-row bitmasks
    (every 8th step) for the apply_bitmask measurement."""
    schema = json.dumps(MEDIUM_SCHEMA)  # no sort_keys: property order is output order
    row: dict[str, float] = {"tokenizer_ms": backend.tokenizer_s * 1e3}
    cold = [timed(lambda: backend.compile_cold(schema))[0] for _ in range(3)]
    backend.compile_cached(schema)  # warm the cache
    cached = [timed(lambda: backend.compile_cached(schema))[0] for _ in range(20)]
    row["compile_cold_ms"] = statistics.median(cold) * 1e3
    row["compile_cached_us"] = statistics.median(cached) * 1e6

    bitmask = torch.full((BATCH, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    # One matcher along doc 0.
    fill1: list[float] = []
    acc1: list[float] = []
    m = backend.compile_cached(schema)
    for tok in docs[0][:steps]:
        dt, _ = timed(lambda: backend.fill(m, bitmask, 0))
        fill1.append(dt)
        row_ok = (int(bitmask[0, tok // 32]) >> (tok % 32)) & 1
        if not row_ok:
            raise RuntimeError(f"{backend.name}: valid token {tok} masked out")
        dt, ok = timed(lambda tok=tok: backend.accept(m, tok))
        if not ok:
            raise RuntimeError(f"{backend.name}: valid token {tok} rejected")
        acc1.append(dt)
    row["fill1_us"] = median_us(fill1)
    row["fill1_p90_us"] = sorted(fill1)[int(len(fill1) * 0.9)] * 1e6
    row["accept1_us"] = median_us(acc1)

    # 64 matchers, each along its own doc, twice: per-row fills, then the batch call.
    n_steps = min(steps, min(len(d) for d in docs))
    for mode in ("seq", "par"):
        matchers = [backend.compile_cached(schema) for _ in range(BATCH)]
        fills: list[float] = []
        accs: list[float] = []
        for s in range(n_steps):
            if mode == "seq":
                t0 = time.perf_counter()
                for i, mm in enumerate(matchers):
                    backend.fill(mm, bitmask, i)
                fills.append(time.perf_counter() - t0)
            else:
                dt, _ = timed(lambda ms=matchers: backend.fill_par(ms, bitmask))
                fills.append(dt)
                if snapshots is not None and s % 8 == 0:
                    snapshots.append(bitmask.clone())
            t0 = time.perf_counter()
            for i, mm in enumerate(matchers):
                if not backend.accept(mm, docs[i][s]):
                    raise RuntimeError(f"{backend.name}: doc {i} step {s} rejected")
            accs.append(time.perf_counter() - t0)
        row[f"fill64_{mode}_us"] = median_us(fills)
        row["accept64_us"] = median_us(accs)
    return row


def bench_apply(vocab_size: int, snapshots: list[torch.Tensor]) -> dict[str, float]:
    """Cost of the logits side, median us over real bitmasks taken along the 64 walks:
    hybridkv.structured.apply_bitmask at 1 and 64 rows, the same on uniformly random bitmasks
    (its worst case), and xgrammar's CPU kernel on the real ones when xgrammar is installed."""
    from hybridkv.structured import apply_bitmask

    out: dict[str, float] = {}
    logits = torch.randn(BATCH, vocab_size)

    def run(fn: Callable[[torch.Tensor, torch.Tensor], None], n: int, masks: list[Any]) -> float:
        samples = []
        for bm in masks:
            work = logits[:n].clone()
            samples.append(timed(lambda w=work, b=bm: fn(w, b[:n]))[0])
        return median_us(samples)

    for n in (1, BATCH):
        out[f"hybridkv {n} rows"] = run(apply_bitmask, n, snapshots)
    rand = [
        torch.randint(-(2**31), 2**31 - 1, (BATCH, (vocab_size + 31) // 32), dtype=torch.int32)
        for _ in range(5)
    ]
    out[f"hybridkv {BATCH} random rows"] = run(apply_bitmask, BATCH, rand)
    try:
        import xgrammar as xgr

        def xgr_apply(w: torch.Tensor, b: torch.Tensor) -> None:
            xgr.apply_token_bitmask_inplace(w, b)

        out[f"xgrammar kernel {BATCH} rows"] = run(xgr_apply, BATCH, snapshots)
    except ImportError:
        pass
    return out


COLUMNS = [
    ("tokenizer_ms", "tokenizer ms"),
    ("compile_cold_ms", "compile cold ms"),
    ("compile_cached_us", "compile cached us"),
    ("fill1_us", "fill 1 us"),
    ("fill1_p90_us", "fill 1 p90 us"),
    ("accept1_us", "accept 1 us"),
    ("fill64_seq_us", "fill 64 seq us"),
    ("fill64_par_us", "fill 64 par us"),
    ("accept64_us", "accept 64 us"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps measured")
    parser.add_argument("--skip-big", action="store_true", help="only the default tokenizer")
    parser.add_argument(
        "--only", choices=["xgrammar", "llguidance"], help="measure one library only"
    )
    args = parser.parse_args()
    # One torch thread: with two, a busy second core (a shared 2-core machine) stalls every
    # OpenMP region by milliseconds and apply_bitmask timings swing 100x.
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    vocabs = [("default 4k", (DEFAULT_MODEL / "tokenizer.json").read_text(), 4096)]
    if not args.skip_big:
        vocabs.append(("bpe 150k", big_tokenizer_json(), 151_552))  # padded like real models
    backends: list[type[Backend]] = [XGrammarBackend, LLGuidanceBackend]
    if args.only:
        backends = [b for b in backends if b.name == args.only]
    available = []
    for b in backends:
        try:
            __import__(b.name)
            available.append(b)
        except ImportError:
            print(f"({b.name} is not installed: left out)")
    backends = available

    rng = random.Random(0)
    texts = [medium_instance(rng) for _ in range(BATCH)]
    header = f"{'vocab':<11} {'library':<11} " + " ".join(f"{h:>17}" for _, h in COLUMNS)
    print(header)
    print("-" * len(header))
    for label, tok_json, vocab_size in vocabs:
        tok = Tokenizer.from_str(tok_json)
        eos = tok.token_to_id("<|endoftext|>")
        docs = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        snapshots: list[torch.Tensor] = []
        for cls in backends:
            row = bench_backend(
                cls(tok_json, vocab_size, eos), docs, vocab_size, args.steps, snapshots
            )
            cells = " ".join(f"{row[k]:>17.1f}" for k, _ in COLUMNS)
            print(f"{label:<11} {cls.name:<11} {cells}", flush=True)
        lens = [len(d) for d in docs]
        print(f"{label:<11} docs: {min(lens)}-{max(lens)} tokens per output", flush=True)
        applied = bench_apply(vocab_size, snapshots)
        print(
            f"{label:<11} apply_bitmask, logits {vocab_size} wide, median us: "
            + ", ".join(f"{k} {v:.0f}" for k, v in applied.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
