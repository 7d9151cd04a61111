#!/usr/bin/env bash
# The whole CI job (a fresh clone's .ci/run: venv set-up + `make test`) as a 2-core machine about
# half as fast as this one, without AVX-512, would run it:
#   - a CPU cgroup gives the run one CPU-second per wall second, spread over two cores (a CFS
#     quota of 10 ms per 10 ms period): two workers progress at once, each at about half speed;
#   - the native kernels are built for x86-64-v3 and ATen, oneDNN and MKL are capped at AVX2;
#   - the native-build, torch.compile, Triton and pip caches start empty, as on a fresh machine.
# Needs root and the cgroup cpu controller (v1: /sys/fs/cgroup/cpu, v2: cpu.max).
#
#   sudo benchmarks/suite_half_speed.sh [OUT_DIR]      # prints the pytest summary and wall time
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/hybridkv-half-speed}"
rm -rf "$out" && mkdir -p "$out/cache"

if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then  # cgroup v1
    group=/sys/fs/cgroup/cpu/hybridkv-half
    mkdir -p "$group"
    echo 10000 > "$group/cpu.cfs_period_us"
    echo 10000 > "$group/cpu.cfs_quota_us"
elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then  # cgroup v2
    group=/sys/fs/cgroup/hybridkv-half
    mkdir -p "$group"
    echo "10000 10000" > "$group/cpu.max"
else
    echo "suite_half_speed.sh: no writable cgroup cpu controller here (needs root)" >&2
    exit 2
fi

git clone -q "$repo" "$out/clone"
cd "$out/clone"
start=$(date +%s)
(
    echo $BASHPID > "$group/cgroup.procs"
    export HYBRIDKV_NATIVE_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 XDG_CACHE_HOME="$out/cache/xdg" \
        TORCHINDUCTOR_CACHE_DIR="$out/cache/inductor" TRITON_CACHE_DIR="$out/cache/triton" \
        PIP_CACHE_DIR="$out/cache/pip"
    exec .ci/run
) > "$out/ci.log" 2>&1 && rc=0 || rc=$?
grep -E "passed|failed" "$out/ci.log" | tail -1
echo "rc=$rc, whole .ci/run $(( $(date +%s) - start )) s (log: $out/ci.log)"
exit $rc
