"""The CPU record (hybridkv/ops/native/cpu.py, cpu.c): built and present instruction sets."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridkv.ops import native
from hybridkv.ops.native import cpu


def test_record_names_known_features_and_prints_one_line() -> None:
    rec = cpu.record()
    assert rec.built <= set(cpu.FEATURES) and rec.has <= set(cpu.FEATURES)
    line = rec.line()
    assert "\n" not in line and line.startswith("CPU: ")
    assert f"torch: {rec.torch_isa}" in line
    for name in rec.usable:
        assert rec.supports(name) and name in line


def test_the_c_probe_agrees_with_proc_cpuinfo() -> None:
    rec = cpu.record()
    if not rec.native_loaded:
        pytest.skip("no native library here (HYBRIDKV_NATIVE=0 or no compiler)")
    _, proc = cpu._proc_cpuinfo()
    if not proc:
        pytest.skip("no /proc/cpuinfo flags")
    assert rec.has == proc


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_a_forced_build_target_records_only_its_instruction_sets(march: str) -> None:
    """What an AVX2 (x86-64-v3) or baseline (x86-64) machine runs, built on this one."""
    if not cpu.record().native_loaded or "avx2" not in cpu.record().has:
        pytest.skip("needs the native library on an x86-64 CPU with AVX2")
    env = dict(os.environ, HYBRIDKV_NATIVE_MARCH=march)
    code = "from hybridkv.ops.native import cpu; print(sorted(cpu.record().built))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    built = eval(out)  # a printed list of names
    assert built == (["avx2"] if march == "x86-64-v3" else [])


class _Probe:
    """Stands in for a ctypes probe function (takes argtypes / restype, returns bytes)."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def __call__(self) -> bytes:
        return self.value


def _fake_library(built: bytes, has: bytes) -> SimpleNamespace:
    probes = SimpleNamespace(hkv_cpu_built=_Probe(built), hkv_cpu_has=_Probe(has))
    return SimpleNamespace(cdll=probes)


def test_a_build_for_instructions_the_cpu_lacks_is_refused() -> None:
    with pytest.warns(RuntimeWarning, match="avx512"):
        assert not native._runs_here(_fake_library(b"avx2,avx512", b"avx2"))
    assert native._runs_here(_fake_library(b"avx2", b"avx2,avx512"))
