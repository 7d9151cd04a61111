"""The native library on aarch64: cross-compiled with the sources and generated replay adapters
this machine builds (for ARMv8.2 with the dot product, and for ARMv8.0), then checked by an
aarch64 Python under qemu-user against NumPy references (tests/ops/aarch64_checks.py: the CPU
record, norms, activations, the conv, the Mamba2 scan, the gated delta rule with per-position
states, paged decode attention, the w8a8 linear's NEON kernels bit for bit).

It needs a cross compiler, qemu-user and an arm64 tree with python3 and NumPy
(HYBRIDKV_ARM64_ROOT, default /opt/arm64), which CI machines do not have; set-up on Debian:

    apt-get install crossbuild-essential-arm64 qemu-user debootstrap
    debootstrap --arch=arm64 --foreign --variant=minbase \\
        --include=python3-minimal,python3-numpy,libgomp1 bookworm /opt/arm64
    cd /opt/arm64/var/cache/apt/archives && for d in *.deb; do dpkg-deb -x $d /opt/arm64; done
    cd /opt/arm64/usr/lib/aarch64-linux-gnu && ln -sf blas/libblas.so.3 . \\
        && ln -sf lapack/liblapack.so.3 .

The same checks also run here on this machine's own build (so their references are checked
wherever the suite runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.ops import native
from tests.ops.test_native import needs_compiler

CHECKS = Path(__file__).with_name("aarch64_checks.py")
ARM64_ROOT = Path(os.environ.get("HYBRIDKV_ARM64_ROOT", "/opt/arm64"))
CROSS_CC = "aarch64-linux-gnu-gcc"
# -march -> what the CPU record must say the build has: a common server target (Graviton 2,
# Ampere Altra, Neoverse N1: dot product, no SVE), and ARMv8.0 (Cortex-A72, Graviton 1: no dot
# product, so the w8a8 linear's plain NEON kernel runs alone there)
ARM_MARCHES = {"armv8.2-a+dotprod": ("neon", "neon_dot"), "armv8-a": ("neon",)}


def _adapters() -> str:
    """The replay adapters' C source this machine's build compiles in (program.c needs them)."""
    native._declare_all()
    return native._adapters_source(sorted(native._SIGNATURES))


@needs_compiler
def test_checks_pass_on_this_machines_build():
    lib = native.library()
    if lib is None:
        pytest.skip("the native library does not build here")
    done = subprocess.run(
        [sys.executable, str(CHECKS), lib.cdll._name], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout


@pytest.mark.parametrize("march", list(ARM_MARCHES))
def test_the_library_builds_and_runs_on_aarch64(tmp_path, march):
    python = ARM64_ROOT / "usr/bin/python3"
    if shutil.which(CROSS_CC) is None or shutil.which("qemu-aarch64") is None:
        pytest.skip(f"needs {CROSS_CC} and qemu-aarch64 (module docstring)")
    if not python.is_file():
        pytest.skip(f"needs an arm64 tree with python3 and NumPy at {ARM64_ROOT} (docstring)")
    adapters = tmp_path / "adapters.c"
    adapters.write_text(_adapters())
    library = tmp_path / "libhkv-aarch64.so"
    flags = [f if not f.startswith("-march=") else f"-march={march}" for f in native.CFLAGS]
    try:
        messages = native.compile_library(CROSS_CC, flags, [*native.sources(), adapters], library)
    except subprocess.CalledProcessError as err:
        raise AssertionError(err.stderr[-4000:]) from None
    assert "warning" not in messages, messages[-4000:]
    done = subprocess.run(
        ["qemu-aarch64", "-L", str(ARM64_ROOT), str(python), str(CHECKS), str(library),
         *ARM_MARCHES[march]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout
