#!/usr/bin/env bash
# Every GPU check of hybridkv in one command, sized for a short loan of one GPU machine
# (expected 4 to 7 minutes on an H200, nothing to install). Each step has its own time limit;
# steps run in order of importance (the tests first), so a run cut short keeps the most.
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else ./gpu-check-out
#   JSON_DIR=/tmp/json benchmarks/gpu_check.sh   # the benchmarks' JSON elsewhere
#
# Runs from the repository root without installing anything: PYTHONPATH points at the checkout,
# and the machine's python3 must already hold torch (CUDA build), triton, transformers,
# safetensors, tokenizers, numpy, pytest and pytest-xdist. flash-linear-attention (fla-core,
# carried as a wheel and unpacked at FLA_PATH) adds the fla steps.
#   GPU_CHECK_STEPS="tests spec_decode fla"   run only these steps (default: all)
# Writes to OUT_DIR (nine files with JSON_DIR elsewhere; the device tool returns eight: choose
# steps):
#   summary.txt           GPU, driver, Python, torch and Triton versions, then one line per step
#                         with its exit status and time
#   pytest.log            tests marked gpu or triton: the Triton kernels compiled on the GPU
#                         against the PyTorch reference (per-position states included), and the
#                         engine on CUDA against transformers
#   spec_decode.log       speculative decoding on CUDA, every cache kind, against transformers
#   gpu_mamba.txt         benchmarks/gpu_mamba.py: Mamba2 / GDN decode kernels against PyTorch
#   fla_tests.log         the fla GDN and KDA ops (tests/ops/test_{gdn,kda}_ops_fla.py) with fla
#                         importable
#   gpu_fla.txt           benchmarks/gpu_fla.py: the GDN and KDA ops against flash-linear-attention
#   gpu_attention.txt     benchmarks/gpu_attention.py's table (and .json in JSON_DIR)
#   gpu_sweep.txt         its launch sweep (tile sizes, warps, stages) at kbs 16 and 128 (.json)
#   compile_report.txt    sm_90a registers, spills and shared memory per kernel (this Triton's)
# Exits 0 only if every step passed.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
json=${JSON_DIR:-$out}  # the device tool returns 8 files: JSON_DIR elsewhere drops the .json
mkdir -p "$out" "$json"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
status=0
: >"$out/summary.txt"

step() {  # step NAME LIMIT_S LOG COMMAND...: run with a time limit, log, record the exit status
    local name=$1 limit=$2 log=$3
    shift 3
    case " ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/summary.txt"
}

{
    nvidia-smi -L
    nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem --format=csv
    timeout 30 "$py" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch",
        torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "triton",
        triton.__version__)'
} >>"$out/summary.txt" 2>&1 || status=1
step tests 180 pytest.log "$py" -m pytest -q -p no:cacheprovider -n 8 -m "gpu or triton" \
    tests/ops/test_triton_attention.py tests/ops/test_triton_mamba.py tests/ops/test_positions.py \
    tests/worker/test_model_runner.py tests/test_engine.py \
    tests/benchmarks/test_gpu_attention_smoke.py tests/benchmarks/test_gpu_mamba_smoke.py
step spec_decode 150 spec_decode.log "$py" -m pytest -q -p no:cacheprovider -n 8 -m gpu \
    tests/spec_decode/test_engine_speculation.py
step gpu_mamba 60 gpu_mamba.txt "$py" benchmarks/gpu_mamba.py
# flash-linear-attention only where asked for (FLA_PATH: where fla-core is unpacked): with it
# importable, transformers' Qwen3-Next and Kimi-Linear run fla's kernels on the CPU tensors of
# the tests' references, which fails
if [ -n "${FLA_PATH:-}" ]; then
    with_fla=(env PYTHONPATH="$PYTHONPATH:$FLA_PATH")
    step fla_tests 240 fla_tests.log "${with_fla[@]}" "$py" -m pytest -q -rP -p no:cacheprovider \
        -n 4 -m "gpu or triton" tests/ops/test_gdn_ops_fla.py tests/ops/test_kda_ops_fla.py
    step gpu_fla 180 gpu_fla.txt "${with_fla[@]}" "$py" benchmarks/gpu_fla.py
else
    echo "gpu_fla: skipped (set FLA_PATH to where fla-core is unpacked)" | tee -a "$out/summary.txt"
fi
step gpu_attention 150 gpu_attention.txt "$py" benchmarks/gpu_attention.py \
    --json-out "$json/gpu_attention.json"
step gpu_sweep 120 gpu_sweep.txt "$py" benchmarks/gpu_attention.py --sweep \
    --kernel-block-sizes 16 128 --blocks-per-page 1 --json-out "$json/gpu_sweep.json"
step compile_report 40 compile_report.txt "$py" benchmarks/triton_compile_report.py \
    --target sm_90a --check
tail -n 3 "$out"/*.log 2>/dev/null
cat "$out"/gpu_*.txt 2>/dev/null
exit $status
