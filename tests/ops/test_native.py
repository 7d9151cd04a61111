import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridkv.ops import native, registry
from hybridkv.ops.mamba2 import ssd_step
from hybridkv.ops.native import decode_attention as native_attn
from hybridkv.ops.native import elementwise as native_ew
from hybridkv.ops.native import norms as native_norms
from hybridkv.ops.native import spans as native_spans
from hybridkv.ops.native import ssm as native_ssm

needs_compiler = pytest.mark.skipif(
    shutil.which("gcc") is None or not sys.platform.startswith("linux"),
    reason="the native kernels are built with gcc on Linux",
)


@needs_compiler
def test_library_builds_and_is_cached():
    lib = native.library()
    assert lib is not None
    assert native._library_path().is_file()
    assert native.library() is lib


def fake_compiler(folder, body: str):
    """An executable shell script standing in for gcc (`CC`)."""
    script = folder / "cc"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


TWO_FILES = {"a.c": "int hkv_t_a(int x) { return x + 1; }\n",
             "b.c": "int hkv_t_a(int); int hkv_t_b(int x) { return 2 * hkv_t_a(x); }\n"}


@needs_compiler
def test_compile_library_links_its_files_and_names_a_failure(tmp_path):
    """Each file compiled on its own, then linked: a function calls across files; a broken
    file raises with the compiler's message."""
    import ctypes
    import subprocess

    files = []
    for name, text in TWO_FILES.items():
        files.append(tmp_path / name)
        files[-1].write_text(text)
    out = tmp_path / "two.so"
    native.compile_library("gcc", native.CFLAGS, files, out)
    assert ctypes.CDLL(str(out)).hkv_t_b(20) == 42
    broken = tmp_path / "broken.c"
    broken.write_text("int hkv_broken(void) { return missing_name; }\n")
    with pytest.raises(subprocess.CalledProcessError) as err:
        native.compile_library("gcc", native.CFLAGS, [*files, broken], tmp_path / "no.so")
    assert "missing_name" in err.value.stderr
    assert not (tmp_path / "no.so").exists()


@needs_compiler
def test_builders_of_one_library_wait_for_one_build(tmp_path, monkeypatch):
    """Two builders of one key at once (test workers, tensor-parallel ranks): one compiles,
    the other waits on the lock and finds its file. The compiler is a logging wrapper that
    sleeps, so the second builder arrives while the first compiles."""
    import threading

    for name, text in TWO_FILES.items():
        (tmp_path / name).write_text(text)
    log = tmp_path / "cc.log"
    wrapper = fake_compiler(tmp_path, f'echo "$@" >> {log}\nsleep 0.3\nexec gcc "$@"')
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native, "sources", lambda: sorted(tmp_path.glob("*.c")))
    target = tmp_path / "cache" / "native-test.so"
    results: list[bool] = []
    builders = [
        threading.Thread(target=lambda: results.append(native._build(target, "")))
        for _ in range(2)
    ]
    for b in builders:
        b.start()
    for b in builders:
        b.join(timeout=60)
    assert results == [True, True] and target.is_file()
    compiles = [line for line in log.read_text().splitlines() if " -c " in f" {line} "]
    assert len(compiles) == 3, compiles  # a.c, b.c and the adapters, once


@needs_compiler
def test_a_failed_build_warns_with_the_compilers_last_line(tmp_path, monkeypatch):
    (tmp_path / "a.c").write_text(TWO_FILES["a.c"])
    failing = fake_compiler(tmp_path, 'echo "fatal: no room left on the device" >&2\nexit 1')
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setattr(native, "sources", lambda: [tmp_path / "a.c"])
    target = tmp_path / "cache" / "native-test.so"
    with pytest.warns(RuntimeWarning, match="failed .fatal: no room left on the device"):
        assert native._build(target, "") is False
    assert not target.exists()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    assert native.library() is None
    q = torch.randn(1, 2, 4)
    cache = torch.zeros(2, 2, 4, 1, 4)
    table = torch.ones(1, 1, dtype=torch.int32)
    lens = torch.tensor([3])
    assert native_attn.paged_decode_attention(q, cache, table, lens, 0.5, None) is None


def _state_problem():
    g = torch.Generator().manual_seed(0)
    R, H, P, N, G = 5, 6, 8, 16, 3
    # page-strided view: each page has spare room after its [H, P, N] state, as in the buffers
    flat = torch.full((9, H * P * N + 40), float("nan"))
    state = flat[:, : H * P * N].view(9, H, P, N)
    pages = torch.tensor([7, 1, 4, 8, 2])
    state[pages] = torch.randn(R, H, P, N, generator=g)
    args = (
        torch.randn(R, H, P, generator=g),
        torch.rand(R, H, generator=g),
        -torch.rand(H, generator=g) * 4,
        torch.randn(R, G, N, generator=g),
        torch.randn(R, G, N, generator=g),
        torch.randn(H, generator=g),
    )
    return flat, state, pages, args


@needs_compiler
def test_mamba2_decode_step_matches_ssd_step_in_place():
    flat, state, pages, (x, dt, A, B, C, D) = _state_problem()
    before = flat.clone()
    y_ref, h_ref = ssd_step(x, dt, A, B, C, D, state[pages].clone())
    has = torch.ones(5, dtype=torch.bool)
    qsl = torch.arange(6, dtype=torch.int32)  # one token per request
    y = native_ssm.mamba2_scan(state, pages, has, qsl, x, dt, A, B, C, D)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[pages], h_ref, rtol=1e-5, atol=1e-5)
    others = torch.tensor([0, 3, 5, 6])
    assert torch.equal(flat[others].isnan(), before[others].isnan())  # untouched NaN pages
    assert flat[:, -40:].isnan().all()  # nor the room after each state


@needs_compiler
def test_mamba2_scan_zero_length_request_keeps_its_page():
    flat, state, pages, (x, dt, A, B, C, D) = _state_problem()
    before = state[pages].clone()
    has = torch.tensor([True, False, True, True, True])
    qsl = torch.tensor([0, 1, 1, 2, 3, 5], dtype=torch.int32)  # request 1 has no tokens
    y = native_ssm.mamba2_scan(state, pages, has, qsl, x, dt, A, B, C, D)
    assert y.shape == x.shape and not y.isnan().any()
    assert torch.equal(state[pages[1]], before[1])


@needs_compiler  # without the library every call declines: nothing to test
def test_mamba2_scan_declines_other_dtypes():
    _, state, pages, (x, dt, A, B, C, D) = _state_problem()
    has, qsl = torch.ones(5, dtype=torch.bool), torch.arange(6)
    assert native_ssm.mamba2_scan(state.half(), pages, has, qsl, x, dt, A, B, C, D) is None
    assert native_ssm.mamba2_scan(state, pages, has, qsl, x.double(), dt, A, B, C, D) is None


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 12])  # decode rows, and the blocked path of a prefill
def test_mamba2_scan_bf16_state_is_the_float32_scan_rounded(tokens):
    # a bfloat16 state is widened, scanned in float32 and rounded back: the same numbers as
    # the float32 kernel on the widened state, to the last bit
    g = torch.Generator().manual_seed(tokens)
    R, H, P, N, G = 3, 4, 16, 16, 2
    flat = torch.full((6, H * P * N + 8), float("nan"), dtype=torch.bfloat16)
    state = flat[:, : H * P * N].view(6, H, P, N)
    pages = torch.tensor([4, 1, 5])
    state[pages] = torch.randn(R, H, P, N, generator=g).bfloat16()
    T = R * tokens
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g)
    A, D = -torch.rand(H, generator=g) * 4, torch.randn(H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    has = torch.tensor([True, False, True])
    qsl = torch.arange(R + 1) * tokens
    wide = state.float()
    y_ref = native_ssm.mamba2_scan(wide, pages, has, qsl, x, dt, A, B, C, D)
    y = native_ssm.mamba2_scan(state, pages, has, qsl, x, dt, A, B, C, D)
    assert torch.equal(y, y_ref)
    assert torch.equal(state[pages], wide[pages].bfloat16())
    assert flat[:, -8:].isnan().all() and flat[[0, 2, 3]].isnan().all()


@needs_compiler
@pytest.mark.parametrize("kbs,window", [(1, None), (3, 4), (16, None), (16, 7)])
def test_paged_decode_matches_dense_attention(kbs, window):
    _check_paged_decode(kbs, window, torch.float32)


@needs_compiler
@pytest.mark.parametrize("kbs,window", [(3, None), (16, 7)])
def test_paged_decode_bf16_is_the_float32_attention_of_the_widened_cache(kbs, window):
    _check_paged_decode(kbs, window, torch.bfloat16)


def _check_paged_decode(kbs: int, window: int | None, dtype: torch.dtype) -> None:
    """Native decode attention against dense attention of the same (widened) keys and values,
    in float32; a bfloat16 result is that float32 result rounded."""
    g = torch.Generator().manual_seed(kbs)
    heads, kv_heads, d, num_blocks = 6, 2, 16, 40
    cache = torch.full((num_blocks, 2, kbs, kv_heads, d), float("nan"), dtype=dtype)
    lens = [1, 9, 23, 5]
    table = torch.zeros(len(lens), 30, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    ks, vs, used = [], [], 0
    for s, n in enumerate(lens):
        blocks = -(-n // kbs)
        table[s, :blocks] = perm[used : used + blocks].int()
        used += blocks
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype).float()
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype).float()
        pos = torch.arange(n)
        cache[table[s, pos // kbs].long(), 0, pos % kbs] = k.to(dtype)
        cache[table[s, pos // kbs].long(), 1, pos % kbs] = v.to(dtype)
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = native_attn.paged_decode_attention(q, cache, table, torch.tensor(lens), 0.3, window)
    assert out is not None and out.dtype == dtype and not out.isnan().any()
    for s, n in enumerate(lens):
        first = 0 if window is None else max(0, n - window)
        k = ks[s][first:].repeat_interleave(heads // kv_heads, dim=1)  # [t, heads, d]
        v = vs[s][first:].repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[s].float(), k) * 0.3, dim=-1)
        expected = torch.einsum("ht,thd->hd", p, v)
        if dtype == torch.float32:
            torch.testing.assert_close(out[s], expected, rtol=1e-5, atol=1e-5)
        else:  # the float32 result rounded: within one bfloat16 step of the rounded reference
            torch.testing.assert_close(out[s].float(), expected, rtol=8e-3, atol=1e-5)


@needs_compiler
def test_conv1d_decode_step_matches_window_sum_with_strided_rows():
    g = torch.Generator().manual_seed(2)
    S, C, K = 3, 70, 4  # 70 channels: a full block of 64 and a ragged one
    flat = torch.full((6, C * (K - 1) + 3), float("nan"))  # room after each page's state
    state = flat[:, : C * (K - 1)].view(6, C, K - 1)
    pages = torch.tensor([4, 1, 5])
    state[pages] = torch.randn(S, C, K - 1, generator=g)
    wide = torch.randn(S, C + 7, generator=g)
    x = wide[:, 2 : 2 + C]  # rows strided, as a slice of the in_proj output
    weight, bias = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    window = torch.cat([state[pages], x[:, :, None]], dim=-1)  # [S, C, K]
    ref = (window * weight).sum(-1) + bias
    has, qsl = torch.ones(S, dtype=torch.bool), torch.arange(S + 1)
    y = native_ssm.conv1d(x, weight, bias, state, pages, has, qsl)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[pages], window[:, :, 1:])
    assert flat[:, -3:].isnan().all() and flat[[0, 2, 3]].isnan().all()


@needs_compiler
def test_conv1d_bf16_state_and_input_is_the_float32_conv_rounded():
    g = torch.Generator().manual_seed(3)
    S, C, K = 3, 70, 4
    state = torch.full((6, C, K - 1), float("nan"), dtype=torch.bfloat16)
    pages = torch.tensor([4, 1, 5])
    state[pages] = torch.randn(S, C, K - 1, generator=g).bfloat16()
    x = torch.randn(7, C, generator=g).bfloat16()  # requests of 1, 4 and 2 tokens
    weight, bias = torch.randn(C, K, generator=g).bfloat16(), torch.randn(C, generator=g)
    has, qsl = torch.tensor([True, True, False]), torch.tensor([0, 1, 5, 7])
    wide = state.float()
    ref = native_ssm.conv1d(x.float(), weight.float(), bias, wide, pages, has, qsl, silu=True)
    y = native_ssm.conv1d(x, weight, bias, state, pages, has, qsl, silu=True)
    assert y.dtype == torch.float32 and torch.equal(y, ref)
    assert torch.equal(state[pages], wide[pages].bfloat16())
    assert state[[0, 2, 3]].isnan().all()


@needs_compiler
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_long_chunks_wide_rows_against_float64(k: int, dtype: torch.dtype):
    """Requests longer than a task's run of tokens (tasks split them), single-token requests
    (the one-pass decode of d_conv 2..5; 6 takes the general path), requests shorter than the
    history, mixed initial states; 600 channels (a bfloat16 page is widened 512 at a time);
    rows strided."""
    g = torch.Generator().manual_seed(k)
    C, lens, has_list = 600, [40, 1, 2, 1, 17, 1], [True, True, True, False, False, True]
    S, T = len(lens), sum(lens)
    state = torch.full((9, C, k - 1), float("nan"), dtype=dtype)
    pages = torch.tensor([7, 0, 3, 5, 2, 8])
    state[pages] = torch.randn(S, C, k - 1, generator=g).to(dtype)
    x = torch.randn(T, C + 5, generator=g).to(dtype)[:, 3 : 3 + C]
    weight, bias = torch.randn(C, k, generator=g), torch.randn(C, generator=g)
    has = torch.tensor(has_list)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    old = state.double()
    y = native_ssm.conv1d(x, weight, bias, state, pages, has, qsl, silu=True)
    for s in range(S):
        hist = old[pages[s]] if has[s] else torch.zeros(C, k - 1, dtype=torch.float64)
        window = torch.cat([hist, x[qsl[s] : qsl[s + 1]].double().t()], dim=1)  # [C, k-1+L]
        ref = torch.stack([(window[:, t : t + k] * weight.double()).sum(-1) for t in
                           range(lens[s])]) + bias.double()  # fmt: skip
        torch.testing.assert_close(y[qsl[s] : qsl[s + 1]].double(), F.silu(ref), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
        assert torch.equal(state[pages[s]].double(), window[:, -(k - 1) :].to(dtype).double())
    untouched = [p for p in range(9) if p not in pages.tolist()]
    assert state[untouched].isnan().all()


@needs_compiler  # without the library every call declines: nothing to test
def test_conv1d_declines_a_history_longer_than_the_kernel_keeps():
    C, K = 4, native_ssm.CONV_MAX_HISTORY + 2
    state = torch.zeros(3, C, K - 1)
    x, weight = torch.randn(2, C), torch.randn(C, K)
    has, qsl = torch.ones(2, dtype=torch.bool), torch.arange(3)
    assert native_ssm.conv1d(x, weight, None, state, torch.tensor([1, 2]), has, qsl) is None


@needs_compiler
def test_paged_decode_softmax_over_a_wide_score_range():
    # scale 40 spreads scores over hundreds: most weights underflow (the kernel's exp clamps
    # below e^-87), the result must still be the exact softmax to float32 precision
    g = torch.Generator().manual_seed(9)
    heads, d, kbs, n = 2, 8, 4, 37
    cache = torch.zeros(12, 2, kbs, 1, d)
    table = torch.arange(1, 11, dtype=torch.int32)[None]
    pos = torch.arange(n)
    k, v = torch.randn(n, 1, d, generator=g), torch.randn(n, 1, d, generator=g)
    cache[table[0, pos // kbs].long(), 0, pos % kbs] = k
    cache[table[0, pos // kbs].long(), 1, pos % kbs] = v
    q = torch.randn(1, heads, d, generator=g)
    out = native_attn.paged_decode_attention(q, cache, table, torch.tensor([n]), 40.0, None)
    scores = torch.einsum("hd,td->ht", q[0].double(), k[:, 0].double()) * 40.0
    ref = torch.softmax(scores, dim=-1) @ v[:, 0].double()
    assert (scores.max(-1).values - scores.min(-1).values).min() > 100  # the range is wide
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-6)


@needs_compiler
def test_silu_mul_bf16_rounds_where_pytorch_does():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 2 * 200, generator=g) * 6).bfloat16()  # wide range of silu inputs
    gate, up = x.chunk(2, dim=-1)
    out = native_ew.silu_and_mul(x)
    assert out is not None and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)


@needs_compiler
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_bf16_norm_rows_round_where_pytorch_does(weight_in_fp32, weight_dtype, monkeypatch):
    """Wide bfloat16 rows (768 channels, 3 groups): the native norms give PyTorch's numbers but
    for a last-bit flip where the two float32 sums round apart. A float32 weight (a
    zero-centred norm's 1 + weight) is used unrounded, as PyTorch's type promotion does."""
    from hybridkv.ops import norm

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(17, 768, generator=g) * 3).bfloat16()
    h = torch.randn(17, 768, generator=g).bfloat16()
    z = torch.randn(17, 768, generator=g).bfloat16()
    w = (torch.randn(768, generator=g) + 1).to(weight_dtype)

    def run() -> list[torch.Tensor]:
        total, normed = norm.add_rms_norm(x, h, 0.5, w, 1e-6, weight_in_fp32=weight_in_fp32)
        return [
            norm.rms_norm(x, w, 1e-6, weight_in_fp32=weight_in_fp32), total, normed,
            norm.gated_rms_norm(x, z, w, 1e-6, 256, weight_in_fp32=weight_in_fp32),
        ]  # fmt: skip

    assert native_norms.rms_norm(x, w, 1e-6, weight_in_fp32) is not None  # the kernels take these
    assert native_norms.gated_rms_norm(x, z, w, 1e-6, 256, False, weight_in_fp32) is not None
    fast = run()
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = run()
    for out, expected in zip(fast, ref, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)
        assert (out == expected).float().mean() >= 0.98


@needs_compiler
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize(
    "x_dtype,gate_dtype,out_dtype",
    [
        (torch.float32, torch.bfloat16, torch.bfloat16),  # a bf16 Mamba2 mixer: scan out, gate
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float32, torch.float32, torch.bfloat16),
    ],
)
def test_gated_norm_mixed_dtypes_is_the_reference_then_the_cast(
    x_dtype, gate_dtype, out_dtype, norm_before_gate, monkeypatch
):
    """x, gate and out of different dtypes: PyTorch's numbers (computed in x's dtype, then cast
    to out's) but for last-bit flips where the float32 sums round apart."""
    from hybridkv.ops import norm

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 384, generator=g) * 3).to(x_dtype)
    z = torch.randn(9, 384, generator=g).to(gate_dtype)
    w = (torch.randn(384, generator=g) + 1).bfloat16()
    args = (x, z, w, 1e-5, 128, norm_before_gate)
    assert native_norms.gated_rms_norm(*args, False, out_dtype) is not None  # the kernel runs
    fast = norm.gated_rms_norm(*args, out_dtype=out_dtype)
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = norm.gated_rms_norm(*args, out_dtype=out_dtype)
    assert fast.dtype == ref.dtype == out_dtype
    tol = 2**-7 if torch.bfloat16 in (x_dtype, out_dtype) else 2e-6
    torch.testing.assert_close(fast.float(), ref.float(), rtol=tol, atol=1e-6)
    if out_dtype == torch.bfloat16:
        assert (fast == ref).float().mean() >= 0.98


@needs_compiler
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_gated_norm_of_bfloat16_x_into_float32_is_rounded_in_x_dtype(
    gate_dtype, norm_before_gate, monkeypatch
):
    """bfloat16 x, float32 out: the reference computes in x's dtype (bfloat16 values), then
    widens them; the kernel stored its float32 value unrounded (up to half a bfloat16 step
    off, in almost every element)."""
    from hybridkv.ops import norm

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 96, generator=g) * 3).bfloat16()
    z = torch.randn(6, 96, generator=g).to(gate_dtype)
    w = (torch.randn(96, generator=g) + 1).bfloat16()
    args = (x, z, w, 1e-5, 32, norm_before_gate)
    assert native_norms.gated_rms_norm(*args, False, torch.float32) is not None
    fast = norm.gated_rms_norm(*args, out_dtype=torch.float32)
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = norm.gated_rms_norm(*args, out_dtype=torch.float32)
    assert fast.dtype == ref.dtype == torch.float32
    assert torch.equal(fast, fast.bfloat16().float())  # bfloat16 values, widened
    torch.testing.assert_close(fast, ref, rtol=2**-7, atol=1e-6)
    assert (fast == ref).float().mean() >= 0.98


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial rotary
def test_rope_is_the_pytorch_rotation(dtype, rotary_dim, monkeypatch):
    """The native rotary embedding equals `layers.rotary._rotate`'s PyTorch ops (bfloat16: the
    same roundings, so bit for bit), on a strided view such as a slice of a fused projection."""
    from hybridkv.layers.rotary import _rotate

    g = torch.Generator().manual_seed(rotary_dim)
    fused = torch.randn(7, 5 * 32 + 8, generator=g).to(dtype)  # [T, q (3 heads) | k (2) | ...]
    k = fused[:, 96:160].view(7, 2, 32)  # a strided view of 2 heads
    q = fused[:, :96].view(7, 3, 32)
    angles = torch.randn(7, rotary_dim // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    assert native_ew.rope(k, cos, sin, rotary_dim) is not None
    fast = [_rotate(t, cos, sin, rotary_dim) for t in (q, k)]
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = [_rotate(t, cos, sin, rotary_dim) for t in (q, k)]
    for a, b in zip(fast, ref, strict=True):
        assert a.shape == b.shape and a.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_puts_every_row_where_the_pytorch_path_does(dtype, monkeypatch):
    """k and v as column slices of one fused projection (strided tokens), padding slots (-1)
    skipped, NaN elsewhere untouched: the cache equals the PyTorch path's, bit for bit."""
    from hybridkv.ops.attention import write_kv_cache

    g = torch.Generator().manual_seed(2)
    fused = torch.randn(6, 3 * 2 * 4 + 5, generator=g).to(dtype)  # [T, q | k | v | ...]
    k, v = fused[:, 8:16].view(6, 2, 4), fused[:, 16:24].view(6, 2, 4)
    slots = torch.tensor([5, -1, 0, 11, 7, -1])
    caches = []
    for native_on in ("1", "0"):
        monkeypatch.setenv("HYBRIDKV_NATIVE", native_on)
        registry.reset_all()  # op choices follow the new setting
        cache = torch.full((4, 2, 3, 2, 4), float("nan"), dtype=dtype)
        write_kv_cache(k, v, cache, slots)
        caches.append(cache)
    monkeypatch.setenv("HYBRIDKV_NATIVE", "1")
    registry.reset_all()  # op choices follow the new setting
    assert native_attn.write_kv_cache(k, v, caches[0].clone(), slots)  # the kernel takes these
    assert torch.equal(caches[0].isnan(), caches[1].isnan())
    assert torch.equal(caches[0].nan_to_num(), caches[1].nan_to_num())
    assert (~caches[0].isnan()).sum() == 4 * 2 * 2 * 4  # four slots, K and V, 2 heads of 4


@needs_compiler
def test_provided_spans_survive_a_full_table():
    """A step hands each state group its spans; when the table of recent spans is full, the
    oldest entries go, never the ones this step just provided (a capture reads all of them)."""

    def meta(n):
        return (torch.arange(n), torch.ones(n, dtype=torch.bool), torch.arange(n + 1))

    def provide(m):
        pages, has, qsl = m
        spans = (pages, has.view(torch.uint8), qsl[:-1], torch.ones(len(pages), dtype=torch.int64))
        native_spans.provide_spans(*m, spans, (0, len(pages) - 1, 1, 0, len(pages)))
        return spans

    for _ in range(native_spans._SPANS_KEPT - 1):  # earlier steps, nearly filling the table
        provide(meta(2))
    first, second = meta(3), meta(4)
    a, b = provide(first), provide(second)
    assert native_spans.step_spans(*first) is a and native_spans.step_spans(*second) is b
    assert native_spans.spans_inside(*first, num_pages=3, num_tokens=3)
    assert len(native_spans._recent_spans) == native_spans._SPANS_KEPT


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_far_below_zero_is_torch_silu(dtype):
    """Below -87 e^v leaves float32's normal range: silu is then -0 as torch's (the clamped
    exponential once gave v * 1.6e-38: -4.9 at -3e38), and NaN at -inf; every lane width."""
    values = [-3e38, -1e30, -1000.0, -88.0, -87.5, -86.0, -20.0, 0.0, 5.0, 1e30, -float("inf")]
    gate = torch.tensor(values * 3, dtype=dtype)[None, :].repeat(3, 1)  # 33 columns: tails
    up = torch.ones_like(gate)
    out = native_ew.silu_mul(gate, up)
    ref = F.silu(gate.float()).to(dtype) * up
    assert out is not None
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=rtol, atol=1e-30)
