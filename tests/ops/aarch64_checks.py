"""Checks of the native library built for aarch64, run by an aarch64 Python under qemu-user
(tests/ops/test_native_aarch64.py): NumPy and ctypes only (no PyTorch there), each kernel
against a NumPy reference written from the kernel's own comment in the C file.

    python3 aarch64_checks.py LIBRARY [FEATURE ...]
        (prints one line per check; exit 1 on a mismatch; FEATURE: what the CPU record must say
        the library was built for, e.g. neon; the same checks run on x86-64 without one)

Covered: the CPU record (built for NEON), RMSNorm, silu-and-mul, argmax, the causal conv1d, the
Mamba2 scan and the gated delta rule (both with speculative decoding's per-position states),
paged decode attention over a block table, and the w8a8 linear's kernels that this build and
CPU run (NEON with and without sdot here; AMX-INT8 and AVX2 on x86-64), bit for bit. They run
ARM's code paths (the portable loops and GCC's generic vectors as NEON), where char is unsigned
and OpenMP is another build.
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
    starts, lens_a = spans(lens)
    fn = lib.hkv_gated_delta_rule
    fn.restype = ctypes.c_int  # a status: non-zero when its work space could not be allocated
    failed = fn(
        ptr(state), ctypes.c_int64(Hv * K * V), 0, ptr(i64(pages)), ptr(np.ones(2, np.uint8)),
        ptr(starts), ptr(lens_a), ctypes.c_int64(2), ctypes.c_int64(Hk), ctypes.c_int64(Hv),
        ctypes.c_int64(K), ctypes.c_int64(V), ptr(q), ctypes.c_int64(Hk * K), ptr(k),
        ctypes.c_int64(Hk * K), ptr(v), ctypes.c_int64(Hv * V), 0, ptr(g), ptr(beta), ptr(o),
        ptr(kept), ptr(i64(rows)), ctypes.c_int64(depth * Hv * K * V),
        ctypes.c_int64(Hv * K * V),
    )  # fmt: skip
    assert failed == 0

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


# --- w8a8: NumPy transcriptions of hybridkv/layers/quantization.py (pack_w8a8, w8a8_reference)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), nearest even, NaN -> 0x7fc0 (as torch rounds)."""
    bits = np.ascontiguousarray(a, dtype=F32).view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0
    return out


def from_bf16(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(F32)


def pack_w8a8(q: np.ndarray) -> np.ndarray:
    """q int8 [n, k] -> [n/16, k/64, 16, 16, 4]: packed[nb, kb, r, c, j] = q[16 nb + c,
    64 kb + 4 r + j], zero-padded (quantization.pack_w8a8)."""
    n, k = q.shape
    nb, kb = -(-n // 16), -(-k // 64)
    padded = np.zeros((nb * 16, kb * 64), dtype=np.int8)
    padded[:n, :k] = q
    return np.ascontiguousarray(padded.reshape(nb, 16, kb, 16, 4).transpose(0, 2, 3, 1, 4))


def w8a8_reference(x: np.ndarray, q: np.ndarray, sw: np.ndarray) -> np.ndarray:
    """x float32 [M, K], q int8 [N, K], sw bfloat16 bits [N] -> float32 [M, N]: per-row
    xq = round-half-even(x * (127 / a)) (a = max |x|; a row with an infinity or NaN: sx NaN),
    float64 sums (exact) rounded to float32, then (sums * sx) * sw in float32."""
    finite = np.isfinite(x).all(1, keepdims=True)
    with np.errstate(all="ignore"):
        a = np.where(finite, np.abs(x).max(1, keepdims=True), F32(0))
        inv = np.where(a > 0, F32(127) / a, F32(0))
        sx = np.where(finite, a / F32(127), F32(np.nan))
        xq = np.clip(np.nan_to_num(np.round(x * inv), nan=0.0), -127, 127)
        sums = (xq.astype(np.float64) @ q.astype(np.float64).T).astype(F32)
        return (sums * sx) * from_bf16(sw)[None, :]


def w8a8_case(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [m, k] with the kernels' corners in rows 1.., q int8 [n, k], sw bf16 bits [n]."""
    x = rng.standard_normal((m, k), dtype=F32) * rng.uniform(0.1, 4.0, (m, 1)).astype(F32)

    def spiked(value: float) -> np.ndarray:
        row = rng.standard_normal(k, dtype=F32)
        row[k // 2] = value
        return row

    corners = [
        np.zeros(k, F32),  # sx = 0: zero outputs
        np.concatenate([[254.0], rng.integers(-254, 255, k - 1)]).astype(F32),  # ties to even
        spiked(np.inf), spiked(np.nan),  # a non-finite value: NaN outputs in its row only
        rng.choice(F32([-3e38, 3e38, 0.0, 1.0]), k),  # near FLT_MAX: outputs overflow
        rng.choice(F32([-1e-38, 2e-39, 0.0, -0.0]), k),  # 127 / a overflows: +-127 and 0
        rng.standard_normal(k, dtype=F32) * F32(1e-30),  # tiny, 127 / a finite
    ]  # fmt: skip
    for i, row in enumerate(corners[: m - 1]):
        x[1 + i] = row
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    q[0], q[n // 2] = 127, -127  # the extreme products everywhere
    if n > 2:
        q[n - 1] = 0
    sw = to_bf16(rng.uniform(1e-3, 0.1, n).astype(F32))
    return x, q, sw


W8A8_KERNELS = [  # (symbol, what the build and the CPU need for it to run)
    ("hkv_w8a8_linear", "amx_int8"),
    ("hkv_w8a8_linear_avx2", "avx2"),
    ("hkv_w8a8_linear_neon_dot", "neon_dot"),
    ("hkv_w8a8_linear_neon", "neon"),
]
W8A8_SHAPES = [(1, 37, 71), (3, 5, 3), (3, 300, 900), (17, 37, 201), (17, 1, 130), (17, 19, 64)]


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit (float32: any NaN matches a NaN, as NaN payloads may differ)."""
    if got.dtype == np.uint16:
        return bool(np.array_equal(got, want))
    both_nan = np.isnan(got) & np.isnan(want)
    return bool(np.all(both_nan | (got.view(np.uint32) == want.view(np.uint32))))


def w8a8_run(fn, x: np.ndarray, wp: np.ndarray, sw: np.ndarray, n: int, bf16: bool):
    """The kernel on x (rows at a stride 3 past their width) -> (status, y [M, n]); y's rows
    are 2 past their width too, and those columns must stay untouched."""
    m, k = x.shape
    xs = np.zeros((m, k + 3), dtype=np.uint16 if bf16 else F32)
    xs[:, :k] = to_bf16(x) if bf16 else x
    ys = np.full((m, n + 2), 0xABCD if bf16 else 7.0, dtype=np.uint16 if bf16 else F32)
    status = fn(ptr(xs), k + 3, int(bf16), m, k, ptr(wp), ptr(sw), n, ptr(ys), n + 2, int(bf16))
    pad = ys[:, n:]
    if not np.all(pad == (0xABCD if bf16 else 7.0)):
        failures.append("w8a8 wrote past its columns")
    return status, ys[:, :n]


def w8a8_linear(lib: ctypes.CDLL) -> None:
    lib.hkv_cpu_built.restype = lib.hkv_cpu_has.restype = ctypes.c_char_p
    usable = set(lib.hkv_cpu_built().decode().split(",")) & set(
        lib.hkv_cpu_has().decode().split(",")
    )
    i64_, int_, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    for name, feature in W8A8_KERNELS:
        fn = getattr(lib, name)
        fn.argtypes = [p, i64_, int_, i64_, i64_, p, p, i64_, p, i64_, int_]
        fn.restype = ctypes.c_int
        if feature not in usable:
            one = np.ones((1, 1), F32)
            status, _ = w8a8_run(fn, one, pack_w8a8(one.astype(np.int8)), to_bf16(one[0]), 1, False)
            ok = status != 0  # a kernel this build or CPU lacks refuses (the reference runs)
            print(f"{'ok  ' if ok else 'FAIL'} w8a8 {name}: not run here ({feature} missing)")
            failures.extend([] if ok else [f"{name} ran without {feature}"])
            continue
        for (m, n, k), bf16 in ((s, b) for s in W8A8_SHAPES for b in (False, True)):
            x, q, sw = w8a8_case(m, n, k)
            xr = from_bf16(to_bf16(x)) if bf16 else x  # what the kernel reads
            want = w8a8_reference(xr, q, sw)
            want = to_bf16(want) if bf16 else want
            status, got = w8a8_run(fn, x, pack_w8a8(q), sw, n, bf16)
            ok = status == 0 and same_bits(got, want)
            label = f"w8a8 {name} [{m}, {k}] x [{n}, {k}] {'bf16' if bf16 else 'f32'}"
            print(f"{'ok  ' if ok else 'FAIL'} {label}: bit for bit")
            if not ok:
                failures.append(label)


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    for run in (cpu_record, elementwise, conv1d, mamba2_scan, gated_delta_rule, paged_decode,
                w8a8_linear):  # fmt: skip
        run(lib)
    print(f"{len(failures)} failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
