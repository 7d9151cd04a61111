"""The CPU record: what the native library was built for, what this CPU has, and what PyTorch
runs on it, in one place (`cpu.c` is the C half; every C file of this folder tests the HKV_*
macros of `hkv_common.h`, never the compiler's own).

Ops choose their implementations from this record once (`hybridkv.ops.registry`); `hybridkv
plan`, `hybridkv bench` and the engine's start-up log print its `line()`, as llama.cpp prints its
system info:

    CPU: Intel(R) Xeon(R) Processor | 2 threads | native x86-64 (march=native): avx2 avx_vnni
    avx512 avx512_bf16 avx512_vnni amx_bf16 amx_int8 | torch: AVX512, oneDNN bf16 yes
"""

from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.ops import native

# the names of cpu.c, in its order
FEATURES = (
    "avx2", "avx_vnni", "avx512", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8",
    "neon", "neon_dot", "neon_bf16",
)  # fmt: skip

# /proc/cpuinfo flags -> a feature of FEATURES (every flag listed must be present)
_PROC_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx_vnni": ("avx_vnni", "avx2"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512f"),
    "avx512_vnni": ("avx512_vnni", "avx512f"),
    "amx_bf16": ("amx_bf16", "amx_tile"),
    "amx_int8": ("amx_int8", "amx_tile"),
    "neon": ("asimd",),
    "neon_dot": ("asimddp",),
    "neon_bf16": ("bf16",),
}


@dataclass(frozen=True)
class CpuRecord:
    """One machine's facts for choosing ops. `built`: the instruction sets the native library
    was compiled for (empty without a library); `has`: those the CPU and OS provide; `usable`:
    both (what native kernels may run); `torch_isa`: ATen's vector level (DEFAULT, AVX2,
    AVX512, ...); `onednn_bf16`: oneDNN has bfloat16 kernels here (AVX-512 or AMX)."""

    model: str
    machine: str
    march: str
    native_loaded: bool
    built: frozenset[str]
    has: frozenset[str]
    torch_isa: str
    onednn_bf16: bool
    num_threads: int

    @property
    def usable(self) -> frozenset[str]:
        return self.built & self.has

    def supports(self, *features: str) -> bool:
        """The native library was built with every one of `features` and the CPU has them."""
        return self.native_loaded and all(f in self.usable for f in features)

    def line(self) -> str:
        """One line for logs and reports."""
        names = " ".join(f for f in FEATURES if f in self.usable) or "portable C"
        lib = f"native {self.machine} (march={self.march}): {names}"
        if not self.native_loaded:
            lib = "native kernels off (HYBRIDKV_NATIVE=0, no compiler or a failed build)"
        missing = sorted(self.has - self.built, key=FEATURES.index)
        if self.native_loaded and missing:
            lib += f" [CPU also has {' '.join(missing)}, not built]"
        bf16 = "yes" if self.onednn_bf16 else "no"
        return (
            f"CPU: {self.model} | {self.num_threads} threads | {lib} | "
            f"torch: {self.torch_isa}, oneDNN bf16 {bf16}"
        )


def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    has = {name for name, need in _PROC_FLAGS.items() if all(f in flags for f in need)}
    return model, frozenset(has)


def _names(fn: ctypes._CFuncPtr) -> frozenset[str]:
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    value = fn() or b""
    return frozenset(n for n in value.decode().split(",") if n)


def _torch_isa() -> str:
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"


def _onednn_bf16() -> bool:
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=1)
def record() -> CpuRecord:
    """This process's CPU record (computed once; it builds the native library if needed)."""
    model, proc_has = _proc_cpuinfo()
    lib = native.library()
    if lib is not None:
        built, has = _names(lib.hkv_cpu_built), _names(lib.hkv_cpu_has)
    else:
        built, has = frozenset(), proc_has
    return CpuRecord(
        model=model,
        machine=platform.machine(),
        march=native.MARCH,
        native_loaded=lib is not None,
        built=built,
        has=has,
        torch_isa=_torch_isa(),
        onednn_bf16=_onednn_bf16(),
        num_threads=torch.get_num_threads(),
    )


def line() -> str:
    return record().line()
