"""Native paged decode attention (`hkv_paged_decode`): the kernel of this tree against an older
build of it, side by side.

The old kernel is `hybridkv/ops/native/kernels.c` as of `--old` (a git revision; default
f2eab35, the two-pass kernel before the rewrite), compiled alone into a temporary library with
the flags the package uses; the new one is the package's own build (`native.library()`). Both
are called through ctypes with the same prepared arguments, so the table is the kernel and
nothing of the Python wrapper.

Problems: S requests with contexts uniform in 32..640 tokens (`--seqs`; `1x2048`: one request
of 2048), each request's kernel blocks scattered at random over the cache (as in an engine that
has run a while), one query per request. Configurations (heads, kv_heads, head_dim):
qwen3next (8, 2, 128), granite (12, 4, 64, the 100m model), llama8b (32, 8, 128), odd
(6, 2, 80). Kernel block sizes 16 / 32 / 64, float32 or bfloat16 (q, cache and output), 1 or 2
threads. `hot`: the same call again and again (K/V in the caches as far as they fit); `cold`:
every line of the cache tensor flushed (clflushopt) before each timed call, so K/V come from
memory. Medians of `--repeat` alternating old/new measurements (each hot one the mean of
enough calls to take about 2 ms). `GB/s`: the K/V bytes the call must read over the kernel's
time. Before timing, each case's two outputs are compared (largest difference,
relative to the largest output: `rel_diff`).

    python benchmarks/decode_attention.py [--repeat 5] [--configs qwen3next ...] \
        [--kbs 16 32 64] [--dtypes fp32 bf16] [--seqs 1 1x2048 8 64] [--threads 1 2] \
        [--temps hot cold] [--old REV] [--json]

`--engine`: the kernel inside the engine instead: benchmarks/throughput.py's Qwen3-Next
workload (qwen3next-100m, bfloat16: 64 requests of 32..512 prompt tokens + 128 new tokens) on
`--threads`' first count of threads, run `--repeat` times alternating the two kernels in one
process (the library's `hkv_paged_decode` function swapped for the old build's), with a timer
around `native_attn.paged_decode_attention`: mean milliseconds per call for the steps of 64
requests (what the engine's profile calls "per layer and step"), all calls' seconds, and the
run's.

Prints `uptime`'s load average before and after the table: the machine is shared.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridkv.ops import native  # noqa: E402
from hybridkv.ops.native import decode_attention as native_attn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # name: (heads, kv_heads, head_dim)
    "qwen3next": (8, 2, 128),
    "granite": (12, 4, 64),
    "llama8b": (32, 8, 128),
    "odd": (6, 2, 80),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
# (the softcap float after the scale: builds before it read neither, x86-64 passing floats in
# their own registers, so an old build takes the same call with softcap 0)
ARGTYPES = [_ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _f32, _f32,
            _ptr, _ptr]  # fmt: skip

FLUSH_C = r"""
#include <immintrin.h>
#include <stddef.h>
void flush_lines(const char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_clflushopt((void *)(p + i));
    _mm_sfence();
}
"""


def build_old(rev: str, folder: Path) -> ctypes.CDLL:
    """The decode kernel at `rev`: decode_attention.c with what it includes (hkv_common.h) and
    calls (cpu.c: the AMX permission) where `rev` has it, else kernels.c, compiled alone."""

    def show(name: str) -> bytes | None:
        got = subprocess.run(["git", "show", f"{rev}:hybridkv/ops/native/{name}"], cwd=ROOT,
                             capture_output=True)  # fmt: skip
        return got.stdout if got.returncode == 0 else None

    names = ["decode_attention.c", "cpu.c", "hkv_common.h"]
    if show("decode_attention.c") is None:
        names = ["kernels.c"]
    for name in names:
        src = show(name)
        if src is None:
            raise SystemExit(f"{rev} has no hybridkv/ops/native/{name}")
        (folder / f"old_{name}" if name.endswith(".c") else folder / name).write_bytes(src)
    out = folder / "old.so"
    sources = [str(folder / f"old_{n}") for n in names if n.endswith(".c")]
    subprocess.run(["gcc", *native.CFLAGS, *sources, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def build_flush(folder: Path) -> ctypes.CDLL:
    (folder / "flush.c").write_text(FLUSH_C)
    out = folder / "flush.so"
    subprocess.run(["gcc", "-O2", "-march=native", "-shared", "-fPIC", str(folder / "flush.c"),
                    "-o", str(out)], check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    lib.flush_lines.argtypes = [_ptr, ctypes.c_size_t]
    return lib


def kernel(lib: ctypes.CDLL):
    fn = lib.hkv_paged_decode
    fn.argtypes, fn.restype = ARGTYPES, None
    return fn


def problem(config: str, kbs: int, dtype: torch.dtype, seqs: str, seed: int = 0) -> dict:
    heads, kvh, d = CONFIGS[config]
    g = torch.Generator().manual_seed(seed)
    if "x" in seqs:
        n, length = map(int, seqs.split("x"))
        lens = torch.full((n,), length, dtype=torch.int32)
    else:
        lens = torch.randint(32, 641, (int(seqs),), generator=g, dtype=torch.int32)
    blocks = [-(-int(n) // kbs) for n in lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(num_blocks, 2, kbs, kvh, d, generator=g).to(dtype)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    used = 0
    for s, n in enumerate(blocks):
        table[s, :n] = perm[used : used + n].int()
        used += n
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    kv_bytes = int(lens.sum()) * 2 * kvh * d * cache.element_size()
    return dict(q=q, cache=cache, table=table, lens=lens, heads=heads, kvh=kvh, d=d, kbs=kbs,
                scale=d**-0.5, kv_bytes=kv_bytes)  # fmt: skip


def caller(fn, p: dict):
    out = torch.empty_like(p["q"])
    args = (p["q"].data_ptr(), p["cache"].data_ptr(), int(p["q"].dtype == torch.bfloat16),
            p["kbs"], p["kvh"], p["d"], p["heads"], p["table"].data_ptr(), p["table"].stride(0),
            p["lens"].data_ptr(), 0, len(p["lens"]), p["scale"], 0.0, None,
            out.data_ptr())  # fmt: skip

    def call() -> torch.Tensor:
        fn(*args)
        return out

    return call


def time_hot(call, inner: int) -> float:
    call()
    t0 = time.perf_counter()
    for _ in range(inner):
        call()
    return (time.perf_counter() - t0) / inner


def time_cold(call, flush, cache: torch.Tensor) -> float:
    flush.flush_lines(cache.data_ptr(), cache.numel() * cache.element_size())
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--kbs", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--seqs", nargs="+", default=["1", "1x2048", "8", "64"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--temps", nargs="+", default=["hot", "cold"], choices=["hot", "cold"])
    ap.add_argument("--old", default="f2eab35", help="git revision of the old kernels.c")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine", action="store_true", help="time the kernel inside the engine")
    args = ap.parse_args(argv)

    lib = native.library()
    if lib is None:
        print("native kernels unavailable")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        old_fn, flush = kernel(build_old(args.old, Path(tmp))), build_flush(Path(tmp))
        new_fn = kernel(lib.cdll)
        if args.engine:
            return engine(args, lib.hkv_paged_decode, old_fn, new_fn)
        load0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if not args.json:
            print(f"before: {load0}\n")
        rows = []
        for config in args.configs:
            for dname in args.dtypes:
                for kbs in args.kbs:
                    for seqs in args.seqs:
                        p = problem(config, kbs, DTYPES[dname], seqs)
                        old, new = caller(old_fn, p), caller(new_fn, p)
                        ref, got = old().float(), new().float()
                        rel = ((got - ref).abs().max() / ref.abs().max()).item()
                        for threads in args.threads:
                            torch.set_num_threads(threads)
                            for temp in args.temps:
                                rows.append(measure(config, dname, kbs, seqs, threads, temp, p,
                                                    old, new, flush, args.repeat, rel))  # fmt: skip
                                if not args.json:
                                    print_row(rows[-1], header=len(rows) == 1)
        load1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if args.json:
        print(json.dumps(dict(load_before=load0, load_after=load1, rows=rows), indent=1))
    else:
        print(f"\nafter: {load1}")
    return 0


def engine(args, kernel_obj, old_fn, new_fn) -> int:
    """The Qwen3-Next bf16 throughput workload, alternating the old and the new kernel."""
    from benchmarks.throughput import save_checkpoint, workload
    from hybridkv import LLM, SamplingParams

    torch.set_num_threads(args.threads[0])
    calls: dict[str, list[float]] = {"64": [], "other": []}
    timed = native_attn.paged_decode_attention

    def timer(q, *a, **k):
        t0 = time.perf_counter()
        out = timed(q, *a, **k)
        calls["64" if q.shape[0] == 64 else "other"].append(time.perf_counter() - t0)
        return out

    native_attn.paged_decode_attention = timer  # (attention.py calls it through the module)
    load0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"before: {load0}\n")
    print("| run | kernel | run s | calls at 64 | ms per call at 64 | all calls s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = save_checkpoint("qwen3next-100m", Path(tmp))
        prompts = workload(32000, 64, 0)
        llm = LLM(str(path), dtype="bfloat16", max_num_seqs=64, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        for r in range(args.repeat):
            for name, fn in (("old", old_fn), ("new", new_fn)):
                kernel_obj.fn = fn
                calls["64"].clear(), calls["other"].clear()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                run = time.perf_counter() - t0
                c64, total = calls["64"], sum(calls["64"]) + sum(calls["other"])
                per_call = 1e3 * sum(c64) / max(1, len(c64))
                print(f"| {r} | {name} | {run:.2f} | {len(c64)} | {per_call:.2f} | {total:.2f} |",
                      flush=True)  # fmt: skip
        kernel_obj.fn = new_fn
        llm.engine.shutdown()
    load1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nafter: {load1}")
    return 0


def measure(config, dname, kbs, seqs, threads, temp, p, old, new, flush, repeat, rel) -> dict:
    t_old, t_new = [], []
    if temp == "hot":
        est = max(time_hot(new, 1), time_hot(old, 1))
        inner = max(1, min(200, int(2e-3 / max(est, 1e-7))))
        for _ in range(repeat):
            t_old.append(time_hot(old, inner))
            t_new.append(time_hot(new, inner))
    else:
        for _ in range(repeat):
            t_old.append(time_cold(old, flush, p["cache"]))
            t_new.append(time_cold(new, flush, p["cache"]))
    o, n = statistics.median(t_old), statistics.median(t_new)
    return dict(config=config, dtype=dname, kbs=kbs, seqs=seqs, threads=threads, temp=temp,
                old_us=o * 1e6, new_us=n * 1e6, speedup=o / n, gbps=p["kv_bytes"] / n / 1e9,
                old_gbps=p["kv_bytes"] / o / 1e9, rel_diff=rel)  # fmt: skip


def print_row(r: dict, header: bool) -> None:
    if header:
        print("| config | dtype | kbs | S | thr | cache | old us | new us | speedup | new GB/s"
              " | old GB/s | rel diff |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['config']} | {r['dtype']} | {r['kbs']} | {r['seqs']} | {r['threads']} | "
          f"{r['temp']} | {r['old_us']:.1f} | {r['new_us']:.1f} | {r['speedup']:.2f}x | "
          f"{r['gbps']:.1f} | {r['old_gbps']:.1f} | {r['rel_diff']:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
