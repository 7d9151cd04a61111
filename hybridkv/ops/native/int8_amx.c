/* int8 weight-only linear on AMX-BF16 tiles (quantization="int8", rows of x past the streaming
 * kernel's): y = x @ (q * scale)^T, the same arguments as hkv_int8_linear (int8_linear.c).
 * hybridkv/layers/quantization.py is the reference and the caller (INT8_LINEAR's
 * "native-amx-bf16"); hybridkv/ops/native/int8_linear.py declares this file's kernel.
 *
 *     x      [M, K] float32 or bfloat16 rows at a row stride (unit column stride)
 *     q      [N, K] int8, contiguous (the weight as the layer keeps it: no other copy)
 *     scale  [N] bfloat16, the weight rows' scales
 *     y      [M, N] float32 or bfloat16 rows at a row stride
 *
 * int8 weights are exact in bfloat16 (|q| <= 127: 7 significant bits), so the tiles multiply
 * q itself: x rounded to bfloat16 (nearest even; bfloat16 x as it is), float32 sums of the
 * exact products (tdpbf16ps), each sum times its row's scale once, rounded once to y's dtype.
 *
 * The weight is the A operand, so that its rows are read as they lie (no transposition of
 * the weight; x's is made once per call, and the output's once per 16 x 16 sums):
 *
 *     A (tiles 4, 5)   16 weight rows n, 32 consecutive k each, widened to bfloat16 into a
 *                      per-thread buffer (wb: [2][Kp / 32][16][32] for a block of 32 rows)
 *     B (tiles 6, 7)   x as pairs: row r, column m = x[m0 + m, k0 + 2r .. k0 + 2r + 1]
 *                      (xp: [Mp / 16][Kp / 32][16][16][2], packed once per call)
 *     C (tiles 0..3)   16 x 16 float32 sums [n][m]: (A 4 or 5) x (B 6 or 7), transposed
 *                      in registers on the way to y, where the scales are applied
 *
 * Work: a task is a block of I8A_N = 32 weight rows: widened once into wb (64 Kp bytes: in L2
 * up to K = 16K), then every 32 rows of x against it, 32 k a step of 4 tdpbf16ps on 2 A and
 * 2 B tile loads. Threads take tasks in turn; x is packed by all of them first. Zero padding: x's rows past M and k past K, the weight's rows past N and k past K.
 * Without AMX-BF16 (the build, or the OS's tile permission: the CPU record then lacks
 * amx_bf16, and the op chain never picks this kernel) it returns -1 without writing. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AMX_BF16
#include <immintrin.h>
#include <omp.h>

#define I8A_N 32                    /* weight rows per task (two A tiles) */
#define I8A_M 32                    /* rows of x per pass over a task's weights (two B tiles) */
#define I8A_PARALLEL_MIN (1 << 16)  /* weights (N * K) from which the threads split the work */
#define I8A_GROUP_BYTES (768 * 1024) /* B tiles of x per sweep over the weights (in L2) */

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

/* 32 values of a row of x from k (`n` of them, zeros after) as bfloat16: 16 pairs */
static inline __m512i i8a_x32(const void *x, int bf16, int64_t k, int64_t n) {
    const __mmask32 m = n >= 32 ? 0xffffffffu : (__mmask32)((1ull << n) - 1);
    if (bf16) return _mm512_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, (const float *)x + k);
    const __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), (const float *)x + k + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* nearest even; k .. k + 15 low */
}

/* B tiles of rows 16 mb .. 16 mb + 15 of x (zeros past M and K): tile kb at xp + 512 kb */
static void i8a_pack_x(const void *x, int64_t ldx, int bf16, int64_t M, int64_t K, int64_t mb,
                       uint16_t *xp) {
    const int64_t KB = (K + 31) / 32, esz = bf16 ? 2 : 4;
    for (int64_t kb = 0; kb < KB; kb++) {
        __m512i r[16];
        I8A_UNROLL for (int m = 0; m < 16; m++) {
            const int64_t row = 16 * mb + m;
            r[m] = row < M ? i8a_x32((const char *)x + row * ldx * esz, bf16, 32 * kb,
                                     K - 32 * kb)
                           : _mm512_setzero_si512();
        }
        i8a_transpose16(r); /* r[p] lane m: the pair p of row m */
        I8A_UNROLL for (int p = 0; p < 16; p++) _mm512_storeu_si512(xp + 512 * kb + 32 * p, r[p]);
    }
}

/* 32 int8 weights from p (`n` of them, zeros after) as 32 bfloat16 (exact) */
static inline __m512i i8a_w32(const int8_t *p, int64_t n) {
    const __mmask32 m = n >= 32 ? 0xffffffffu : (__mmask32)((1ull << n) - 1);
    const __m256i b = _mm256_maskz_loadu_epi8(m, p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* weight rows n0 .. n0 + 31 -> wb: A tile (h, kb) at wb + 512 (h KB + kb), its row r = weight
 * row n0 + 16 h + r, k = 32 kb .. 32 kb + 31 (zeros past N and K) */
static void i8a_widen_w(const int8_t *q, int64_t N, int64_t K, int64_t n0, uint16_t *wb) {
    const int64_t KB = (K + 31) / 32;
    for (int i = 0; i < I8A_N; i++) {
        uint16_t *row = wb + 512 * ((i / 16) * KB) + 32 * (i % 16);
        if (n0 + i >= N) {
            for (int64_t kb = 0; kb < KB; kb++) _mm512_storeu_si512(row + 512 * kb,
                                                                    _mm512_setzero_si512());
            continue;
        }
        const int8_t *w = q + (n0 + i) * K;
        for (int64_t kb = 0; kb < KB; kb++)
            _mm512_storeu_si512(row + 512 * kb, i8a_w32(w + 32 * kb, K - 32 * kb));
    }
}

/* sums c [16 n][16 m] -> y[m0 + m, n0 + n] * scale[n0 + n] for m < mr, n < nc (<= 16) */
static void i8a_store(const float *c, const uint16_t *scale, int64_t m0, int64_t mr, int64_t n0,
                      int64_t nc, void *y, int64_t ldy, int ybf16) {
    const __mmask16 mask = nc >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nc) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, scale + n0);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    __m512i r[16];
    I8A_UNROLL for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(c + 16 * n);
    i8a_transpose16(r); /* r[m] lane n */
    for (int64_t m = 0; m < mr; m++) {
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(r[m]), s);
        const int64_t at = (m0 + m) * ldy + n0;
        if (ybf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, hkv_f32x16_to_bf16(v));
        else
            _mm512_mask_storeu_ps((float *)y + at, mask, v);
    }
}

/* one task: weight rows n0 .. n0 + 31 (widened into wb) against rows m_lo .. M - 1 of x (xp;
 * m_lo a multiple of I8A_M) */
static void i8a_task(const uint16_t *xp, const uint16_t *wb, const uint16_t *scale, int64_t m_lo,
                     int64_t M, int64_t N, int64_t KB, int64_t n0, void *y, int64_t ldy,
                     int ybf16) {
    const int64_t nc = N - n0 < I8A_N ? N - n0 : I8A_N;
    const int two_n = nc > 16;
    const uint16_t *A0 = wb, *A1 = wb + 512 * KB;
    float c[4][256];
    for (int64_t m0 = m_lo; m0 < M; m0 += I8A_M) {
        const int64_t mr = M - m0 < I8A_M ? M - m0 : I8A_M;
        const int two_m = mr > 16;
        const uint16_t *B0 = xp + 512 * KB * (m0 / 16), *B1 = B0 + 512 * KB;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; kb++) {
            _tile_loadd(4, A0 + 512 * kb, 64);
            _tile_loadd(6, B0 + 512 * kb, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_m) {
                _tile_loadd(7, B1 + 512 * kb, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_n) {
                _tile_loadd(5, A1 + 512 * kb, 64);
                _tile_dpbf16ps(2, 5, 6);
                if (two_m) _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        if (two_m) _tile_stored(1, c[1], 64);
        if (two_n) _tile_stored(2, c[2], 64);
        if (two_m && two_n) _tile_stored(3, c[3], 64);
        const int64_t m1 = mr < 16 ? mr : 16, n1 = nc < 16 ? nc : 16;
        i8a_store(c[0], scale, m0, m1, n0, n1, y, ldy, ybf16);
        if (two_m) i8a_store(c[1], scale, m0 + 16, mr - 16, n0, n1, y, ldy, ybf16);
        if (two_n) i8a_store(c[2], scale, m0, m1, n0 + 16, nc - 16, y, ldy, ybf16);
        if (two_m && two_n) i8a_store(c[3], scale, m0 + 16, mr - 16, n0 + 16, nc - 16, y, ldy,
                                      ybf16);
    }
}

/* y = x @ (q * scale)^T on AMX-BF16 tiles (the top of this file). Returns 0, or -1: no tiles
 * here, or no memory (nothing written). */
int hkv_int8_linear_amx(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                        const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                        int64_t ldy, int ybf16) {
    if (!hkv_amx_ready()) return -1;
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) { /* no products: zeros */
        for (int64_t m = 0; m < M; m++)
            memset((char *)y + m * ldy * (ybf16 ? 2 : 4), 0, (size_t)N * (ybf16 ? 2 : 4));
        return 0;
    }
    const int64_t KB = (K + 31) / 32, MB = (M + I8A_M - 1) / I8A_M * (I8A_M / 16);
    const int64_t tasks = (N + I8A_N - 1) / I8A_N;
    int64_t group = I8A_GROUP_BYTES / (KB * 64) / I8A_M * I8A_M; /* rows: 64 KB bytes each */
    group = group < I8A_M ? I8A_M : group;
    const int parallel = N * K >= I8A_PARALLEL_MIN;
    const int threads = parallel ? omp_get_max_threads() : 1;
    const size_t wsize = (size_t)(2 * KB * 512) * sizeof(uint16_t);
    uint16_t *xp = aligned_alloc(64, (size_t)(MB * KB * 512) * sizeof(uint16_t));
    uint16_t *wbs = aligned_alloc(64, wsize * (size_t)threads);
    if (xp == NULL || wbs == NULL) {
        free(xp), free(wbs);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < MB; mb++)
            i8a_pack_x(x, ldx, xbf16, M, K, mb, xp + mb * KB * 512);
        uint16_t *wb = wbs + (size_t)omp_get_thread_num() * (size_t)(2 * KB * 512);
        hkv_tiles_16x64();
        /* rows of x in groups whose B tiles stay in L2 (I8A_GROUP_BYTES) while every task
         * runs them: each group widens the weights again (a sweep over x from L3 costs more) */
        for (int64_t m_lo = 0; m_lo < M; m_lo += group) {
            const int64_t m_hi = M - m_lo < group ? M : m_lo + group;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t t = 0; t < tasks; t++) {
                i8a_widen_w(q, N, K, t * I8A_N, wb);
                i8a_task(xp, wb, scale, m_lo, m_hi, N, KB, t * I8A_N, y, ldy, ybf16);
            }
        }
        _tile_release();
    }
    free(xp), free(wbs);
    return 0;
}

#else /* no AMX-BF16 in this build */

int hkv_int8_linear_amx(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                        const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                        int64_t ldy, int ybf16) {
    (void)x, (void)ldx, (void)xbf16, (void)q, (void)scale, (void)M, (void)N, (void)K, (void)y;
    (void)ldy, (void)ybf16;
    return -1;
}

#endif
