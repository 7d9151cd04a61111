/* The CPU record's C half: which instruction sets this library was built for (the HKV_*
 * macros of hkv_common.h, decided by -march) and which of them the CPU in hand has (cpuid on
 * x86-64, the auxiliary vector on aarch64), and the one place that asks Linux for the AMX tile
 * permission. hybridkv/ops/native/cpu.py reads both lists into the CPU record that the plan,
 * `hybridkv bench` and the engine's start-up log print, and from which ops choose their
 * implementations.
 *
 * Both lists use the same names, comma-separated, in this order:
 *     avx2 (with fma and f16c), avx_vnni, avx512 (F, BW, VL, DQ), avx512_bf16, avx512_vnni,
 *     amx_bf16, amx_int8, neon, neon_dot, neon_bf16 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "hkv_common.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__linux__) && defined(__aarch64__)
#include <sys/auxv.h>
#endif

static void cpu_add(char *out, size_t size, int on, const char *name) {
    if (!on) return;
    if (out[0]) strncat(out, ",", size - strlen(out) - 1);
    strncat(out, name, size - strlen(out) - 1);
}

/* the instruction sets of this build */
const char *hkv_cpu_built(void) {
    static char out[256];
    out[0] = 0;
    cpu_add(out, sizeof out, HKV_AVX2, "avx2");
    cpu_add(out, sizeof out, HKV_AVX_VNNI, "avx_vnni");
    cpu_add(out, sizeof out, HKV_AVX512, "avx512");
    cpu_add(out, sizeof out, HKV_AVX512_BF16, "avx512_bf16");
    cpu_add(out, sizeof out, HKV_AVX512_VNNI, "avx512_vnni");
    cpu_add(out, sizeof out, HKV_AMX_BF16, "amx_bf16");
    cpu_add(out, sizeof out, HKV_AMX_INT8, "amx_int8");
    cpu_add(out, sizeof out, HKV_NEON, "neon");
    cpu_add(out, sizeof out, HKV_NEON_DOT, "neon_dot");
    cpu_add(out, sizeof out, HKV_NEON_BF16, "neon_bf16");
    return out;
}

#if defined(__x86_64__)
/* whether the OS saves the register state `mask` of XCR0 (AVX: 0x6, AVX-512: 0xe6) */
static int cpu_os_saves(uint64_t mask) {
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((((uint64_t)hi << 32) | lo) & mask) == mask;
}
#endif

#if defined(__linux__) && defined(__x86_64__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether Linux lets this process use AMX tiles: it grants the tile data state on request,
 * once per process. Asked here only: `hkv_cpu_has` names AMX only where it is granted, so the
 * CPU record (and every op choice made from it) never picks a tile kernel that would fail. */
static int cpu_amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}
#else
static int cpu_amx_permitted(void) { return 0; }
#endif

/* Whether this build's AMX kernels may run: built for AMX and granted the tiles. */
int hkv_amx_ready(void) { return HKV_AMX_BF16 && cpu_amx_permitted(); }

/* the instruction sets this CPU (and OS) has, among those named above */
const char *hkv_cpu_has(void) {
    static char out[256];
    out[0] = 0;
#if defined(__x86_64__)
    uint32_t a, b, c, c1 = 0, d, b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    if (__get_cpuid(1, &a, &b, &c1, &d) && __get_cpuid_max(0, 0) >= 7) {
        __cpuid_count(7, 0, a, b7, c7, d7);
        __cpuid_count(7, 1, a71, b, c, d);
    }
    const int avx = cpu_os_saves(0x6), zmm = cpu_os_saves(0xe6);
    const int avx2 = avx && (b7 & (1u << 5)) && (c1 & (1u << 12)) && (c1 & (1u << 29));
    const int avx512 = zmm && (b7 & (1u << 16)) && (b7 & (1u << 30)) && (b7 & (1u << 31)) &&
                       (b7 & (1u << 17));
    cpu_add(out, sizeof out, avx2, "avx2");
    cpu_add(out, sizeof out, avx2 && (a71 & (1u << 4)), "avx_vnni");
    cpu_add(out, sizeof out, avx512, "avx512");
    cpu_add(out, sizeof out, avx512 && (a71 & (1u << 5)), "avx512_bf16");
    cpu_add(out, sizeof out, avx512 && (c7 & (1u << 11)), "avx512_vnni");
    const int tiles = avx512 && (d7 & (1u << 24)) && cpu_amx_permitted(); /* AMX-TILE, granted */
    cpu_add(out, sizeof out, tiles && (d7 & (1u << 22)), "amx_bf16");
    cpu_add(out, sizeof out, tiles && (d7 & (1u << 25)), "amx_int8");
#elif defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    cpu_add(out, sizeof out, (hw & (1ul << 1)) != 0, "neon");        /* HWCAP_ASIMD */
    cpu_add(out, sizeof out, (hw & (1ul << 20)) != 0, "neon_dot");   /* HWCAP_ASIMDDP */
    cpu_add(out, sizeof out, (hw2 & (1ul << 14)) != 0, "neon_bf16"); /* HWCAP2_BF16 */
#endif
    return out;
}

