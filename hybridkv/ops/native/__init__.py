"""Native CPU kernels (the C files of this folder), compiled at first use and called through ctypes.

This module is the loader: it builds every C file of the folder into one library, keyed and
cached (`library()`), declares each kernel's ctypes signature (`declare`, `returns_status`),
generates the replay adapters from those signatures (`program.py` replays recorded calls) and
wraps each kernel as a `Kernel` that a recording tape sees. The Python wrappers live in one
module per family, beside their C files, each declaring its own kernels when imported
(`library()` imports every module of the folder before it builds):

- `common.py`: the argument checks every family shares (float dtypes, rows, bf16 flags);
- `spans.py`: a step's per-request span arrays that every state kernel takes;
- `ssm.py`: Mamba2 scan and mixer, Mamba1 scan, causal conv1d (`kernels.c`);
- `gdn.py`: the gated delta rule (`kernels.c`) and the checks its other kernels share;
  `gdn_decode.py`, `gdn_chunk.py`, `gdn_prep.py`: its decode step, chunked prefill and the
  projections' preparation; `kda.py`: Kimi Delta Attention;
- `decode_attention.py`: paged decode attention and the KV cache write; `mla.py`: MLA;
- `norms.py`: RMSNorm, add + RMSNorm, gated RMSNorm (`kernels.c`);
- `elementwise.py`: embedding, residual add, rotary (cos/sin and the rotation), activations
  (silu * up, gelu * up, relu2), casts, float32 logits, argmax (`elementwise.c`, `kernels.c`);
- `f32_linear.py`, `bf16_linear.py`, `int8_linear.py`, `small_linear.py`: the linear layers;
  `moe.py`: the MoE experts;
- `program.py`: recording kernel calls and replaying them; `cpu.py`: the CPU record.

Build: `gcc -O3 -march=native -fopenmp -shared` (`HYBRIDKV_NATIVE_MARCH=x86-64-v3` for another
target) into `$XDG_CACHE_HOME/hybridkv` (default
`~/.cache/hybridkv`), keyed by the source, the compiler flags and the CPU's flags, so a cache
shared between machines never loads a build for another CPU. Built once: each C file compiled
at the same time (a job per CPU: 9 s on the 2-core Xeon instead of 17; the largest file alone
takes 3 s); processes starting together wait for one build (a lock beside it). No compiler,
a failed build, a tensor of a dtype the kernel does not take (float32 and bfloat16; the Mamba2
scan's other inputs float32 only), or `HYBRIDKV_NATIVE=0` in the environment: the callers
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# every C file of this folder is compiled into one library (the helpers they share are in
# hkv_common.h); the wrapper modules declare their kernels with `declare`
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
# argument types of each declared kernel in the C order (`declare`), by name
_SIGNATURES: dict[str, list] = {}
# kernels that return a status (non-zero: failed; `returns_status`); the others return nothing
_RESTYPES: dict[str, Any] = {}


def declare(signatures: dict[str, list]) -> None:
    """Add the argument types of kernels of this folder's C files (called when the module
    that wraps them is imported; `library()` imports every module of this folder before
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


def compile_library(compiler: str, flags: list[str], files: list[Path], out: Path) -> str:
    """Compile each C file to an object at once (a job per CPU: the files are independent, the
    largest is ~3 s of a ~15 s one-command build) and link them into `out`; returns the
    compiler's messages, raises `subprocess.CalledProcessError` (with them) on a failure."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = max(1, min(len(files), cpus or 1))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{i}-{f.stem}.o" for i, f in enumerate(files)]

        def run(cmd: list[str]) -> str:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
            return done.stderr

        def compile_one(source: Path, obj: Path) -> str:
            return run([compiler, *flags, "-c", str(source), "-o", str(obj)])

        with ThreadPoolExecutor(jobs) as pool:
            messages = list(pool.map(compile_one, files, objects))
        messages.append(run([compiler, *flags, *map(str, objects), "-o", str(out), "-lm"]))
    return "".join(messages)


def _build(target: Path, adapters: str) -> bool:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None or not sys.platform.startswith("linux"):
        return False
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    # one builder per build: processes that start together (test workers, tensor-parallel
    # ranks) wait for it and load its file instead of each compiling the same sources
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return True
        # build beside the target, then rename: a reader never loads a partial file
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            generated, partial = Path(tmp) / "adapters.c", Path(tmp) / "partial.so"
            generated.write_text(adapters)
            try:
                compile_library(compiler, CFLAGS, [*sources(), generated], partial)
                partial.replace(target)
                return True
            except (OSError, subprocess.SubprocessError) as exc:
                said = getattr(exc, "stderr", None) or str(exc)
                warnings.warn(
                    f"hybridkv: building the native kernels with {compiler} failed "
                    f"({said.strip().splitlines()[-1] if said.strip() else exc}); running the "
                    "PyTorch ops",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return False


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
