"""int8 weight-only quantization (issue 19): accuracy against the unquantized model, memory,
end-to-end speed and the GEMM micro-benchmark, int8 vs bfloat16 vs float32.

Models: the built-in default model ("default": trained GraniteMoeHybrid, 6 layers, hidden 256,
vocabulary 8192) and the "100m" GraniteMoeHybrid of benchmarks/throughput.py (random weights,
hidden 768, vocabulary 32000, tied embeddings), saved to a temporary folder.

Accuracy (`--skip-accuracy` to leave out), per model and dtype, int8 (lm_head int8, the
engine's default), int8 with a float lm_head and w8a8 (the same weights, activations rounded
to int8 per token), each against the unquantized engine of the same dtype (and, for context,
bfloat16 against float32 without int8):
- greedy: 16 prompts of 48 tokens (default model: Python source of torch.nn.modules, which the
  model never saw; 100m: seeded random tokens), 32 new tokens each: the fraction of
  identical tokens position by position, how many prompts agree on all 32, and the position
  of the first divergence (median over the prompts that diverge; 32 = none);
- prefill logits of the 16 prompts: max |diff| / max |ref|, mean |diff| / mean |ref|, and the
  fraction of positions whose top-1 token agrees.
Memory: the quantized linears' weight bytes before and after, the bytes freed (a tied head's
float weight stays: the embedding looks it up), and the model's parameter + buffer bytes.

Speed (`--skip-speed`): output tokens/s for 64 prompt + 64 new tokens at batch 1 and batch 8
(greedy, EOS ignored, prefix caching off): `--rounds` sweeps over every configuration, each run
in a fresh process (the median of `--repeat` timed runs after a warm-up), the median over the
sweeps; int8 with the lm_head int8 (the default) and float.

Accuracy and speed run with `--threads` intra-op threads (OMP_NUM_THREADS: the engine does not
adapt them, so float sums keep their order from run to run; default 1, because on a shared
machine a second thread waits for a busy CPU at every op).

GEMM (`--skip-gemm`): milliseconds per call (median of runs over >= 0.3 s) at M = 1, 8, 64,
512 for [768 -> 1536], [1536 -> 768] and [768 -> 32000], 1 and 2 threads: the float32 and
bfloat16 pre-packed oneDNN linears (what the unquantized engine runs), the int8 layer as the
engine runs it for each dtype, and its alternatives: the native float32 kernel
(hybridkv/ops/native/int8_linear.c, also fed bfloat16), torch's _weight_int8pack_mm (bfloat16;
its float32 path is a scalar loop, shown at M = 1 and 8 only), and dequantize + bfloat16 GEMM.

Streaming (`--stream`, instead of everything above): the native kernel at decode batch sizes
with its weights out of cache, on the 100m model's linear shapes (benchmarks/bf16_linear.py's
pools of distinct copies, `--pool-mib` each, and its alternating passes, medians of `--repeats`):
microseconds per call at M = `--ms` rows on `--gemm-threads` threads of the int8 kernel with
float32 x and with bfloat16 x (where the int8 layers run it: M <= 16 on AVX-512, every M on
AVX2), the native float32 and bfloat16 linears on the same shape (f32_linear.c, bf16_linear.c:
what an unquantized model runs, bfloat16 where PackedLinear runs it), and `read`: a plain sum
over the same int8 bytes (viewed as int64, PyTorch's vectorised reduction on the same threads);
GB/s of each (weight bytes per call over its time: 1, 4 and 2
bytes a weight), fp32/int8: the float32 kernel's time over the int8 kernel's, int8/read: the
int8 kernel's time over the plain read's.

The machine is shared: the load average is printed before and after; read ratios, not
absolutes. Every mode runs on whatever build the environment selects (the CPU record's line is
printed first): the AVX2 simulation on an AVX-512 machine is `HYBRIDKV_NATIVE_MARCH=x86-64-v3
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`.

    python benchmarks/quantization.py [--models default 100m] [--threads 1] [--rounds 3]
        [--skip-accuracy] [--skip-speed] [--skip-gemm] [--json]
    python benchmarks/quantization.py --stream [--gemm-threads 2 1] [--ms 1 2 4 8 16]
        [--shapes 768x3224 ...] [--repeats 9] [--pool-mib 512]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 48, 32
SPEED_PROMPT, SPEED_NEW, SPEED_BATCHES = 64, 64, (1, 8)
GEMM_SHAPES = [(768, 1536), (1536, 768), (768, 32000)]  # (in, out)
GEMM_MS = [1, 8, 64, 512]
PRECISIONS = {  # name: (dtype, quantization, lm_head int8)
    "fp32": ("float32", None, False),
    "bf16": ("bfloat16", None, False),
    "int8 (fp32)": ("float32", "int8", True),
    "int8 (fp32), float lm_head": ("float32", "int8", False),
    "int8 (bf16)": ("bfloat16", "int8", True),
    "int8 (bf16), float lm_head": ("bfloat16", "int8", False),
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- models and prompts --------------------------------------------------------------------


def model_folder(name: str, tmp: Path) -> Path | None:
    """None: the built-in default model."""
    if name == "default":
        return None
    from benchmarks.throughput import save_checkpoint

    return save_checkpoint(name, tmp)[0]


def accuracy_prompts(name: str, engine) -> list[list[int]]:
    if name == "default":  # Python the model never saw (it learnt the standard library's)
        import torch.nn.modules

        files = sorted(Path(torch.nn.modules.__file__).parent.glob("*.py"))
        files = [f for f in files if f.stat().st_size > 4000][:PROMPTS]
        texts = ["\n".join(f.read_text().splitlines()[20:80]) for f in files]
        return [engine.tokenizer.encode(t)[:PROMPT_TOKENS] for t in texts]
    from tests.models.utils import prompts

    return prompts(engine.vocab_size, [PROMPT_TOKENS] * PROMPTS, seed=3)


def make_engine(folder: Path | None, dtype: str, quantization: str | None = None, **kw):
    from hybridkv.engine import Engine

    return Engine(
        None if folder is None else str(folder), dtype=dtype, quantization=quantization,
        max_num_seqs=PROMPTS, enable_prefix_caching=False, memory_bytes=2**30, **kw,
    )  # fmt: skip


def model_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# -- accuracy ------------------------------------------------------------------------------


def outputs(engine, ids: list[list[int]]) -> dict:
    """Greedy tokens and prefill logits of every prompt."""
    from tests.models.utils import engine_greedy, engine_prefill_logits

    logits = [engine_prefill_logits(engine, p) for p in ids]
    return {"tokens": engine_greedy(engine, ids, NEW_TOKENS), "logits": logits}


def compare(ours: dict, ref: dict) -> dict:
    import torch

    same, full, first = 0, 0, []
    for a, b in zip(ours["tokens"], ref["tokens"], strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        where = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        full += where is None
        first.append(NEW_TOKENS if where is None else where)
    diverged = [f for f in first if f < NEW_TOKENS]
    la, lb = torch.cat(ours["logits"]), torch.cat(ref["logits"])
    diff = (la - lb).abs()
    return {
        "greedy_agreement": same / (len(first) * NEW_TOKENS),
        "prompts_identical": full,
        "first_divergence_median": statistics.median(diverged) if diverged else NEW_TOKENS,
        "first_divergence_min": min(first),
        "logits_max_rel": float(diff.max() / lb.abs().max()),
        "logits_mean_rel": float(diff.mean() / lb.abs().mean()),
        "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
    }


def accuracy(name: str, folder: Path | None) -> tuple[list[dict], list[dict]]:
    from hybridkv.layers.quantization import quantize_model

    rows, memory = [], []
    refs = {}
    ids: list[list[int]] = []
    for dtype in ("float32", "bfloat16"):
        plain = make_engine(folder, dtype)
        ids = ids or accuracy_prompts(name, plain)  # the same prompts for both dtypes
        refs[dtype] = ref = outputs(plain, ids)
        float_model_bytes = model_bytes(plain.model)
        del plain
        int8 = make_engine(folder, dtype, "int8")
        rep = int8.quantization
        memory.append({
            "model": name, "dtype": dtype, "linears": len(rep.quantized),
            "float_MiB": rep.float_bytes / 2**20, "int8_MiB": rep.int8_bytes / 2**20,
            "freed_MiB": rep.freed_bytes / 2**20, "model_MiB_before": float_model_bytes / 2**20,
            "model_MiB_after": model_bytes(int8.model) / 2**20,
        })  # fmt: skip
        rows.append({"model": name, "dtype": dtype, "variant": "int8", **compare(
            outputs(int8, ids), ref)})  # fmt: skip
        del int8
        w8a8 = make_engine(folder, dtype, "w8a8")  # the same weights, 8-bit activations too
        rows.append({"model": name, "dtype": dtype, "variant": "w8a8", **compare(
            outputs(w8a8, ids), ref)})  # fmt: skip
        del w8a8
        head = make_engine(folder, dtype)  # int8 with the lm_head left float
        quantize_model(head.model, lm_head=False)
        rows.append({"model": name, "dtype": dtype, "variant": "int8, float lm_head",
                     **compare(outputs(head, ids), ref)})  # fmt: skip
        del head
    rows.append({"model": name, "dtype": "bfloat16", "variant": "bf16 vs fp32 (no int8)",
                 **compare(refs["bfloat16"], refs["float32"])})  # fmt: skip
    return rows, memory


# -- end-to-end speed (each configuration in a fresh process) --------------------------------


def speed_child(job: dict) -> None:
    from hybridkv.entrypoints.bench import random_prompts, run_hybridkv
    from hybridkv.layers import quantization

    quantization.QUANTIZE_LM_HEAD = job["lm_head_int8"]

    prompts = random_prompts(job["vocab"], job["batch"], SPEED_PROMPT, SPEED_PROMPT, seed=5)
    seconds = run_hybridkv(
        job["model"], prompts, SPEED_NEW, dtype=job["dtype"], repeat=job["repeat"],
        quantization=job["quantization"], max_model_len=512,
    )  # fmt: skip
    print("RESULT " + json.dumps({"seconds": seconds}), flush=True)


def speed(name: str, folder: Path | None, threads: int, repeat: int, rounds: int) -> list[dict]:
    """Tokens/s of every precision and batch: `rounds` sweeps over all of them, a fresh
    process per run, the median over the sweeps (a neighbour's burst hits one sweep's run of
    one configuration, not all of one configuration's runs)."""
    from hybridkv.engine import DEFAULT_MODEL
    from hybridkv.kv.presets import load_model_config
    from hybridkv.models.registry import family_config

    path = None if folder is None else str(folder)
    vocab = family_config(load_model_config(path or str(DEFAULT_MODEL))).vocab_size
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for precision, (dtype, quantization, head) in PRECISIONS.items():
            for batch in SPEED_BATCHES:
                job = {"model": path, "dtype": dtype, "quantization": quantization,
                       "lm_head_int8": head, "batch": batch, "repeat": repeat,
                       "vocab": vocab}  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(job)],
                    capture_output=True, text=True, env=env, timeout=900,
                )  # fmt: skip
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not line:
                    raise RuntimeError(f"{precision} batch {batch} failed: {proc.stderr[-500:]}")
                seconds.setdefault((precision, batch), []).append(
                    json.loads(line[0][7:])["seconds"]
                )
    rows = []
    for precision in PRECISIONS:
        row: dict = {"model": name, "precision": precision}
        for batch in SPEED_BATCHES:
            row[f"batch{batch}_tok_s"] = (
                batch * SPEED_NEW / statistics.median(seconds[(precision, batch)])
            )
        rows.append(row)
    return rows


# -- GEMM micro-benchmark ----------------------------------------------------------------------


def timed(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """Median milliseconds per call over runs lasting at least `seconds` (5 runs at least)."""
    fn()
    fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemm_cases(packed, layer, q, scale, x32, x16) -> dict[str, Callable[[], object]]:
    """What `gemm` times for one shape and M: name -> a call."""
    import torch
    import torch.nn.functional as F

    from hybridkv.ops.native import int8_linear as native_int8

    int8pack_mm = torch.ops.aten._weight_int8pack_mm
    cases: dict[str, Callable[[], object]] = {
        "fp32 packed": lambda: packed[torch.float32](x32),
        "bf16 packed": lambda: packed[torch.bfloat16](x16),
        "int8 layer fp32": lambda: layer(x32),
        "int8 layer bf16": lambda: layer(x16),
        "int8pack_mm bf16": lambda: int8pack_mm(x16, q, scale),
        "dequant+GEMM bf16": lambda: F.linear(x16, q.to(torch.bfloat16)) * scale,
    }
    if x32.shape[0] <= 8:  # the float32 path of _weight_int8pack_mm is a scalar loop
        s32 = scale.float()
        cases["int8pack_mm fp32"] = lambda: int8pack_mm(x32, q, s32)
    if native_int8.available():
        cases["native fp32"] = lambda: native_int8.int8_linear(x32, q, scale)
        cases["native bf16"] = lambda: native_int8.int8_linear(x16, q, scale)
    return cases


def gemm(threads_list: list[int]) -> list[dict]:
    import torch

    from hybridkv.layers import quantization as quant
    from hybridkv.layers.linear import PackedLinear

    rows = []
    before = torch.get_num_threads()
    for threads in threads_list:
        torch.set_num_threads(threads)
        for k, n in GEMM_SHAPES:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=g) * 0.02
            q, scale = quant.quantize_rows(w)
            packed = {}
            for dtype in (torch.float32, torch.bfloat16):
                lin = torch.nn.Linear(k, n, bias=False)
                lin.weight.data = w.to(dtype)
                packed[dtype] = PackedLinear.from_linear(lin)
            layer = quant.Int8Linear(q, scale, None)
            for m in GEMM_MS:
                x32 = torch.randn(m, k, generator=g)
                cases = gemm_cases(packed, layer, q, scale, x32, x32.bfloat16())
                with torch.inference_mode():
                    ms = {name: timed(fn) for name, fn in cases.items()}
                rows.append({"threads": threads, "shape": f"{k}->{n}", "M": m, **ms})
    torch.set_num_threads(before)
    return rows


# -- streaming micro-benchmark -------------------------------------------------------------


def stream_cases(k: int, n: int, m: int, mib: int, weights: dict) -> dict[str, Callable[[], None]]:
    """What `--stream` times for one shape and M: name -> a pass over its pool (`weights`:
    name -> the pool it reads, filled here on the first M)."""
    import torch

    from benchmarks.bf16_linear import pool
    from hybridkv.ops.native import bf16_linear as native_bf16
    from hybridkv.ops.native import f32_linear as native_f32
    from hybridkv.ops.native import int8_linear as native_int8

    if not weights:
        q = pool(n, k, torch.int8, mib)
        weights.update(int8=q, read=q, fp32=pool(n, k, torch.float32, mib),
                       bf16=pool(n, k, torch.bfloat16, mib))  # fmt: skip
    scale = (torch.rand(n) / 64).to(torch.bfloat16)
    x32 = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x16 = x32.bfloat16()
    i8, f32, b16 = native_int8.kernel(), native_f32.kernel(), native_bf16.kernel()
    as_int64 = (n * k) % 8 == 0  # (else a sum of the int8 values: slower than a plain read)

    def int8(x: torch.Tensor) -> Callable[[], None]:
        def go() -> None:
            for q in weights["int8"]:
                native_int8.run(i8, x, q, scale)

        return go

    def fp32() -> None:
        for w in weights["fp32"]:
            native_f32.run(f32, x32, w, None)

    def bf16() -> None:
        for w in weights["bf16"]:
            native_bf16.run(b16, x16, w, None)

    def read() -> None:
        for q in weights["read"]:
            (q.view(torch.int64) if as_int64 else q).sum()

    from hybridkv.layers.linear import native_rows
    from hybridkv.layers.quantization import native_limits

    cases = {"int8 fp32-x": int8(x32)}
    if m <= native_limits()[0]:  # (bfloat16 x: where the int8 layers run the kernel)
        cases["int8 bf16-x"] = int8(x16)
    cases["fp32"] = fp32
    if m <= native_rows(torch.bfloat16):
        cases["bf16"] = bf16
    cases["read"] = read
    return cases


def stream(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.bf16_linear import measure
    from hybridkv.ops.native import bf16_linear as native_bf16
    from hybridkv.ops.native import cpu
    from hybridkv.ops.native import f32_linear as native_f32
    from hybridkv.ops.native import int8_linear as native_int8

    if None in (native_int8.kernel(), native_f32.kernel(), native_bf16.kernel()):
        print("needs the native int8, float32 and bfloat16 kernels (AVX2, or AVX-512 with BF16)")
        return 1
    names = ["int8 fp32-x", "int8 bf16-x", "fp32", "bf16", "read"]
    size = {"fp32": 4, "bf16": 2}  # bytes a weight (int8 and read: 1)
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}")
    print(f"# {cpu.line()}")
    for threads in args.gemm_threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s); load average before: {load()}\n")
        print(
            "| K -> N | M | "
            + " | ".join(f"{c} us" for c in names)
            + " | "
            + " | ".join(f"{c} GB/s" for c in names)
            + " | fp32/int8 | int8/read |"
        )
        print("|---" * (2 + 2 * len(names) + 2) + "|")
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            weights: dict = {}
            for m in args.ms:
                runs = stream_cases(k, n, m, args.pool_mib, weights)
                pools = {name: weights[name.split()[0]] for name in runs}
                t = measure(runs, pools, args.repeats, threads)
                us = [f"{t[c] * 1e6:.1f}" if c in t else "-" for c in names]
                gbs = [f"{n * k * size.get(c, 1) / t[c] / 1e9:.1f}" if c in t else "-"
                       for c in names]  # fmt: skip
                ratios = f"{t['fp32'] / t['int8 fp32-x']:.2f} | {t['int8 fp32-x'] / t['read']:.2f}"
                print(
                    f"| {k} -> {n} | {m} | " + " | ".join(us + gbs) + f" | {ratios} |", flush=True
                )
            del weights
        print(f"\nload average after: {load()}")
    return 0


# -- printing ------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[str], fmt: dict[str, str] | None = None) -> str:
    fmt = fmt or {}
    cells = [[fmt.get(c, "{}").format(r.get(c, "-")) if c in r else "-" for c in columns]
             for r in rows]  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |"
              for row in cells]  # fmt: skip
    return "\n".join(lines)


def print_gemm(rows: list[dict]) -> None:
    names = [c for c in rows[0] if c not in ("threads", "shape", "M")]
    names += [c for r in rows for c in r if c not in names and c not in ("threads", "shape", "M")]
    out = []
    for r in rows:
        row = {"threads": r["threads"], "shape": r["shape"], "M": r["M"]}
        for name in names:
            if name in r:
                row[name] = f"{r[name]:.3f}"
        row["int8/fp32"] = f"{r['fp32 packed'] / r['int8 layer fp32']:.2f}x"
        row["int8/bf16"] = f"{r['bf16 packed'] / r['int8 layer bf16']:.2f}x"
        out.append(row)
    print(table(out, ["threads", "shape", "M", *names, "int8/fp32", "int8/bf16"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["default", "100m"])
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads of the accuracy and speed runs (default 1: on a shared machine "
        "a second thread waits for a busy CPU at every op)",
    )  # fmt: skip
    parser.add_argument("--gemm-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per process")
    parser.add_argument("--rounds", type=int, default=3, help="sweeps over the configurations")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--stream", action="store_true", help="the streaming micro-benchmark")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN, e.g. 768x3224")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        speed_child(json.loads(args.child))
        return 0
    if args.stream:
        from benchmarks.bf16_linear import SHAPES

        args.shapes = args.shapes or SHAPES
        return stream(args)
    import logging

    # a fixed thread count (the engine adapts it otherwise): float sums in the same order on
    # every run, so the greedy references repeat
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    logging.getLogger("hybridkv").setLevel(logging.WARNING)
    from hybridkv.ops.native import cpu

    result: dict = {"date": datetime.date.today().isoformat(), "load_before": load(),
                    "cpu": cpu.line()}  # fmt: skip
    print(f"# {result['date']}, load average before: {result['load_before']}", flush=True)
    print(f"# {result['cpu']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: model_folder(name, Path(tmp)) for name in args.models}
        if not args.skip_accuracy:
            rows, memory = [], []
            for name, folder in folders.items():
                r, m = accuracy(name, folder)
                rows += r
                memory += m
            result["accuracy"], result["memory"] = rows, memory
            if not args.json:
                print("\n## accuracy: int8 vs the unquantized model of the same dtype\n")
                print(
                    table(
                        rows,
                        [
                            "model",
                            "dtype",
                            "variant",
                            "greedy_agreement",
                            "prompts_identical",
                            "first_divergence_median",
                            "first_divergence_min",
                            "logits_max_rel",
                            "logits_mean_rel",
                            "top1_agreement",
                        ],
                        {
                            "greedy_agreement": "{:.3f}",
                            "logits_max_rel": "{:.4f}",
                            "logits_mean_rel": "{:.4f}",
                            "top1_agreement": "{:.3f}",
                        },
                    )
                )
                print("\n## memory\n")
                print(
                    table(
                        memory,
                        list(memory[0]),
                        {k: "{:.1f}" for k in memory[0] if k.endswith("MiB") or "MiB_" in k},
                    )
                )
                print(flush=True)  # fmt: skip
        if not args.skip_speed:
            rows = []
            for name, folder in folders.items():
                rows += speed(name, folder, args.threads, args.repeat, args.rounds)
            for row in rows:
                base = next(r for r in rows if r["model"] == row["model"] and
                            r["precision"] == "fp32")  # fmt: skip
                for b in SPEED_BATCHES:
                    row[f"batch{b}_vs_fp32"] = row[f"batch{b}_tok_s"] / base[f"batch{b}_tok_s"]
            result["speed"] = rows
            if not args.json:
                print(f"\n## speed: {SPEED_PROMPT} prompt + {SPEED_NEW} new tokens, output "
                      f"tokens/s, {args.threads} threads\n")  # fmt: skip
                cols = ["model", "precision"] + [
                    f"batch{b}_{s}" for b in SPEED_BATCHES for s in ("tok_s", "vs_fp32")
                ]
                print(table(rows, cols, {c: "{:.1f}" if "tok" in c else "{:.2f}x"
                                         for c in cols[2:]}), flush=True)  # fmt: skip
    if not args.skip_gemm:
        result["gemm"] = gemm(args.gemm_threads)
        if not args.json:
            print("\n## GEMM: ms per call (median); int8/fp32, int8/bf16: speed-up of the int8 "
                  "layer over the packed float layer of that dtype\n")  # fmt: skip
            print_gemm(result["gemm"])
    result["load_after"] = load()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"\n# load average after: {result['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
