"""Native CPU kernels (the C files of this folder), compiled at first use and called through ctypes.

In PyTorch, the Mamba2 scan, the gated delta rule, the causal conv1d and paged decode
attention need gathers into temporaries, the math, and scatters back (and the chunked prefill
scans build [chunks, heads, L, L] tensors). The C versions read the paged cache in place
(`kernels.c` says how). On the development CPU (2 cores, 100M hybrid model): a Mamba2 layer's
decode step for 64 requests from 4.5 to 0.65 ms, an attention layer's from about 10 to 2.2 ms
(64 requests of 100..640 tokens), the prefill scan of 2048 tokens (8 requests) from about 40 ms
(chunked, PyTorch) to about 7 ms, the conv1d of those tokens from 11 ms (PyTorch) to 2.7-4.6
ms. The gated delta rule (Qwen3-Next, Qwen3.5; one thread, 24 value heads of 64 x 64 state):
2048 prefill tokens from 144 to 8.2 ms, a decode step of 64 requests from 16 to 1.2 ms. The
Mamba1 scan (Mamba, FalconMamba, Jamba) runs the same way, float32 or bfloat16.
RMSNorm (also fused with the residual add before it), SwiGLU's silu(gate) * up and the mixers'
gated RMSNorm run as one pass over their rows (PyTorch makes four to six): 1.6 to 2.5x on the
100M model's prefill shapes (benchmarks/cpu_kernels.py).

Build: `gcc -O3 -march=native -fopenmp -shared` (`HYBRIDKV_NATIVE_MARCH=x86-64-v3` for another
target) into `$XDG_CACHE_HOME/hybridkv` (default
`~/.cache/hybridkv`), keyed by the source, the compiler flags and the CPU's flags, so a cache
shared between machines never loads a build for another CPU. Built once, about a second. No
compiler, a failed build, a tensor of a dtype the kernel does not take (float32 and bfloat16;
the Mamba2 scan's other inputs float32 only), or `HYBRIDKV_NATIVE=0` in the environment: the callers
keep their PyTorch path (the reference the tests compare both with), or, for the state ops chosen
by the plan, the plan does not choose native ones.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.ops.derived import derived

# every C file of this folder is compiled into one library (the helpers they share are in
# hkv_common.h): `kernels.c` holds the kernels declared below, other files (one per op family)
# declare theirs with `declare`
SOURCE = Path(__file__).with_name("kernels.c")


def sources() -> list[Path]:
    return sorted(SOURCE.parent.glob("*.c"))


# HYBRIDKV_NATIVE_MARCH builds for another target than this CPU (e.g. x86-64-v3: AVX2 + FMA +
# F16C, no AVX-512), to check on an AVX-512 machine what an AVX2-only one runs
MARCH = os.environ.get("HYBRIDKV_NATIVE_MARCH", "native")
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_lib: Library | None = None
_tried = False

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    # argument types in the C order; `# fmt: skip` keeps them one list per kernel
    "hkv_mamba2_scan": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                        _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
    "hkv_conv1d": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int,
                   _ptr, _ptr, _int, _int, _ptr],
    # (hkv_paged_decode is in decode_attention.c)
    "hkv_paged_decode": [_ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64,
                         _f32, _ptr, _ptr],
    "hkv_rms_norm_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32],
    "hkv_add_rms_norm_f32": [_ptr, _ptr, _f32, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "hkv_silu_mul_f32": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "hkv_gated_rms_norm_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int],
    "hkv_rms_norm_bf16": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _int],
    "hkv_add_rms_norm_bf16": [_ptr, _ptr, _f32, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "hkv_silu_mul_bf16": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "hkv_gated_rms_norm_mixed": [_ptr, _int, _ptr, _int, _i64, _ptr, _ptr, _int, _i64, _i64,
                                 _i64, _f32, _int, _int],
    "hkv_rope": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64],
    "hkv_mamba2_mix": [_ptr, _int, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _int, _ptr, _i64,
                       _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr,
                       _ptr, _ptr, _f32, _f32, _ptr, _i64, _f32, _int, _int, _ptr, _int],
    "hkv_write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "hkv_argmax_f32": [_ptr, _i64, _i64, _i64, _ptr],
    "hkv_gated_delta_rule": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                             _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr,
                             _ptr],
    "hkv_mamba1_scan": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64,
                        _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr,
                        _ptr],
}  # fmt: skip
# kernels that return a status (non-zero: failed); the others return nothing
_RESTYPES = {"hkv_mamba2_mix": _int, "hkv_conv1d": _int, "hkv_mamba1_scan": _int}


def declare(signatures: dict[str, list]) -> None:
    """Add the argument types of kernels in another C file of this folder (called when the
    module that wraps them is imported; `library()` imports every module of this folder before
    it builds, so that each declared kernel also gets its replay adapter)."""
    _SIGNATURES.update(signatures)
    if _lib is not None:
        for name in signatures:
            _lib.add(name)


def returns_status(*names: str) -> None:
    """These declared kernels return an int status (non-zero: they failed); a replay stops at
    the first that fails."""
    for name in names:
        _RESTYPES[name] = _int
        if _lib is not None:
            _lib.add(name)


class Kernel:
    """One declared kernel, called like the ctypes function it wraps. While a `Tape` records
    (`hybridkv.ops.native.program.recording`), each call is also written down by name and
    argument values, so that a decode step can be replayed without Python (its `index` is its
    replay adapter's, -1 where the library was built without one)."""

    __slots__ = ("name", "fn", "argtypes", "index")

    def __init__(self, name: str, fn: Any, argtypes: list, index: int) -> None:
        self.name, self.fn, self.argtypes, self.index = name, fn, argtypes, index

    def __call__(self, *args: Any) -> Any:
        if _tape is not None:
            _tape.record(self, args)
        return self.fn(*args)


class Library:
    """The loaded kernels: each declared one as a `Kernel` attribute; other symbols (feature
    probes such as `hkv_bf16_linear_fast`) as plain ctypes functions."""

    def __init__(self, cdll: ctypes.CDLL, adapters: list[str]) -> None:
        self.cdll = cdll
        self.adapter_index = {name: i for i, name in enumerate(adapters)}
        for name in _SIGNATURES:
            self.add(name)

    def add(self, name: str) -> None:
        fn = getattr(self.cdll, name)
        fn.argtypes, fn.restype = _SIGNATURES[name], _RESTYPES.get(name)
        index = self.adapter_index.get(name, -1)
        setattr(self, name, Kernel(name, fn, _SIGNATURES[name], index))

    def __getattr__(self, name: str) -> Any:  # (only for what is not an attribute already)
        return getattr(self.cdll, name)


# The tape recording kernel calls, while one is open (`program.recording`); else None.
_tape: Any = None


def enabled() -> bool:
    return os.environ.get("HYBRIDKV_NATIVE", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _declare_all() -> None:
    """Import every module of this folder: each declares the kernels of its C file."""
    for module in sorted(SOURCE.parent.glob("*.py")):
        if module.stem != "__init__":
            importlib.import_module(f"{__name__}.{module.stem}")


# C types of the ctypes argument kinds, and how an adapter reads each from its argument slot
_C_TYPES = {_ptr: ("void *", "(void *)a[{}].i"), _i64: ("int64_t", "a[{}].i"),
            _int: ("int", "(int)a[{}].i"), _f32: ("float", "(float)a[{}].f")}  # fmt: skip


def _adapters_source(names: list[str]) -> str:
    """C source of one replay adapter per kernel: `int64_t a(const hkv_arg *args)` calls the
    kernel with its arguments read from consecutive slots (program.c runs them in order); a
    kernel without a result returns 0. Generated from the ctypes signatures, so a kernel
    declared once is both callable from Python and replayable."""
    lines = ["#include <stdint.h>", "typedef union { int64_t i; double f; } hkv_arg;"]
    for name in names:
        argtypes, returns = _SIGNATURES[name], _RESTYPES.get(name) is not None
        params = ", ".join(_C_TYPES[t][0] for t in argtypes) or "void"
        args = ", ".join(_C_TYPES[t][1].format(i) for i, t in enumerate(argtypes))
        call = f"return (int64_t){name}({args});" if returns else f"{name}({args}); return 0;"
        lines += [f"{'int' if returns else 'void'} {name}({params});",
                  f"static int64_t hkv_adapt_{name}(const hkv_arg *a) {{ {call} }}"]  # fmt: skip
    table = ", ".join(f"hkv_adapt_{name}" for name in names)
    lines += ["typedef int64_t (*hkv_adapter)(const hkv_arg *);",
              f"const hkv_adapter hkv_program_adapters[] = {{{table}}};",
              f"const int64_t hkv_program_num_adapters = {len(names)};"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _library_path(adapters: str | None = None) -> Path:
    """Where the build of these sources, adapters (default: every declared kernel's), flags
    and CPU lives."""
    if adapters is None:
        _declare_all()
        adapters = _adapters_source(sorted(_SIGNATURES))
    key = hashlib.sha256()
    headers = sorted(SOURCE.parent.glob("*.h"))  # included by the sources
    for part in [*(f.read_bytes() for f in [*sources(), *headers]), " ".join(CFLAGS).encode()]:
        key.update(part)
    key.update(adapters.encode())
    key.update(_cpu_flags().encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridkv"
    return cache / f"native-{key.hexdigest()[:16]}.so"


def _build(target: Path, adapters: str) -> bool:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None or not sys.platform.startswith("linux"):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent builders never load a partial file
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    generated = partial.with_suffix(".adapters.c")
    generated.write_text(adapters)
    cmd = [compiler, *CFLAGS, *map(str, sources()), str(generated), "-o", str(partial), "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=180)
        partial.replace(target)
        return True
    except (OSError, subprocess.SubprocessError):
        partial.unlink(missing_ok=True)
        return False
    finally:
        generated.unlink(missing_ok=True)


def library() -> Library | None:
    """The loaded kernels, building them on first use; None when unavailable."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    _tried = True
    try:
        _declare_all()
        names = sorted(_SIGNATURES)
        adapters = _adapters_source(names)
        path = _library_path(adapters)
        if not path.is_file() and not _build(path, adapters):
            return None
        lib = Library(ctypes.CDLL(str(path)), names)
    except (OSError, AttributeError):  # unloadable, or a build without a symbol we call
        return None
    _lib = lib if _runs_here(lib) else None
    return _lib


def _runs_here(lib: Library) -> bool:
    """The build's instruction sets are all on this CPU (a build forced to another target,
    `HYBRIDKV_NATIVE_MARCH`, would stop the process with an illegal instruction): else a
    warning naming the missing ones, and no native kernels."""
    probe = []
    for name in ("hkv_cpu_built", "hkv_cpu_has"):
        fn = getattr(lib.cdll, name)
        fn.argtypes, fn.restype = [], ctypes.c_char_p
        probe.append(set((fn() or b"").decode().split(",")) - {""})
    missing = sorted(probe[0] - probe[1])
    if missing:
        warnings.warn(
            f"hybridkv: the native kernels were built for {MARCH} ({', '.join(missing)}), which "
            "this CPU lacks; running without them",
            RuntimeWarning,
            stacklevel=3,
        )
    return not missing


def _is_f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels that take both accept


def _is_float_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in FLOAT_DTYPES and t.device.type == "cpu" for t in tensors)


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _contiguous_f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


Spans = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# Step metadata `_spans` converted recently, by the ids of its three tensors: every state layer
# of a group gets the same three tensors in a step, so the conversion runs once per group and
# step instead of once per kernel call (groups interleave by layer, hence one entry per group).
# The inputs are held (so their ids cannot be reused while cached) and, where they have one,
# their version checked (an in-place change recomputes); the step metadata the engine builds is
# made in inference mode (no version counter) and never written after. The oldest entries go
# first (a step's own groups are always the newest, whatever came before them).
_SPANS_KEPT = 64
_recent_spans: OrderedDict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], Spans]]
_recent_spans = OrderedDict()
_span_bounds: dict[tuple[int, ...], tuple[int, int, int, int, int]] = {}  # by the same keys


def _keep_spans(key: tuple[int, ...], entry: tuple) -> None:
    """Remember a step's converted spans, dropping the oldest beyond _SPANS_KEPT."""
    _recent_spans[key] = entry
    _recent_spans.move_to_end(key)
    while len(_recent_spans) > _SPANS_KEPT:
        old, _ = _recent_spans.popitem(last=False)
        _span_bounds.pop(old, None)


def _spans(
    state_pages: torch.Tensor, has_initial_state: torch.Tensor, query_start_loc: torch.Tensor
) -> Spans:
    """The per-request arrays the state kernels take: pages, has-initial flags (uint8), first
    token and token count, all contiguous int64 except the flags."""
    inputs = (state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in inputs)
    versions = tuple(-1 if t.is_inference() else t._version for t in inputs)
    hit = _recent_spans.get(key)
    if hit is not None and hit[1] == versions:
        return hit[2]
    bounds = query_start_loc.to(torch.int64)
    spans = (
        state_pages.to(torch.int64).contiguous(),
        has_initial_state.to(torch.uint8).contiguous(),
        bounds[:-1].contiguous(),
        (bounds[1:] - bounds[:-1]).contiguous(),
    )
    _span_bounds.pop(key, None)
    _keep_spans(key, (inputs, versions, spans))
    return spans


def provide_spans(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    spans: Spans,
    bounds: tuple[int, int, int, int, int],
) -> None:
    """Hand the state kernels a step's spans converted by the caller (the model runner builds
    them in NumPy with the step): `_spans` and `_spans_inside` then find them instead of
    converting the metadata with tensor ops. bounds: (min page, max page, min request length,
    first token, end of the last request), as `_span_bounds_of` computes them."""
    inputs = (state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in inputs)
    versions = tuple(-1 if t.is_inference() else t._version for t in inputs)
    _span_bounds[key] = bounds
    _keep_spans(key, (inputs, versions, spans))


def _span_bounds_of(
    state_pages: torch.Tensor, has_initial_state: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[int, int, int, int, int] | None:
    """(min page, max page, min request length, first token, end of the last request) of a
    step's spans, reduced once per metadata as `_spans` converts it; None when the metadata
    is inconsistent (pages and requests of different counts)."""
    pages, _, starts, lens = _spans(state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in (state_pages, has_initial_state, query_start_loc))
    bounds = _span_bounds.get(key)
    if bounds is None:
        if pages.shape[0] != lens.shape[0]:
            return None
        if pages.numel() == 0:
            bounds = (0, -1, 0, 0, 0)
        else:
            bounds = (
                int(pages.min()), int(pages.max()), int(lens.min()), int(starts.min()),
                int((starts + lens).max()),
            )  # fmt: skip
        if key in _recent_spans:
            _span_bounds[key] = bounds
    return bounds


def _spans_inside(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_pages: int,
    num_tokens: int,
) -> bool:
    """Whether every request's page lies in [0, num_pages) and its tokens in [0, num_tokens)
    (a kernel would read and write out of bounds otherwise); a kernel call compares five ints
    (`_span_bounds_of`)."""
    bounds = _span_bounds_of(state_pages, has_initial_state, query_start_loc)
    if bounds is None:
        return False
    page_min, page_max, len_min, first, end = bounds
    return (
        page_min >= 0 and page_max < num_pages and len_min >= 0 and first >= 0 and end <= num_tokens
    )


def _spans_cover(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
) -> bool:
    """Whether the requests' tokens are all of [0, num_tokens) (spans of query_start_loc from
    0 to num_tokens): a kernel then writes every row of its output."""
    bounds = _span_bounds_of(state_pages, has_initial_state, query_start_loc)
    return bounds is not None and bounds[3] == 0 and bounds[4] == num_tokens


def mamba2_scan(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor | None:
    """The Mamba2 scan of packed requests natively (token by token, state in place); None when
    the kernels or these tensors are not supported.

    ssm_state: [num_pages, H, P, N] float32 or bfloat16 (a page-strided view; each page's
    [H, P, N] contiguous); state_pages: [S]; has_initial_state: [S] bool; query_start_loc:
    [S + 1]; x: [T, H, P]; dt: [T, H] processed; A, D: [H]; B, C: [T, G, N], all float32 ->
    y [T, H, P] float32.
    """
    lib = library()
    heads, head_dim, d_state = ssm_state.shape[1:]
    if lib is None or not _is_f32_cpu(x, dt, A, B, C, D) or not _is_float_cpu(ssm_state):
        return None
    if ssm_state.stride()[1:] != (head_dim * d_state, d_state, 1):
        return None
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    A, D = A.contiguous(), D.contiguous()
    pages, has, starts, lens = _spans(state_pages, has_initial_state, query_start_loc)
    y = torch.empty_like(x)
    lib.hkv_mamba2_scan(
        ssm_state.data_ptr(), ssm_state.stride(0), _is_bf16(ssm_state), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads, head_dim,
        d_state, B.shape[1], x.data_ptr(), heads * head_dim, dt.data_ptr(), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), B.shape[1] * d_state, D.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return y


GDN_DTYPES = (torch.float32, torch.bfloat16)  # of q, k, v and of the state


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with each token's heads contiguous (a view when they are): the rows the
    gated delta rule kernels read at a token stride."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def float32_output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`out`, or a new float32 tensor of `shape` when None; None when `out` does not fit."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    fits = out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
    return out if fits else None


def gdn_dims(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, int, int, int, int] | None:
    """(T, Hk, Hv, K, V) when the gated delta rule's arguments agree as every native kernel of
    the rule needs (shapes below, CPU tensors, each state page contiguous, every page and token
    span inside the tensors); None otherwise. Dtypes are each kernel's own check.

    q, k: [T, Hk, K]; v: [T, Hv, V] (Hk divides Hv); g, beta: [T, Hv]; state:
    [num_pages, Hv, K, V]; state_pages, has_initial_state: [S]; query_start_loc: [S + 1].
    """
    if q.dim() != 3 or v.dim() != 3 or q.shape != k.shape:
        return None
    if any(t.device.type != "cpu" for t in (q, k, v, g, beta, state)):
        return None
    tokens, heads_k, dim_k = q.shape
    heads_v, dim_v = v.shape[1:]
    if v.shape[0] != tokens or heads_k == 0 or heads_v % heads_k:
        return None
    if g.shape != (tokens, heads_v) or beta.shape != g.shape:
        return None
    if state.shape[1:] != (heads_v, dim_k, dim_v):
        return None
    if state.stride()[1:] != (dim_k * dim_v, dim_v, 1):
        return None
    if not _spans_inside(state_pages, has_initial_state, query_start_loc, state.shape[0], tokens):
        return None  # (pages and tokens must lie inside the state, q, k, v and o)
    return tokens, heads_k, heads_v, dim_k, dim_v


@dataclass(frozen=True)
class GDNArgs:
    """The arguments that the rule's kernels (hkv_gated_delta_rule, hkv_gdn_decode,
    hkv_gdn_chunk) take first, in their order: `leading()`. It holds the tensors whose
    pointers it passes, so they live as long as the call's arguments are in use."""

    state: torch.Tensor
    spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    dims: tuple[int, int, int, int, int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def prepare(
        cls,
        dims: tuple[int, int, int, int, int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        state_pages: torch.Tensor,
        has_initial_state: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> GDNArgs:
        """`gdn_dims`' checked arguments in the forms the kernels read: q, k, v heads
        contiguous per token, g and beta float32 contiguous, the spans as int64 arrays."""
        spans = _spans(state_pages, has_initial_state, query_start_loc)
        g, beta = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
        return cls(state, spans, dims, head_rows(q), head_rows(k), head_rows(v), g, beta)

    def leading(self) -> tuple[Any, ...]:
        pages, has, starts, lens = self.spans
        _, heads_k, heads_v, dim_k, dim_v = self.dims
        q, k, v, state = self.q, self.k, self.v, self.state
        return (
            state.data_ptr(), state.stride(0), _is_bf16(state), pages.data_ptr(), has.data_ptr(),
            starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads_k, heads_v, dim_k, dim_v,
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            _is_bf16(q), self.g.data_ptr(), self.beta.data_ptr(),
        )  # fmt: skip


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> torch.Tensor | None:
    """The gated delta rule of packed requests natively (prefill chunks and decode steps, token
    by token, each state read and written once in its page; `ops.gated_delta` is the reference);
    None when the kernels or these tensors are not supported.

    q, k: [T, Hk, K] raw (normalised in the kernel); v: [T, Hv, V]; q, k, v all float32 or all
    bfloat16 (token rows may be strided); g, beta: [T, Hv] (float32); state:
    [num_pages, Hv, K, V] float32 or bfloat16 (a page-strided view, each page contiguous);
    state_pages, has_initial_state: [S]; query_start_loc: [S + 1] -> o [T, Hv, V] float32.
    """
    lib = library()
    if lib is None or not q.dtype == k.dtype == v.dtype:
        return None
    if q.dtype not in GDN_DTYPES or state.dtype not in GDN_DTYPES:
        return None
    spans = (state_pages, has_initial_state, query_start_loc)
    dims = gdn_dims(q, k, v, g, beta, state, *spans)
    if dims is None:
        return None
    tokens, _, heads_v, _, dim_v = dims
    o = torch.empty(tokens, heads_v, dim_v, dtype=torch.float32)
    args = GDNArgs.prepare(dims, q, k, v, g, beta, state, *spans)
    if tokens == 0 or args.spans[0].numel() == 0:
        return o
    failed = torch.zeros(1, dtype=torch.int32)
    lib.hkv_gated_delta_rule(*args.leading(), o.data_ptr(), failed.data_ptr())
    if int(failed):
        raise MemoryError("the native gated delta rule could not allocate its work space")
    return o


MAMBA1_DTYPES = (torch.float32, torch.bfloat16)  # of x, dt, z, B, C and of the state


def _unit_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t: [T, k] in `dtype` with unit column stride (a view when it already is)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _f32_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else derived(t, "f32", _contiguous_f32)


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> torch.Tensor | None:
    """The Mamba1 scan of packed requests natively (prefill chunks and decode steps, token by
    token, each state read and written once in its page; `ops.mamba1.mamba1_scan_varlen` is the
    reference, with the same arguments); None when the kernels or these tensors are not
    supported.

    x, dt (raw), z: [T, Di] and B, C: [T, N], float32 or bfloat16 (all as x; rows may be
    strided); A: [Di, N]; D, dt_bias: [Di] or None; ssm_state: [num_pages, Di, N] float32 or
    bfloat16 (a page-strided view, each page contiguous); state_pages, has_initial_state: [S];
    query_start_loc: [S + 1] -> y [T, Di] float32.
    """
    lib = library()
    if lib is None or x.dim() != 2 or x.dtype not in MAMBA1_DTYPES:
        return None
    tensors = [x, dt, A, B, C, ssm_state] + [t for t in (D, z, dt_bias) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or ssm_state.dtype not in MAMBA1_DTYPES:
        return None
    tokens, channels = x.shape
    d_state = A.shape[-1]
    if dt.shape != x.shape or (z is not None and z.shape != x.shape):
        return None
    if A.shape != (channels, d_state) or B.shape != (tokens, d_state) or C.shape != B.shape:
        return None
    if any(t is not None and t.shape != (channels,) for t in (D, dt_bias)):
        return None  # (a vector of another size would be read out of bounds)
    if ssm_state.shape[1:] != (channels, d_state) or ssm_state.stride()[1:] != (d_state, 1):
        return None
    if not _spans_inside(
        state_pages, has_initial_state, query_start_loc, ssm_state.shape[0], tokens
    ):
        return None  # (pages and tokens must lie inside the state, x and y)
    pages, has, starts, lens = _spans(state_pages, has_initial_state, query_start_loc)
    # y: rows outside every request stay zero (none when the requests cover the step's tokens)
    covered = _spans_cover(state_pages, has_initial_state, query_start_loc, tokens)
    y = (torch.empty if covered else torch.zeros)(tokens, channels, dtype=torch.float32)
    if tokens == 0 or pages.numel() == 0 or channels == 0:
        return y
    dtype = x.dtype
    x, dt, B, C = (_unit_rows(t, dtype) for t in (x, dt, B, C))
    z = None if z is None else _unit_rows(z, dtype)
    A, D, dt_bias = A.to(torch.float32).contiguous(), _f32_or_none(D), _f32_or_none(dt_bias)
    failed = lib.hkv_mamba1_scan(
        ssm_state.data_ptr(), ssm_state.stride(0), int(ssm_state.dtype == torch.bfloat16),
        pages.data_ptr(), has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0],
        channels, d_state, x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0),
        None if z is None else z.data_ptr(), 0 if z is None else z.stride(0), B.data_ptr(),
        B.stride(0), C.data_ptr(), C.stride(0), int(dtype == torch.bfloat16), A.data_ptr(),
        None if D is None else D.data_ptr(), None if dt_bias is None else dt_bias.data_ptr(),
        y.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native Mamba1 scan could not allocate its work space")
    return y


CONV_MAX_HISTORY = 8  # HKV_CONV_MAX_HISTORY in kernels.c


def conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    silu: bool = False,
    round_bf16: bool = False,
) -> torch.Tensor | None:
    """Causal conv1d of packed requests (prefill chunks and decode steps) natively, through silu
    when `silu` (else no activation), its float32 results rounded to bfloat16 values when
    `round_bf16`; None when the kernels or these tensors are not supported.

    x: [T, C] (rows may be strided; float32 or bfloat16, read in place); weight: [C, K]; bias:
    [C] or None; conv_state:
    [num_pages, C, K - 1] float32 or bfloat16 (page-strided, each page contiguous); state_pages,
    has_initial_state: [S]; query_start_loc: [S + 1] -> y [T, C] float32.
    """
    lib = library()
    tensors = (x, weight, conv_state) + (() if bias is None else (bias,))
    if lib is None or not _is_float_cpu(*tensors) or x.dim() != 2:
        return None
    channels, width = weight.shape
    if width - 1 > CONV_MAX_HISTORY or conv_state.stride()[1:] != (width - 1, 1):
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()  # rows may be strided; float32 or bfloat16 rows are read in place
    # [K, C]: a tap's weights contiguous across channels (kept with the weight)
    wt = derived(weight, "conv_taps_f32", lambda w: w.t().float().contiguous())
    bias = None if bias is None else derived(bias, "f32", _contiguous_f32)
    pages, has, starts, lens = _spans(state_pages, has_initial_state, query_start_loc)
    y = torch.empty(x.shape, dtype=torch.float32)
    failed = lib.hkv_conv1d(
        conv_state.data_ptr(), conv_state.stride(0), _is_bf16(conv_state), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], channels, width,
        x.data_ptr(), x.stride(0), _is_bf16(x), wt.data_ptr(),
        None if bias is None else bias.data_ptr(), int(silu), int(round_bf16), y.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native conv1d could not allocate its work space")
    return y


def mamba2_mix(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    scan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[float, float]],
    norm: tuple[torch.Tensor, int, float, bool, bool],
    n_groups: int,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """A whole Mamba2 mixer between its projections in one native call (hkv_mamba2_mix: conv,
    dt, scan, gated norm; states in place); None when not supported.

    zxbcdt: [T, I + conv_dim + H] in_proj output (float32 or bfloat16, unit column stride);
    conv_weight: [conv_dim, K]; conv_state: [num_pages, conv_dim, K - 1]; ssm_state: [num_pages,
    H, P, N] (each float32 or bfloat16, pages contiguous); scan: (A, D, dt_bias, dt_limit) with
    [H] tensors; norm: (weight [I], group_size, eps, norm_before_gate, weight_in_fp32)
    -> [T, I] in out_dtype (a bf16 model's conv results rounded to bf16 values, as its conv).
    """
    lib = library()
    if lib is None or zxbcdt.dim() != 2 or zxbcdt.stride(1) != 1 or out_dtype not in FLOAT_DTYPES:
        return None
    tensors = (zxbcdt, conv_weight, conv_state, ssm_state)
    if not _is_float_cpu(*tensors) or (conv_bias is not None and not _is_float_cpu(conv_bias)):
        return None
    _, heads, head_dim, d_state = ssm_state.shape
    (conv_dim, width), inner = conv_weight.shape, heads * head_dim
    A, D, dt_bias, (dt_min, dt_max) = scan
    weight, group_size, eps, norm_before_gate, weight_in_fp32 = norm
    if zxbcdt.shape[1] != inner + conv_dim + heads or conv_dim != inner + 2 * n_groups * d_state:
        return None
    if width - 1 > CONV_MAX_HISTORY or conv_state.stride()[1:] != (width - 1, 1):
        return None
    if ssm_state.stride()[1:] != (head_dim * d_state, d_state, 1) or inner % group_size:
        return None
    if weight.numel() != inner or any(t.numel() != heads for t in (A, D, dt_bias)):
        return None
    f32 = [derived(t, "f32", _contiguous_f32) for t in (A, D, dt_bias, weight)]
    wt = derived(conv_weight, "conv_taps_f32", lambda w: w.t().float().contiguous())
    bias = None if conv_bias is None else derived(conv_bias, "f32", _contiguous_f32)
    pages, has, starts, lens = _spans(state_pages, has_initial_state, query_start_loc)
    tokens = zxbcdt.shape[0]
    out = torch.empty(tokens, inner, dtype=out_dtype)
    failed = lib.hkv_mamba2_mix(
        zxbcdt.data_ptr(), _is_bf16(zxbcdt), zxbcdt.stride(0), conv_state.data_ptr(),
        conv_state.stride(0), _is_bf16(conv_state), wt.data_ptr(),
        None if bias is None else bias.data_ptr(), width, _is_bf16(zxbcdt), ssm_state.data_ptr(),
        ssm_state.stride(0), _is_bf16(ssm_state), pages.data_ptr(), has.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), pages.shape[0], tokens, heads, head_dim, d_state,
        n_groups, f32[0].data_ptr(), f32[1].data_ptr(), f32[2].data_ptr(), dt_min, dt_max,
        f32[3].data_ptr(), group_size, eps, int(norm_before_gate), int(weight_in_fp32),
        out.data_ptr(), _is_bf16(out),
    )  # fmt: skip
    return None if failed else out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """`ops.attention.write_kv_cache` in one pass: k, v [T, kv_heads, head_dim] (each token's
    heads contiguous, tokens at any stride) of the cache's dtype (float32 or bfloat16);
    kv_cache [num_kernel_blocks, 2, kbs, kv_heads, head_dim] contiguous; slot_mapping [T]
    int64. False (nothing written) when not supported."""
    lib = library()
    if lib is None or k.dtype not in FLOAT_DTYPES or not k.dtype == v.dtype == kv_cache.dtype:
        return False
    if k.device.type != "cpu" or v.device.type != "cpu" or kv_cache.device.type != "cpu":
        return False
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != kv_cache.shape[3:]:
        return False
    heads, dim = k.shape[1:]
    if k.stride()[1:] != (dim, 1) or v.stride()[1:] != (dim, 1) or not kv_cache.is_contiguous():
        return False
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        return False
    slots = slot_mapping.contiguous()
    kbs = kv_cache.shape[2]
    lib.hkv_write_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(),
        slots.data_ptr(), k.shape[0], kbs, heads * dim, k.element_size(),
        kv_cache.shape[0] * kbs,
    )  # fmt: skip
    return True


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode attention natively: None when the kernels or these tensors are not supported.
    sinks: [heads] float32 or None (a per-head logit in every softmax denominator, gpt-oss).

    q: [S, heads, d]; kv_cache: [num_kernel_blocks, 2, kbs, kv_heads, d] contiguous, of q's
    dtype (float32 or bfloat16; float32 math either way); block_table: [S, max_blocks] int32;
    seq_lens: [S] -> [S, heads, d] in q's dtype.
    """
    lib = library()
    if lib is None or not _is_float_cpu(q) or q.dtype != kv_cache.dtype:
        return None
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        return None
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        return None
    num_seqs, num_heads, head_dim = q.shape
    kbs, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if seq_lens.shape != (num_seqs,) or block_table.shape[0] != num_seqs:
        return None
    lens = seq_lens.to(torch.int32).contiguous()  # (the step's own int32 lengths: a view)
    window = 0 if sliding_window is None else int(sliding_window)
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    sink = None if sinks is None else derived(sinks, "f32", _contiguous_f32)
    lib.hkv_paged_decode(
        q.data_ptr(), kv_cache.data_ptr(), _is_bf16(q), kbs, kv_heads, head_dim, num_heads,
        block_table.data_ptr(), block_table.stride(0), lens.data_ptr(), window, num_seqs, scale,
        None if sink is None else sink.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride (a view when possible), None unless float32 or
    bfloat16."""
    if x.dtype not in FLOAT_DTYPES or x.device.type != "cpu":
        return None
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_weight(x: torch.Tensor, weight: torch.Tensor, cols: int) -> torch.Tensor | None:
    """The norm weight a row kernel takes for x, cols long, else None: float32 (a float32
    weight, or a bfloat16 one widened exactly: float32 rows times a bfloat16 weight are float32
    products in PyTorch too); for bfloat16 rows also a float32 weight such as a zero-centred
    norm's 1 + weight."""
    if weight.device.type != "cpu" or weight.numel() != cols:
        return None
    if x.dtype == torch.bfloat16 and weight.dtype in FLOAT_DTYPES:
        return derived(weight, "f32", _contiguous_f32)
    if x.dtype == torch.float32 and weight.dtype == torch.bfloat16:
        # (float32 rows, a bfloat16 model's weight: the product is float32 either way)
        return derived(weight, "f32", _contiguous_f32)
    return weight.contiguous() if weight.dtype == x.dtype else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension of float32 or bfloat16 x (and
    weight of its dtype), in one pass; bfloat16 rounds where `ops.norm.rms_norm` does, which
    `weight_in_fp32` decides. None when not supported."""
    lib, rows = library(), _rows(x)
    if lib is None or rows is None:
        return None
    w = _row_weight(x, weight, rows.shape[1])
    if w is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    args = (rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), *rows.shape, eps)
    if x.dtype == torch.bfloat16:
        lib.hkv_rms_norm_bf16(*args, int(weight_in_fp32))
    else:
        lib.hkv_rms_norm_f32(*args)
    return out if x.dim() == 2 else out.reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    multiplier: float,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + multiplier * h, its rms_norm) for float32 or bfloat16 x, h of one shape and dtype,
    in one pass; None when not supported."""
    lib = library()
    if lib is None or not _is_float_cpu(x) or x.shape != h.shape or h.dtype != x.dtype:
        return None
    cols = x.shape[-1]
    w = _row_weight(x, weight, cols)
    if w is None or h.device.type != "cpu":
        return None
    x, h = x.contiguous(), h.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    args = (
        x.data_ptr(), h.data_ptr(), multiplier, w.data_ptr(), total.data_ptr(), out.data_ptr(),
        x.numel() // max(cols, 1), cols, eps,
    )  # fmt: skip
    if x.dtype == torch.bfloat16:
        lib.hkv_add_rms_norm_bf16(*args, int(weight_in_fp32))
    else:
        lib.hkv_add_rms_norm_f32(*args)
    return total, out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """[..., 2I] = [gate | up] -> silu(gate) * up: [..., I] for float32 or bfloat16 x
    (bfloat16: silu rounded before the product, as PyTorch); None when not supported."""
    rows = _rows(x)
    if rows is None or x.shape[-1] % 2:
        return None
    inter = x.shape[-1] // 2
    out = _silu_mul_rows(rows[:, :inter], rows[:, inter:])
    return out if out is None or x.dim() == 2 else out.reshape(*x.shape[:-1], inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for float32 or bfloat16 gate and up of one shape and dtype (separate
    gate and up projections), rounded as PyTorch's `F.silu(gate) * up`; None when not
    supported."""
    g, u = _rows(gate), _rows(up)
    if g is None or u is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    out = _silu_mul_rows(g, u)
    return out if out is None or gate.dim() == 2 else out.reshape(gate.shape)


def _silu_mul_rows(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """g, u: [rows, I] with unit column stride, any row stride -> silu(g) * u [rows, I]."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(g.shape, dtype=g.dtype)
    kernel = lib.hkv_silu_mul_bf16 if g.dtype == torch.bfloat16 else lib.hkv_silu_mul_f32
    kernel(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), *g.shape)
    return out


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor | None:
    """The rotary embedding of `layers.rotary._rotate` in one pass: x [T, H, D] (channels
    contiguous, tokens and heads at any stride), cos, sin [T, rotary_dim] of x's dtype (float32
    or bfloat16) -> [T, H, D] contiguous; None when not supported."""
    lib = library()
    if lib is None or x.dim() != 3 or not _is_float_cpu(x) or x.stride(2) != 1:
        return None
    tokens, heads, dim = x.shape
    if rotary_dim % 2 or not 0 < rotary_dim <= dim or tokens == 0:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != (tokens, rotary_dim):
        return None
    if sin.shape != cos.shape or cos.device.type != "cpu" or sin.device.type != "cpu":
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.hkv_rope(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        _is_bf16(x), tokens, heads, dim, rotary_dim,
    )  # fmt: skip
    return out


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The Mamba2 gated, grouped RMSNorm (ops.norm.gated_rms_norm) in one pass, x, gate and the
    result (`out_dtype`, default x's) each float32 or bfloat16; None when not supported.
    x, gate: [..., C] (gate rows may be strided)."""
    lib, rows, gates = library(), _rows(x), _rows(gate)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if lib is None or rows is None or gates is None or out_dtype not in FLOAT_DTYPES:
        return None
    channels = rows.shape[1]
    if gates.shape != rows.shape or channels % group_size:
        return None
    if weight.device.type != "cpu" or weight.numel() != channels:
        return None  # (a weight of another size would be read past)
    if weight.dtype not in FLOAT_DTYPES:
        return None
    w = derived(weight, "f32", _contiguous_f32)  # both kernels take a float32 weight
    rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype)
    if x.dtype == gate.dtype == out_dtype == torch.float32:
        lib.hkv_gated_rms_norm_f32(
            rows.data_ptr(), gates.data_ptr(), gates.stride(0), w.data_ptr(), out.data_ptr(),
            rows.shape[0], channels, group_size, eps, int(norm_before_gate),
        )  # fmt: skip
    else:
        lib.hkv_gated_rms_norm_mixed(
            rows.data_ptr(), _is_bf16(x), gates.data_ptr(), _is_bf16(gate), gates.stride(0),
            w.data_ptr(), out.data_ptr(), _is_bf16(out), rows.shape[0], channels, group_size,
            eps, int(norm_before_gate), int(weight_in_fp32),
        )  # fmt: skip
    return out.reshape(x.shape)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of a float32 [rows, cols] x (ties: the first index; a row with
    NaN: its first NaN), vectorised and in parallel; None when not supported."""
    lib = library()
    if lib is None or x.dim() != 2 or not _is_f32_cpu(x) or x.shape[1] == 0:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.hkv_argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
