/* int8 weight-only linear on AMX-INT8 tiles (quantization="int8", rows of x past the streaming
 * kernel's): y = x @ (q * scale)^T, with hkv_int8_linear's arguments (int8_linear.c).
 * hybridkv/layers/quantization.py is the reference and the caller (INT8_LINEAR's
 * "native-amx-int8"); hybridkv/ops/native/int8_linear.py declares this file's kernel.
 *
 *     x      [M, K] float32 or bfloat16 rows at a row stride (unit column stride)
 *     q      [N, K] int8, contiguous (the weight as the layer keeps it: no other copy)
 *     scale  [N] bfloat16, the weight rows' scales
 *     y      [M, N] float32 or bfloat16 rows at a row stride
 *
 * The tiles multiply q as it lies: an AMX A operand is 16 rows of 64 consecutive bytes, so a
 * block of weight rows is loaded straight from q (row stride K), nothing widened or copied
 * (widening q to bfloat16 for tdpbf16ps cost about 4.5 cycles per 32 weights, as much as the
 * tiles' own time at 64 rows of x). x is written in I8A_D = 2 digits of 8 bits per row (each
 * row its own scale, as w8a8's single digit):
 *
 *     sx = max_k |x[m, k]| / 127,   u = x / sx  (|u| <= 127)
 *     d1 = round(u),  d2 = round(254 (u - d1))                       (|d1|, |d2| <= 127)
 *     x = sx (d1 + d2 / 254) + e,   |e| <= sx / 508 = max_k |x[m, k]| / 64516  (~2^-16)
 *
 * so the products are exact int32 sums (tdpbssd; |sum| <= 127^2 K) and
 *
 *     y[m, n] = (C2 / 254 + C1) * sx[m] * scale[n]       (Cd = sum_k dd[m, k] q[n, k])
 *
 * in float32, rounded once to y's dtype. x keeps 16 bits of its row's range: each value within
 * 2^-16 of the row's largest, where rounding it to bfloat16 (the GEMM this replaces) moves it by
 * up to 2^-9 of itself; the two agree for values 128x below the row's largest. A row with an
 * infinity or NaN: sx NaN, its outputs NaN (no other row's); a zero row: zeros.
 *
 * Tiles (all 16 rows of 64 bytes: hkv_tiles_16x64):
 *
 *     A (tiles 4, 5)   16 weight rows n, 64 consecutive k each: q itself
 *     B (tiles 6, 7)   the digit rows of x as 4-byte groups: row r, column c = digit row c,
 *                      k = 4r .. 4r + 3 (xp: packed once per call, 1 KiB a tile)
 *     C (tiles 0..3)   16 x 16 int32 sums [n][c]: (A 4 or 5) x (B 6 or 7)
 *
 * A pass covers 32 weight rows and I8A_R = 16 rows of x (their 32 digit rows, d1 and d2 of a
 * row side by side): 64 k a step of 4 tdpbssd on 2 A and 2 B tile loads, the sums transposed
 * in registers on the way to y. A task is 32 weight rows against every pass of a group of
 * rows of x (the first pass reads the block from memory while a far prefetch brings the
 * next task's into L2; the others find it in L1/L2); groups of about I8A_GROUP_BYTES of B
 * tiles, which stay in L2 while every task runs them (one sweep over x read tiles from L3: 768
 * -> 3072 at 1700 rows, 1 thread, 18-19 ms against 9.5-9.8). From I8A_CHUNK_PASSES passes on,
 * K goes in chunks of I8A_KC steps through every pass of the group, so that the chunk's A
 * tiles stay in L1 (the sums kept in memory between chunks: 1536 -> 768 at 512 / 1700 rows
 * 1280 / 4216 us against 1091 / 3630; level at K = 768). Threads take tasks in turn; x is written in
 * digits and packed by all of them first. The last task's rows (and the k past K of the last
 * row: A tiles read 64 bytes a row) come from a zero-padded copy; elsewhere the k past K read
 * the next row's weights, multiplied by x's zero digits there.
 *
 * Measured (Intel Xeon, 2 cores, AVX-512 + AMX, 1 thread, minima; benchmarks/README.md):
 * 768 -> 3072 at 16 / 64 / 512 / 1700 rows 135 / 328 / 1957 / 6807 us, oneDNN's bfloat16 GEMM
 * on a prepacked bfloat16 weight 224 / 310 / 1523 / 5230, bfloat16-widening tiles (tdpbf16ps,
 * tried first) 291 / 468 / 2207 / 9464. Without AMX-INT8 (the build, or the OS's tile permission: the CPU record then
 * lacks amx_int8 and the op chain never picks this kernel) it returns -1 without writing. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AMX_INT8
#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>

#define I8A_D 2                    /* 8-bit digits per value of x */
#define I8A_R (32 / I8A_D)         /* rows of x per pass: their digit rows fill 2 B tiles */
#define I8A_N 32                   /* weight rows per task (two A tiles) */
#define I8A_PARALLEL_MIN (1 << 16) /* weights (N * K) from which the threads split the work */
#define I8A_GROUP_BYTES (512 * 1024) /* B tiles of x per sweep over the weights (in L2) */
#define I8A_KC 6            /* steps (64 k) per chunk of K where passes are many */
#define I8A_CHUNK_PASSES 4 /* passes (16 rows of x) from which K goes in chunks */
#define I8A_UNROLL _Pragma("GCC unroll 16")

/* r[0..15] (16 x 16 of 32-bit values) transposed in place: r[j] lane i = the old r[i] lane j.
 * Two rounds of unpacks within 128-bit lanes, then two of 128-bit lane shuffles (64 in all). */
static inline __attribute__((always_inline)) void i8a_transpose16(__m512i r[16]) {
    __m512i t[16];
    I8A_UNROLL for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* r[4g + c], 128-bit lane L: column 4L + c of rows 4g .. 4g + 3 */
    I8A_UNROLL for (int g = 0; g < 4; g++) {
        r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c] and r[12 + c] */
    I8A_UNROLL for (int c = 0; c < 4; c++) {
        t[4 * c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);     /* lanes 0, 2 */
        t[4 * c + 1] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd); /* lanes 1, 3 */
        t[4 * c + 2] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        t[4 * c + 3] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    }
    I8A_UNROLL for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0xdd);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0xdd);
    }
}

/* 16 values of a row of x from k (lanes of `m`; zeros elsewhere) as float32 (exact) */
static inline __m512 i8a_load16(const void *x, int bf16, int64_t k, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 i8a_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* One row of x -> its I8A_D digit rows d (Kp bytes apart, zeros past K) and its scale: 0 for
 * a zero row, NaN for a row with an infinity or NaN (its outputs NaN, no other row's). */
static void i8a_digits(const void *x, int bf16, int64_t K, int8_t *d, int64_t Kp, float *sx) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = i8a_load16(x, bf16, k, i8a_mask16(K - k));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float a = _mm512_reduce_max_ps(amax);
    for (int i = 0; i < I8A_D; i++) memset(d + i * Kp, 0, (size_t)Kp);
    if (nan || isinf(a) || a == 0.0f) {
        *sx = a == 0.0f && !nan ? 0.0f : NAN;
        return;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / a), base = _mm512_set1_ps(254.0f);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = i8a_mask16(K - k);
        __m512 u = _mm512_mul_ps(i8a_load16(x, bf16, k, m), inv);
        for (int i = 0; i < I8A_D; i++) { /* u's next digit (nearest even), then the rest */
            const __m512i di = _mm512_cvtps_epi32(u);
            _mm_mask_storeu_epi8(d + i * Kp + k, m, _mm512_cvtsepi32_epi8(di));
            u = _mm512_mul_ps(_mm512_sub_ps(u, _mm512_cvtepi32_ps(di)), base);
        }
    }
    *sx = a / 127.0f;
}

/* The B tiles of pass p from its digit rows xd (32 rows of Kp bytes): tile (h, kb) at
 * xp + 1024 (h KB + kb), its row r, column c = bytes 64 kb + 4r .. + 3 of digit row 16 h + c */
static void i8a_pack(const int8_t *xd, int64_t Kp, int8_t *xp) {
    const int64_t KB = Kp / 64;
    for (int h = 0; h < 2; h++)
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512i r[16];
            I8A_UNROLL for (int c = 0; c < 16; c++)
                r[c] = _mm512_loadu_si512(xd + (16 * h + c) * Kp + 64 * kb);
            i8a_transpose16(r);
            I8A_UNROLL for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(xp + 1024 * (h * KB + kb) + 64 * i, r[i]);
        }
}

/* Pass p of x: its rows' digits and scales (sx[i], i < I8A_R), packed into B tiles */
static void i8a_prepare(const void *x, int64_t ldx, int bf16, int64_t M, int64_t K, int64_t Kp,
                        int64_t p, int8_t *xd, int8_t *xp, float *sx) {
    const int64_t esz = bf16 ? 2 : 4;
    memset(xd + I8A_R * I8A_D * Kp, 0, (size_t)((32 - I8A_R * I8A_D) * Kp));
    for (int i = 0; i < I8A_R; i++) {
        const int64_t m = p * I8A_R + i;
        if (m < M) {
            i8a_digits((const char *)x + m * ldx * esz, bf16, K, xd + i * I8A_D * Kp, Kp, sx + i);
        } else {
            memset(xd + i * I8A_D * Kp, 0, (size_t)(I8A_D * Kp));
            sx[i] = 0.0f;
        }
    }
    i8a_pack(xd, Kp, xp);
}

/* C tiles 0..3 of pass p -> y: rows p I8A_R .. (< M), columns n0 .. n0 + nc - 1 (nc <= 32) */
static void i8a_store(const int32_t (*c)[256], const float *sx, int64_t M, int64_t p,
                      const uint16_t *scale, int64_t n0, int64_t nc, void *y, int64_t ldy,
                      int ybf16) {
    const __m512 one = _mm512_set1_ps(1.0f / 254.0f);
    for (int a = 0; a < 2 && 16 * a < nc; a++) { /* weight rows n0 + 16 a .. + 15 */
        const __mmask16 mask = i8a_mask16(nc - 16 * a);
        const __m256i h = _mm256_maskz_loadu_epi16(mask, scale + n0 + 16 * a);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        __m512 t[32]; /* t[j] lane n: the sum of digit row j and weight row n0 + 16 a + n */
        for (int b = 0; b < 2; b++) {
            __m512i r[16];
            I8A_UNROLL for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(c[2 * a + b] + 16 * n);
            i8a_transpose16(r);
            I8A_UNROLL for (int j = 0; j < 16; j++) t[16 * b + j] = _mm512_cvtepi32_ps(r[j]);
        }
        for (int i = 0; i < I8A_R; i++) {
            const int64_t m = p * I8A_R + i;
            if (m >= M) break;
            __m512 v = t[I8A_D * i + I8A_D - 1]; /* digits from the last: Horner in 1 / 254 */
            for (int d = I8A_D - 2; d >= 0; d--) v = _mm512_fmadd_ps(v, one, t[I8A_D * i + d]);
            v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(sx[i])), s);
            const int64_t at = m * ldy + n0 + 16 * a;
            if (ybf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, hkv_f32x16_to_bf16(v));
            else
                _mm512_mask_storeu_ps((float *)y + at, mask, v);
        }
    }
}

/* C tiles 0..3 <- cs (first: zeros); C tiles -> cs (4 KiB: the int32 sums of a pass) */
static inline void i8a_load_c(const int32_t *cs, int first) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, cs, 64);
        _tile_loadd(1, cs + 256, 64);
        _tile_loadd(2, cs + 512, 64);
        _tile_loadd(3, cs + 768, 64);
    }
}

static inline void i8a_save_c(int32_t *cs) {
    _tile_stored(0, cs, 64);
    _tile_stored(1, cs + 256, 64);
    _tile_stored(2, cs + 512, 64);
    _tile_stored(3, cs + 768, 64);
}

/* C tiles 0..3 += steps kb0 .. kb1 - 1 (64 k each) of weight rows (A: w, row stride ldw; w + 16
 * ldw the second tile) by the 32 digit rows of B tiles xp (KB steps a tile column). The far
 * prefetch spreads `lines` cache lines from *pf over the steps. */
static inline void i8a_steps(const int8_t *w, int64_t ldw, const int8_t *xp, int64_t KB,
                             int64_t kb0, int64_t kb1, int two_n, const char **pf,
                             int64_t lines) {
    const int8_t *A1 = w + 16 * ldw, *B1 = xp + 1024 * KB;
    const char *at = *pf;
    const int64_t steps = kb1 - kb0;
    int64_t debt = 0;
    for (int64_t kb = kb0; kb < kb1; kb++) {
        for (debt += lines; debt >= steps; debt -= steps, at += 64) _mm_prefetch(at, _MM_HINT_T1);
        _tile_loadd(4, w + 64 * kb, ldw);
        _tile_loadd(6, xp + 1024 * kb, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(7, B1 + 1024 * kb, 64);
        _tile_dpbssd(1, 4, 7);
        if (two_n) {
            _tile_loadd(5, A1 + 64 * kb, ldw);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
    }
    *pf = at;
}

/* Task t: weight rows 32 t .. 32 t + 31 against passes p0 .. p1 - 1 of x; the next task's
 * rows (the same thread's next, under a static schedule) prefetched into L2 during the first
 * pass. With I8A_CHUNK_PASSES passes or more K goes in chunks of I8A_KC steps, every pass
 * through a chunk before the next (the chunk's A tiles stay in L1 for all passes), the sums
 * kept in cs (4 KiB a pass) between chunks. */
static void i8a_task(const int8_t *xp, const float *sx, int64_t M, int64_t Kp, const int8_t *q,
                     const int8_t *tail, const uint16_t *scale, int64_t N, int64_t K, void *y,
                     int64_t ldy, int ybf16, int64_t t, int64_t p0, int64_t p1, int32_t *cs) {
    const int64_t KB = Kp / 64, tasks = (N + I8A_N - 1) / I8A_N;
    const int64_t n0 = t * I8A_N, nc = N - n0 < I8A_N ? N - n0 : I8A_N;
    const int last = t == tasks - 1;
    const int8_t *w = last ? tail : q + n0 * K;
    const int64_t ldw = last ? Kp : K, chunk = p1 - p0 >= I8A_CHUNK_PASSES ? I8A_KC : KB;
    const char *pf = (const char *)(q + (n0 + I8A_N) * K);
    const int64_t lines = t + 2 < tasks ? (I8A_N * K + 63) / 64 : 0;
    int32_t c[4][256];
    for (int64_t kb0 = 0; kb0 < KB; kb0 += chunk) {
        const int64_t kb1 = KB - kb0 < chunk ? KB : kb0 + chunk;
        for (int64_t p = p0; p < p1; p++) {
            int32_t *cp = cs + 1024 * (p - p0);
            i8a_load_c(cp, kb0 == 0);
            i8a_steps(w, ldw, xp + p * 2 * KB * 1024, KB, kb0, kb1, nc > 16, &pf,
                      p == p0 && kb0 == 0 ? lines : 0);
            if (kb1 < KB) {
                i8a_save_c(cp);
                continue;
            }
            i8a_save_c(c[0]);
            i8a_store((const int32_t(*)[256])c, sx + p * I8A_R, M, p, scale, n0, nc, y, ldy,
                      ybf16);
        }
    }
}

/* The call's scratch, kept between calls and grown when a call needs more: a fresh
 * aligned_alloc of a few MiB every call (the B tiles of 1700 rows of x are 2.6 MiB at K = 768)
 * came back from the OS as new pages, about 300 page faults a call at 1 thread (768 -> 3072,
 * 1700 rows: 7.6-8.3 ms a call before). One call at a time holds it (i8a_busy); a call that
 * finds it held (another thread's) allocates its own and frees it. */
static atomic_flag i8a_busy = ATOMIC_FLAG_INIT;
static void *i8a_kept;
static size_t i8a_kept_bytes;

/* `bytes` of 64-aligned scratch: the kept buffer (*kept = 1; i8a_release gives it back) or a
 * fresh one (*kept = 0; freed there); NULL: no memory (nothing held). */
static void *i8a_scratch(size_t bytes, int *kept) {
    bytes = (bytes + 63) / 64 * 64;
    *kept = !atomic_flag_test_and_set_explicit(&i8a_busy, memory_order_acquire);
    if (!*kept) return aligned_alloc(64, bytes);
    if (i8a_kept_bytes < bytes) {
        free(i8a_kept);
        i8a_kept = aligned_alloc(64, bytes);
        i8a_kept_bytes = i8a_kept == NULL ? 0 : bytes;
    }
    if (i8a_kept == NULL) atomic_flag_clear_explicit(&i8a_busy, memory_order_release);
    return i8a_kept;
}

static void i8a_release(void *scratch, int kept) {
    if (kept)
        atomic_flag_clear_explicit(&i8a_busy, memory_order_release);
    else
        free(scratch);
}

/* y = x @ (q * scale)^T on AMX-INT8 tiles (the top of this file). Returns 0, or -1: no tiles
 * here, or no memory (nothing written). */
int hkv_int8_linear_amx(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                        const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                        int64_t ldy, int ybf16) {
    if (!hkv_amx_ready()) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t ysz = ybf16 ? 2 : 4;
    if (K <= 0) { /* no products: zeros */
        for (int64_t m = 0; m < M; m++) memset((char *)y + m * ldy * ysz, 0, (size_t)(N * ysz));
        return 0;
    }
    const int64_t Kp = (K + 63) / 64 * 64, passes = (M + I8A_R - 1) / I8A_R;
    const int64_t n_last = (N - 1) / I8A_N * I8A_N; /* the last task's first row */
    const int64_t tasks = (N + I8A_N - 1) / I8A_N;
    int64_t group = I8A_GROUP_BYTES / (32 * Kp); /* passes */
    group = group < 1 ? 1 : group;
    const int parallel = N * K >= I8A_PARALLEL_MIN, threads = parallel ? omp_get_max_threads() : 1;
    /* the scratch: B tiles of x (every pass), each thread's digit rows of one pass, the last
     * task's zero-padded rows, sums between chunks (each thread's group), the rows' scales */
    const size_t xp_bytes = (size_t)(passes * 32 * Kp), xd_bytes = (size_t)(32 * Kp);
    const size_t tail_bytes = (size_t)(I8A_N * Kp), cs_bytes = (size_t)group * 4096;
    int kept;
    char *scratch = i8a_scratch(xp_bytes + threads * (xd_bytes + cs_bytes) + tail_bytes +
                                    sizeof(float) * (size_t)(passes * I8A_R),
                                &kept);
    if (scratch == NULL) return -1;
    int8_t *xp = (int8_t *)scratch, *xds = xp + xp_bytes;
    int32_t *css = (int32_t *)(xds + threads * xd_bytes); /* 64-aligned: Kp, 4096 */
    int8_t *tail = (int8_t *)((char *)css + threads * cs_bytes);
    float *sx = (float *)(tail + tail_bytes);
    memset(tail, 0, tail_bytes);
    for (int64_t n = n_last; n < N; n++) memcpy(tail + (n - n_last) * Kp, q + n * K, (size_t)K);
#pragma omp parallel num_threads(threads) if (parallel)
    {
        const int me = omp_get_thread_num();
        int32_t *cs = (int32_t *)((char *)css + (size_t)me * cs_bytes);
        int8_t *xd = xds + (size_t)me * xd_bytes; /* one pass's digit rows, packed from here */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes; p++)
            i8a_prepare(x, ldx, xbf16, M, K, Kp, p, xd, xp + p * 32 * Kp, sx + p * I8A_R);
        hkv_tiles_16x64();
        /* passes in groups whose B tiles stay in L2 (I8A_GROUP_BYTES), each against every task */
        for (int64_t p0 = 0; p0 < passes; p0 += group) {
            const int64_t p1 = p0 + group < passes ? p0 + group : passes;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tasks; t++)
                i8a_task(xp, sx, M, Kp, q, tail, scale, N, K, y, ldy, ybf16, t, p0, p1, cs);
        }
        _tile_release();
    }
    i8a_release(scratch, kept);
    return 0;
}

#else /* no AMX-INT8 in this build */

int hkv_int8_linear_amx(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                        const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                        int64_t ldy, int ybf16) {
    (void)x, (void)ldx, (void)xbf16, (void)q, (void)scale, (void)M, (void)N, (void)K, (void)y;
    (void)ldy, (void)ybf16;
    return -1;
}

#endif
