"""Compile hybridkv's Triton kernels for GPUs without one and report their resources.

    python benchmarks/triton_compile_report.py                   # Hopper (sm_90a) and MI300
    python benchmarks/triton_compile_report.py --target sm_90a   # one target (or gfx942)
    python benchmarks/triton_compile_report.py --check           # also exit 1 if a kernel
                                                                 # spills more than a few words
                                                                 # or overflows shared memory
    python benchmarks/triton_compile_report.py --quick           # kernel blocks of 16 and 128
                                                                 # only (and the corner cases)

Triton lowers each kernel for a target named here; no device is asked. For NVIDIA sm_90a (H100,
H200) the ptxas that Triton itself uses assembles the PTX with `-v`, which prints registers per
thread and spill bytes. For AMD gfx942 (MI300) Triton's own LLVM emits the AMDGCN assembly, whose
metadata holds VGPRs, scratch (spill) bytes and occupancy. The configurations are those of
benchmarks/gpu_attention.py (bf16, head dim 128, 32 query heads over 8 kv heads) for every kernel
block size it times, plus the corner cases the tests use: a window, a 2096-token kernel block, a
group of 8, split-K decode, logit soft-capping. Arguments are specialised as a launch
specialises them (16-byte aligned pointers and strides, unit innermost strides), so the code is
the one a GPU would run.

What it cannot tell: time. Registers, spills, shared memory and the instruction mix are static
facts; bandwidth needs benchmarks/gpu_attention.py on a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret (read at kernel import)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default launches use
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hybridkv.ops import triton_attention as T  # noqa: E402


@dataclass(frozen=True)
class Target:
    gpu: GPUTarget
    shared_limit: int  # bytes of shared memory (LDS) one block may use


TARGETS = {
    "sm_90a": Target(GPUTarget("cuda", 90, 32), 227 * 1024),  # H100 / H200
    "gfx942": Target(GPUTarget("hip", "gfx942", 64), 64 * 1024),  # MI300X
}
# ptxas may park a few words on the stack by its own choice (Triton 3.9's ptxas 13.4 does for the
# decode kernel, 8 to 16 bytes; Triton 3.6's does not); a spilled accumulator would be kilobytes.
SPILL_LIMIT = 64
UNIT_STRIDES = {"stride_qd", "stride_od", "stride_cd"}  # contiguous head dims: launched as 1
FLOAT_ARGS = {"qk_scale", "softcap_log2"}  # scalar arguments launched as float32
# Integer arguments a launch at these shapes sees as multiples of 16 (Triton specialises on it):
# every stride that is not 1, and the page length in words.
ALIGNED_PREFIXES = ("stride_", "words_per_page")
POINTER_TYPES = {"block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "slot_ptr": "*i64",
                 "buf_ptr": "*i64", "page_ids_ptr": "*i64"}  # fmt: skip


@dataclass
class Report:
    name: str
    shared_bytes: int
    registers: int
    spill_bytes: int
    instructions: dict[str, int]  # memory and matrix instructions, by kind
    occupancy: int | None = None  # waves per SIMD (AMD); None where the assembler does not say


def compile_kernel(
    fn,
    constexprs: dict[str, object],
    target: Target,
    num_warps: int = 4,
    num_stages: int = 2,
    pointers: dict[str, str] | None = None,
    unit_strides: set[str] = UNIT_STRIDES,
):
    """Lower `fn` for `target` with the specialisation a launch would give it. `pointers`
    overrides POINTER_TYPES (element types by argument name; others are bf16)."""
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    consts = dict(constexprs)
    types = {**POINTER_TYPES, **(pointers or {})}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in unit_strides:
            signature[name], consts[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
            if name.startswith(ALIGNED_PREFIXES):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=target.gpu, options=options)


def ptxas() -> str:
    """The ptxas Triton itself uses for sm_90 (its wheel carries two; which one varies)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def report(name: str, kernel, target: Target) -> Report:
    if target.gpu.backend == "cuda":
        return _report_nvidia(name, kernel)
    return _report_amd(name, kernel)


def _report_nvidia(name: str, kernel) -> Report:
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        args = [ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
        log = subprocess.run(args, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    kinds = Counter(
        m.split(".")[0] + ("." + m.split(".")[1] if m.startswith(("ld", "st", "cp")) else "")
        for m in re.findall(r"\b(cp\.async\.\w+|ld\.global|st\.global|mma\.sync|wgmma\.\w+)", ptx)
    )
    return Report(
        name,
        kernel.metadata.shared,
        int(regs.group(1)) if regs else -1,
        sum(map(int, spills.groups())) if spills else -1,
        dict(sorted(kinds.items())),
    )


def _report_amd(name: str, kernel) -> Report:
    asm = kernel.asm["amdgcn"]

    def field(key: str) -> int:
        m = re.search(rf"\.{key}:\s+(\d+)", asm)
        return int(m.group(1)) if m else -1

    occupancy = re.search(r"; Occupancy: (\d+)", asm)
    kinds = Counter(
        m.split("_")[0] + "_" + m.split("_")[1]
        for m in re.findall(
            r"\b(global_load\w*|buffer_load\w*|global_store\w*|buffer_store"
            r"\w*|ds_read\w*|ds_write\w*|v_mfma\w*)",
            asm,
        )  # fmt: skip
    )
    return Report(
        name,
        kernel.metadata.shared,
        field("vgpr_count"),
        field("private_segment_fixed_size"),  # scratch: where VGPRs spill to
        dict(sorted(kinds.items())),
        int(occupancy.group(1)) if occupancy else None,
    )


def attention_configs(
    quick: bool = False,
) -> list[tuple[str, dict[str, object], T.LaunchConfig]]:
    """(name, constexprs, launch) as paged_attention would launch them on a GPU; `quick`: the
    smallest and largest kernel block sizes timed, not those between (the same code with
    another power-of-two constant), and split-K decode only with soft-capping."""
    out = []

    def cfg(name, *, kbs, decode, group=4, splits=1, window=False, softcap=False):
        launch = T.default_launch(decode, group, 128, on_gpu=True)
        consts = dict(GROUP=group, GROUP_PAD=group, BLOCK_M=launch.block_m,
                      TILE_N=launch.tile_n, KBS=kbs, HEAD_DIM=128, HEAD_DIM_PAD=128,
                      NUM_SPLITS=splits, IS_DECODE=decode, USE_WINDOW=window, USE_SINKS=False,
                      USE_SOFTCAP=softcap, DOT_FP32=False, DOT_PRECISION="tf32")  # fmt: skip
        out.append((name, consts, launch))

    for kbs in (16, 128) if quick else (16, 32, 64, 128):
        cfg(f"decode kbs {kbs}", kbs=kbs, decode=True)
        cfg(f"prefill kbs {kbs}", kbs=kbs, decode=False)
    if not quick:
        cfg("decode kbs 16, 4 splits", kbs=16, decode=True, splits=4)
    cfg("prefill kbs 48, group 8, window", kbs=48, decode=False, group=8, window=True)
    cfg("decode kbs 2096, group 1, window", kbs=2096, decode=True, group=1, window=True)
    cfg("decode kbs 16, 4 splits, softcap", kbs=16, decode=True, splits=4, softcap=True)
    cfg("prefill kbs 64, softcap", kbs=64, decode=False, softcap=True)
    return out


def build_all(target: Target, quick: bool = False) -> list[Report]:
    reports = [
        report(
            f"paged_attention {name}",
            compile_kernel(
                T._paged_attention_kernel, c, target, launch.num_warps, launch.num_stages
            ),
            target,
        )  # fmt: skip
        for name, c, launch in attention_configs(quick)
    ]
    head = dict(HEAD_DIM=128, HEAD_DIM_PAD=128)
    others = [
        ("merge_splits", T._merge_splits_kernel, dict(NUM_SPLITS=4, **head)),
        ("write_kv", T._write_kv_kernel, dict(KV_HEADS=8, KV_HEADS_PAD=8, **head)),
        ("zero_pages", T._zero_pages_kernel, dict(BLOCK=1024)),
    ]
    reports += [report(name, compile_kernel(fn, c, target), target) for name, fn, c in others]
    return reports + state_reports(target)


def state_reports(target: Target) -> list[Report]:
    """The Mamba2 decode kernels at Granite-4.0-H-Small's sizes: 128 heads of 64 x 128 states in
    one group, a 4-tap conv over 8448 channels; bf16 and float32 state pages."""
    from hybridkv.ops import triton_mamba as M

    fp32 = {k: "*fp32" for k in ("y_ptr", "x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr", "D_ptr")}
    index = {"pages_ptr": "*i64", "has_init_ptr": "*u8"}
    ssm_units = {"stride_yp", "stride_sn", "stride_xp", "stride_dth", "stride_bn", "stride_cn"}
    conv_units = {"stride_yc", "stride_xc", "stride_wk", "stride_sk"}
    out = []
    for dtype in ("bf16", "fp32"):
        block_p, block_n = M.ssm_decode_blocks(64, 128)
        consts = dict(HEADS_PER_GROUP=128, P=64, N=128, BLOCK_P=block_p, BLOCK_N=block_n)
        kernel = compile_kernel(M._ssm_decode_kernel, consts, target,
                                pointers={**fp32, **index, "state_ptr": f"*{dtype}"},
                                unit_strides=ssm_units)  # fmt: skip
        out.append(report(f"ssm_decode, {dtype} state", kernel, target))
    consts = dict(K=4, K_PAD=4, HAS_BIAS=True, SILU=True, BLOCK_C=M.CONV_BLOCK_C)
    kernel = compile_kernel(M._conv_decode_kernel, consts, target, pointers=index,
                            unit_strides=conv_units)  # fmt: skip
    out.append(report("conv1d_decode, bf16", kernel, target))
    return out + gdn_reports(target)


def gdn_reports(target: Target) -> list[Report]:
    """The gated-delta decode kernel at Qwen3-Next's sizes (value and key heads of 128), bf16
    and float32 state pages."""
    from hybridkv.ops import triton_gdn as G

    fp32 = {k: "*fp32" for k in ("o_ptr", "q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr")}
    index = {"pages_ptr": "*i64", "has_init_ptr": "*u8"}
    units = {"stride_ov", "stride_sv", "stride_qk", "stride_kk", "stride_vv", "stride_gh",
             "stride_bh"}  # fmt: skip
    out = []
    for dtype in ("bf16", "fp32"):
        block_k, block_v = G.gdn_decode_blocks(128, 128)
        consts = dict(K=128, V=128, BLOCK_K=block_k, BLOCK_V=block_v)
        kernel = compile_kernel(G._gdn_decode_kernel, consts, target,
                                pointers={**fp32, **index, "state_ptr": f"*{dtype}"},
                                unit_strides=units)  # fmt: skip
        out.append(report(f"gdn_decode, {dtype} state", kernel, target))
    return out


def problems(reports: list[Report], target: Target) -> list[str]:
    bad = []
    for r in reports:
        if not 0 <= r.spill_bytes <= SPILL_LIMIT:
            bad.append(f"{r.name}: {r.spill_bytes} spill bytes (limit {SPILL_LIMIT})")
        if r.shared_bytes > target.shared_limit:
            bad.append(f"{r.name}: {r.shared_bytes} B shared > {target.shared_limit}")
    return bad


def print_table(target_name: str, reports: list[Report]) -> None:
    amd = TARGETS[target_name].gpu.backend == "hip"
    tool = "AMDGCN metadata; regs = VGPRs, spill = scratch" if amd else "ptxas -v"
    print(f"triton {triton.__version__}, target {target_name} ({tool})")
    occ = f" {'occ':>3}" if amd else ""
    head = f"{'kernel':<48} {'shared B':>9} {'regs':>5} {'spill B':>8}{occ}  memory / matrix ops"
    print(head)
    print("-" * len(head))
    for r in reports:
        ops = ", ".join(f"{k} {v}" for k, v in r.instructions.items())
        occ = f" {r.occupancy if r.occupancy is not None else '?':>3}" if amd else ""
        print(f"{r.name:<48} {r.shared_bytes:>9} {r.registers:>5} {r.spill_bytes:>8}{occ}  {ops}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    p.add_argument("--check", action="store_true", help="exit 1 on spills or shared overflow")
    p.add_argument("--quick", action="store_true", help="kernel blocks of 16 and 128 only")
    args = p.parse_args(argv)
    names = list(TARGETS) if args.target == "all" else [args.target]
    bad = []
    for name in names:
        reports = build_all(TARGETS[name], args.quick)
        print_table(name, reports)
        found = problems(reports, TARGETS[name])
        for line in found:
            print(f"PROBLEM ({name}): {line}")
        bad += found
        print()
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
