"""Structured-outputs overhead: decode throughput with and without a JSON schema.

The 100M GraniteMoeHybrid checkpoint of benchmarks/throughput.py (`save_checkpoint("100m")`,
random weights, 32000-wide logits), saved once to a cache folder (`--model-dir`) and given the
default model's byte-level BPE tokenizer (4096 tokens, EOS id 0) in place of the word-level
t0..t31999 one, which cannot spell JSON. Ids 4096..31999 are then always masked: the mask is
applied over the full 32000-wide logits rows, as for a model with a padded vocabulary.

For each batch size (`--batches`, default 1 and 64), the same prompts (16 random token ids
each) and max_tokens:
- "schema": greedy, `SamplingParams(structured=GrammarSpec("json_schema", SCHEMA))`: an
  object holding an array of 4..6 small objects with bounded strings and integers, so the
  grammar, not max_tokens, ends nearly every request (EOS cannot be ignored: a finished grammar
  allows nothing else). The tokens each request actually generates are counted.
- "plain": greedy, no grammar, EOS ignored, each request's max_tokens set to the number of
  tokens its schema run generated: the same decode work, token for token.
Both in one process, runs alternating (schema, plain) after the schema run that counts the
tokens (the warm-up), `--repeat` timed runs each (median). tokens/s = tokens generated / wall
seconds of `LLM.generate` (the 16-token prefill included; it is the same for both).

The per-step mask cost is measured in a separate, instrumented schema run: per sampler call,
the time of one step's `fill_bitmasks` (fill: every grammar row, in the engine's mask thread
while the forward runs, so off the critical path), of `apply_bitmask` (apply), and of the
whole `Sampler._mask_grammar` on the engine thread (mask: apply + bookkeeping). Medians over
steps.

    python benchmarks/structured_overhead.py [--batches 1 64] [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.throughput import save_checkpoint  # noqa: E402
from hybridkv.engine import DEFAULT_MODEL  # noqa: E402
from hybridkv.entrypoints.bench import random_prompts  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "qty": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "qty", "ok"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 4, "maxItems": 6}},
    "required": ["items"],
    "additionalProperties": False,
}
TOKENIZER_VOCAB = 4096  # the default model's tokenizer
EOS = 0


def model_path(folder: Path) -> Path:
    """The cached 100m checkpoint with the JSON-capable tokenizer (built on first use)."""
    path = folder / "100m-json"
    if (path / "model.safetensors").is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    built, _ = save_checkpoint("100m", folder / "build")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, built / name)
    (built / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS, "eos_token_id": EOS, "pad_token_id": EOS})
    )
    built.rename(path)
    shutil.rmtree(folder / "build", ignore_errors=True)
    return path


def timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


class MaskTimer:
    """Instruments the grammar path. fill: seconds of one step's `fill_bitmasks` (all grammar
    rows), which the engine runs in its mask thread while the forward runs (off the critical
    path); apply: `apply_bitmask`; mask: the whole `Sampler._mask_grammar` on the engine
    thread (waiting for nothing: the masks are ready), apply included."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []  # sampler side, one per sampler call
        self.fills: list[dict[str, float]] = []  # mask-thread side, one per step

    def __enter__(self) -> MaskTimer:
        import hybridkv.engine as engine
        import hybridkv.structured as structured
        from hybridkv.worker.sampler import Sampler

        self._saved = (
            (structured, "apply_bitmask", structured.apply_bitmask),
            (engine, "fill_bitmasks", engine.fill_bitmasks),
            (Sampler, "_mask_grammar", Sampler._mask_grammar),
        )
        steps, fills = self.steps, self.fills
        apply, fill, mask = (saved[2] for saved in self._saved)

        def timed_apply(*a, **k):
            t = time.perf_counter()
            apply(*a, **k)
            steps[-1]["apply"] += time.perf_counter() - t

        def timed_fill(matchers, rows, *a, **k):
            t = time.perf_counter()
            out = fill(matchers, rows, *a, **k)
            fills.append({"fill": time.perf_counter() - t, "rows": len(rows)})
            return out

        def timed_mask(*a, **k):
            steps.append({"apply": 0.0, "rows": len(a[3])})
            t = time.perf_counter()
            mask(*a, **k)
            steps[-1]["mask"] = time.perf_counter() - t

        structured.apply_bitmask = timed_apply
        engine.fill_bitmasks = timed_fill
        Sampler._mask_grammar = timed_mask
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)

    def medians_ms(self, rows: int) -> dict[str, float]:
        """Median ms per step over the steps with exactly `rows` grammar rows (the full
        batch; steps at the tail, where requests have finished, have fewer)."""
        steps = [s for s in self.steps if s["rows"] == rows] or self.steps
        fills = [s for s in self.fills if s["rows"] == rows] or self.fills

        def median_ms(items: list[dict[str, float]], key: str) -> float:
            return round(statistics.median(s[key] for s in items) * 1e3, 3)

        return {"fill": median_ms(fills, "fill"), "apply": median_ms(steps, "apply"),
                "mask": median_ms(steps, "mask"), "steps": len(steps)}  # fmt: skip


def run_batch(llm, batch: int, args: argparse.Namespace) -> dict:
    from hybridkv import SamplingParams
    from hybridkv.structured import GrammarSpec

    prompts = random_prompts(TOKENIZER_VOCAB - 1, batch, 16, 16, args.seed)
    prompts = [[t + 1 for t in p] for p in prompts]  # no EOS id in the prompts
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    schema_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec)
    _, outs = timed(llm, prompts, schema_params)  # warm-up; the token counts of the plain run
    counts = [len(o.token_ids) for o in outs]
    finishes = {o.finish_reason for o in outs}
    check_outputs(outs)
    plain_params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    times: dict[str, list[float]] = {"plain": [], "schema": []}
    for _ in range(args.repeat):
        seconds, outs = timed(llm, prompts, schema_params)
        assert [len(o.token_ids) for o in outs] == counts, "greedy schema run changed"
        times["schema"].append(seconds)
        seconds, outs = timed(llm, prompts, plain_params)
        assert [len(o.token_ids) for o in outs] == counts
        times["plain"].append(seconds)
    with MaskTimer() as timer:
        llm.generate(prompts, schema_params, use_tqdm=False)
    tokens = sum(counts)
    plain = tokens / statistics.median(times["plain"])
    schema = tokens / statistics.median(times["schema"])
    return {
        "batch": batch,
        "tokens": tokens,
        "tokens_per_request": round(tokens / batch, 1),
        "finish": sorted(finishes),
        "plain_tok_s": round(plain, 1),
        "schema_tok_s": round(schema, 1),
        "ratio": round(schema / plain, 3),
        "plain_s": [round(t, 3) for t in times["plain"]],
        "schema_s": [round(t, 3) for t in times["schema"]],
        "mask_ms": timer.medians_ms(batch),
        "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def check_outputs(outs) -> None:
    """Every output the grammar finished is valid JSON of SCHEMA."""
    import jsonschema

    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model-dir", type=Path, default=Path("/tmp/hybridkv-bench-models"),
        help="cache folder of the checkpoint (built on first use)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from hybridkv import LLM

    path = model_path(args.model_dir)
    llm = LLM(
        str(path), dtype="float32", max_num_seqs=max(args.batches), enable_prefix_caching=False
    )
    rows = []
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    for batch in args.batches:
        rows.append(run_batch(llm, batch, args))
        r = rows[-1]
        if not args.json:
            if len(rows) == 1:
                print("batch  tokens  plain tok/s  schema tok/s  ratio  fill ms  apply ms  "
                      "mask ms (per step)")  # fmt: skip
            m = r["mask_ms"]
            print(f"{batch:<5}  {r['tokens']:<6}  {r['plain_tok_s']:<11}  "
                  f"{r['schema_tok_s']:<12}  {r['ratio']:<5}  {m['fill']:<7}  "
                  f"{m['apply']:<8}  {m['mask']}", flush=True)  # fmt: skip
    llm.engine.shutdown()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
