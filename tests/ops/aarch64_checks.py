"""Checks of the native library built for aarch64, run by an aarch64 Python under qemu-user
(tests/ops/test_native_aarch64.py): NumPy and ctypes only (no PyTorch there), each kernel
against a NumPy reference written from the kernel's own comment in the C file.

    python3 aarch64_checks.py LIBRARY [FEATURE ...]
        (prints one line per check; exit 1 on a mismatch; FEATURE: what the CPU record must say
        the library was built for, e.g. neon; the same checks run on x86-64 without one)

Covered: the CPU record (built for NEON), RMSNorm, silu-and-mul, argmax, the causal conv1d, the
Mamba2 scan and the gated delta rule (both with speculative decoding's per-position states),
and paged decode attention over a block table. They run ARM's code paths (the portable loops
and GCC's generic vectors as NEON), where char is unsigned and OpenMP is another build.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

F32 = np.float32
rng = np.random.default_rng(0)
failures: list[str] = []


_alive: list[np.ndarray] = []  # arrays made for a call live until the process ends


def ptr(a: np.ndarray | None) -> ctypes.c_void_p | None:
    if a is None:
        return None
    _alive.append(a)
    return ctypes.c_void_p(a.ctypes.data)


def check(name: str, got: np.ndarray, want: np.ndarray, rtol: float = 2e-5) -> None:
    err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-3))) if want.size else 0.0
    ok = np.all(np.isfinite(got)) and err <= rtol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max relative error {err:.2e}")
    if not ok:
        failures.append(name)


def i64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def cpu_record(lib: ctypes.CDLL) -> None:
    lib.hkv_cpu_built.restype = ctypes.c_char_p
    built = lib.hkv_cpu_built().decode().split(",")
    missing = [f for f in sys.argv[2:] if f not in built]
    print(f"{'FAIL' if missing else 'ok  '} built for: {','.join(built)}")
    if missing:
        failures.append(f"cpu record lacks {missing}")


def elementwise(lib: ctypes.CDLL) -> None:
    x, w = rng.standard_normal((5, 37), dtype=F32), rng.standard_normal(37, dtype=F32)
    out = np.empty_like(x)
    i64_, f32_ = ctypes.c_int64, ctypes.c_float
    lib.hkv_rms_norm_f32(ptr(x), i64_(37), ptr(w), ptr(out), i64_(5), i64_(37), f32_(1e-6))
    want = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    check("rms_norm_f32", out, want.astype(F32))
    gate, up = rng.standard_normal((4, 33), dtype=F32), rng.standard_normal((4, 33), dtype=F32)
    out = np.empty_like(gate)
    lib.hkv_silu_mul_f32(ptr(gate), i64_(33), ptr(up), i64_(33), ptr(out), i64_(4), i64_(33))
    check("silu_mul_f32", out, silu(gate) * up)
    x = rng.standard_normal((3, 101), dtype=F32)
    idx = np.empty(3, dtype=np.int64)
    lib.hkv_argmax_f32(ptr(x), i64_(101), i64_(3), i64_(101), ptr(idx))
    check("argmax_f32", idx.astype(F32), x.argmax(-1).astype(F32), rtol=0.0)


def spans(lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    starts = i64(np.concatenate([[0], np.cumsum(lens)[:-1]]))
    return starts, i64(lens)


def conv1d(lib: ctypes.CDLL) -> None:
    C, K, lens, pages, has = 20, 4, [5, 1, 3], [2, 0, 1], [1, 1, 0]
    rows, depth = [0, -1, 1], 4
    T = sum(lens)
    x = rng.standard_normal((T, C), dtype=F32)
    w = rng.standard_normal((C, K), dtype=F32)
    bias = rng.standard_normal(C, dtype=F32)
    state = rng.standard_normal((3, C, K - 1), dtype=F32)
    start_state = state.copy()
    kept = np.full((2, depth, C, K - 1), np.nan, dtype=F32)
    y = np.empty((T, C), dtype=F32)
    wt = np.ascontiguousarray(w.T)
    starts, lens_a = spans(lens)
    status = lib.hkv_conv1d(
        ptr(state), ctypes.c_int64(C * (K - 1)), 0, ptr(i64(pages)),
        ptr(np.array(has, dtype=np.uint8)), ptr(starts), ptr(lens_a), ctypes.c_int64(3),
        ctypes.c_int64(C), ctypes.c_int64(K), ptr(x), ctypes.c_int64(C), 0, ptr(wt), ptr(bias), 1,
        0, ptr(y), ptr(kept), ptr(i64(rows)), ctypes.c_int64(depth * C * (K - 1)),
        ctypes.c_int64(C * (K - 1)),
    )  # fmt: skip
    assert status == 0
    for r, (n, page) in enumerate(zip(lens, pages, strict=True)):
        first = int(starts[r])
        history = start_state[page].T if has[r] else np.zeros((K - 1, C), F32)
        seen = np.concatenate([history, x[first : first + n]])  # [K - 1 + n, C]
        want = np.stack([bias + (seen[i : i + K] * w.T).sum(0) for i in range(n)])
        check(f"conv1d request {r} outputs", y[first : first + n], silu(want))
        check(f"conv1d request {r} state", state[page], seen[n:].T)
        for i in range(n - 1 if rows[r] >= 0 else 0):
            check(f"conv1d request {r} state after {i}", kept[rows[r], i], seen[i + 1 : i + K].T)


def mamba2_scan(lib: ctypes.CDLL) -> None:
    H, P, N, G, lens, pages, rows, depth = 3, 8, 16, 1, [4, 1], [1, 0], [0, -1], 3
    T = sum(lens)
    x = rng.standard_normal((T, H, P), dtype=F32)
    dt = rng.uniform(0.05, 0.5, (T, H)).astype(F32)
    A = -rng.uniform(0.5, 2.0, H).astype(F32)
    B, Cm = (rng.standard_normal((T, G, N), dtype=F32) for _ in range(2))
    D = rng.standard_normal(H, dtype=F32)
    state = rng.standard_normal((2, H, P, N), dtype=F32)
    start_state = state.copy()
    kept = np.full((1, depth, H, P, N), np.nan, dtype=F32)
    y = np.empty_like(x)
    starts, lens_a = spans(lens)
    lib.hkv_mamba2_scan(
        ptr(state), ctypes.c_int64(H * P * N), 0, ptr(i64(pages)), ptr(np.ones(2, np.uint8)),
        ptr(starts), ptr(lens_a), ctypes.c_int64(2), ctypes.c_int64(H), ctypes.c_int64(P),
        ctypes.c_int64(N), ctypes.c_int64(G), ptr(x), ctypes.c_int64(H * P), ptr(dt), ptr(A),
        ptr(B), ptr(Cm), ctypes.c_int64(G * N), ptr(D), ptr(y), ptr(kept), ptr(i64(rows)),
        ctypes.c_int64(depth * H * P * N), ctypes.c_int64(H * P * N),
    )  # fmt: skip
    for r, (n, page) in enumerate(zip(lens, pages, strict=True)):
        h_state = start_state[page].astype(np.float64)
        for i in range(n):
            t = int(starts[r]) + i
            decay = np.exp(dt[t] * A)[:, None, None]  # [H, 1, 1]
            h_state = h_state * decay + (dt[t][:, None] * x[t])[:, :, None] * B[t, 0][None, None]
            want_y = (h_state * Cm[t, 0][None, None]).sum(-1) + D[:, None] * x[t]
            check(f"mamba2 scan request {r} token {i}", y[t], want_y.astype(F32))
            if rows[r] >= 0 and i < n - 1:
                check(f"mamba2 scan request {r} state after {i}", kept[rows[r], i],
                      h_state.astype(F32))  # fmt: skip
        check(f"mamba2 scan request {r} state", state[page], h_state.astype(F32))


def gated_delta_rule(lib: ctypes.CDLL) -> None:
    Hk, Hv, K, V, lens, pages, rows, depth = 1, 2, 8, 12, [3, 2], [0, 1], [-1, 0], 2
    T = sum(lens)
    q, k = (rng.standard_normal((T, Hk, K), dtype=F32) for _ in range(2))
    v = rng.standard_normal((T, Hv, V), dtype=F32)
    g = -rng.uniform(0.05, 1.0, (T, Hv)).astype(F32)
    beta = rng.uniform(0.1, 0.9, (T, Hv)).astype(F32)
    state = rng.standard_normal((2, Hv, K, V), dtype=F32)
    start_state = state.copy()
    kept = np.full((1, depth, Hv, K, V), np.nan, dtype=F32)
    o = np.empty((T, Hv, V), dtype=F32)
    failed = np.zeros(1, dtype=np.int32)
    starts, lens_a = spans(lens)
    lib.hkv_gated_delta_rule(
        ptr(state), ctypes.c_int64(Hv * K * V), 0, ptr(i64(pages)), ptr(np.ones(2, np.uint8)),
        ptr(starts), ptr(lens_a), ctypes.c_int64(2), ctypes.c_int64(Hk), ctypes.c_int64(Hv),
        ctypes.c_int64(K), ctypes.c_int64(V), ptr(q), ctypes.c_int64(Hk * K), ptr(k),
        ctypes.c_int64(Hk * K), ptr(v), ctypes.c_int64(Hv * V), 0, ptr(g), ptr(beta), ptr(o),
        ptr(failed), ptr(kept), ptr(i64(rows)), ctypes.c_int64(depth * Hv * K * V),
        ctypes.c_int64(Hv * K * V),
    )  # fmt: skip
    assert failed[0] == 0

    def l2(a: np.ndarray) -> np.ndarray:
        return a / np.sqrt((a.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6)

    for r, (n, page) in enumerate(zip(lens, pages, strict=True)):
        S = start_state[page].astype(np.float64)  # [Hv, K, V]
        for i in range(n):
            t = int(starts[r]) + i
            for h in range(Hv):
                kh = h // (Hv // Hk)
                qn, kn = l2(q[t, kh]) / np.sqrt(K), l2(k[t, kh])
                decay = np.exp(g[t, h])
                pred = decay * S[h].T @ kn
                S[h] = decay * S[h] + np.outer(kn, beta[t, h] * (v[t, h] - pred))
                check(f"gdn request {r} token {i} head {h}", o[t, h], (S[h].T @ qn).astype(F32),
                      rtol=1e-4)  # fmt: skip
            if rows[r] >= 0 and i < n - 1:
                check(f"gdn request {r} state after {i}", kept[rows[r], i], S.astype(F32), 1e-4)
        check(f"gdn request {r} state", state[page], S.astype(F32), rtol=1e-4)


def paged_decode(lib: ctypes.CDLL) -> None:
    kbs, KVH, H, Dh, lens = 4, 2, 4, 12, [7, 3]
    S, blocks = len(lens), 6
    cache = rng.standard_normal((blocks, 2, kbs, KVH, Dh), dtype=F32)
    table = np.array([[4, 1], [2, 0]], dtype=np.int32)  # request s's kernel blocks
    q = rng.standard_normal((S, H, Dh), dtype=F32)
    out = np.empty_like(q)
    scale = 1.0 / np.sqrt(Dh)
    lib.hkv_paged_decode(
        ptr(q), ptr(cache), 0, ctypes.c_int64(kbs), ctypes.c_int64(KVH), ctypes.c_int64(Dh),
        ctypes.c_int64(H), ptr(table), ctypes.c_int64(2), ptr(np.array(lens, dtype=np.int32)),
        ctypes.c_int64(0), ctypes.c_int64(S), ctypes.c_float(scale), ctypes.c_float(0.0), None,
        ptr(out),
    )  # fmt: skip
    for s, n in enumerate(lens):
        slots = [(table[s, p // kbs], p % kbs) for p in range(n)]
        keys = np.stack([cache[b, 0, o] for b, o in slots])  # [n, KVH, Dh]
        values = np.stack([cache[b, 1, o] for b, o in slots])
        for h in range(H):
            kv = h // (H // KVH)
            scores = keys[:, kv] @ q[s, h] * scale
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ values[:, kv]
            check(f"paged decode request {s} head {h}", out[s, h], want.astype(F32), rtol=1e-4)


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    for run in (cpu_record, elementwise, conv1d, mamba2_scan, gated_delta_rule, paged_decode):
        run(lib)
    print(f"{len(failures)} failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
