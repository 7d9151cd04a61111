/* int8 x int8 linear on AMX-INT8 tiles (quantization="w8a8"): y = (xq @ wq^T) * sx * sw.
 * hybridkv/layers/quantization.py is the reference (`w8a8_reference`: the same rounding, bit
 * for bit); hybridkv/ops/native/w8a8_linear.py declares and wraps this file's kernels.
 *
 *     x      [M, K] float32 or bfloat16 rows at a row stride (unit column stride)
 *     wp     the int8 weight [N, K] packed for AMX's B operand (below), K and N zero-padded
 *     sw     [N] bfloat16, the weight rows' scales
 *     y      [M, N] float32 or bfloat16 rows at a row stride
 *
 * Each row of x is quantized on the fly, symmetric per row (per token, as vLLM's and SGLang's
 * CPU w8a8 do): a = max |x[m, :]|, inv = 127 / a, xq = round-half-even(x * inv) (|xq| <= 127),
 * sx = a / 127 (a zero row: xq = 0, sx = 0; a row with an infinity or NaN: sx = NaN, so its
 * outputs are NaN and no other row's are touched). The tiles then multiply 64 int8 pairs per step
 * into int32 sums (exact), and y = ((float) sum * sx[m]) * sw[n], rounded once to y's dtype.
 *
 * Tiles (all 16 rows of 64 bytes: hkv_tiles_16x64):
 *
 *     A (tiles 4, 5)   16 rows m of xq, 64 consecutive k each: the quantized rows as they lie
 *     B (tiles 6, 7)   16 rows r (k = 4r .. 4r + 3 of the 64), each 16 columns n x 4 bytes:
 *                      byte (r, n, j) = w[n0 + n, k0 + 4r + j]
 *     C (tiles 0..3)   16 x 16 int32 sums: (A 4 or 5) x (B 6 or 7)
 *
 *     wp[nb][kb][r][n][j] = w[16 nb + n, 64 kb + 4 r + j]   (one 1 KiB B tile per (nb, kb))
 *
 * so a B tile is one contiguous KiB of the packed weight (quantization.pack_w8a8 makes it
 * once, at load: the layer keeps no other copy). Work: threads take W8_PAIRS pairs of
 * 16-column blocks at a time and walk x in blocks of 32 rows (two A tiles) against each pair
 * (two B tiles): 4 tdpbssd per 4 tile loads, 64 k a step.
 *
 * Without AMX-INT8 (the build, or the OS's tile permission: the CPU record then lacks
 * amx_int8) the AVX2 kernel below (hkv_w8a8_linear_avx2, the same arguments) runs where the
 * build has AVX2; on aarch64 the NEON kernels at the end (hkv_w8a8_linear_neon_dot with the
 * dot product, hkv_w8a8_linear_neon without it); elsewhere the PyTorch reference (the plan
 * says which). */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

/* The quantized row where 127 / a overflows (a = max |x| < 127 / FLT_MAX, about 3.7e-37: a row
 * of denormals or near them): the reference's round(x * inf) is +-127 for every nonzero value
 * and 0 for zeros (0 * inf = NaN, made 0), which the vector conversions would not give (x86
 * turns NaN into INT_MIN, so -128). q holds K values; the row's scale stays a / 127. */
static inline void w8_quantize_tiny(const void *x, int bf16, int64_t K, int8_t *q) {
    for (int64_t k = 0; k < K; k++) {
        const float v = bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        q[k] = (int8_t)(v > 0.0f ? 127 : v < 0.0f ? -127 : 0);
    }
}


/* What every quantizer does once it has the row's a = max |x| (`finite`: no NaN or infinity):
 * q [Kp] zeroed; a non-finite row gets scale NaN (NaN outputs), a zero row scale 0 (zeros), a
 * row whose 127 / a overflows the tiny path; all three return 0 (done). Else the scale a / 127
 * and 1: the caller multiplies x by *inv = 127 / a and rounds (its vectors). */
static inline int w8_row_prologue(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                  float a, int finite, float *scale, float *inv) {
    memset(q, 0, (size_t)Kp);
    if (!finite || a == 0.0f) {
        *scale = finite ? 0.0f : NAN;
        return 0;
    }
    *inv = 127.0f / a;
    *scale = a / 127.0f;
    if (isinf(*inv)) {
        w8_quantize_tiny(x, bf16, K, q);
        return 0;
    }
    return 1;
}

#if HKV_AMX_INT8
#include <immintrin.h>

#define W8_PARALLEL_MIN (1 << 18) /* weights (N * K) from which the threads split the work */
#define W8_PAIRS 8                /* 32-column blocks per task (256 columns of y) */

/* 16 values of x from k (the lanes of m; zero elsewhere) as float32 (bfloat16: exactly). */
static inline __m512 w8_load16(const void *x, int bf16, int64_t k, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One row of x -> Kp int8 values (zero past K) and its scale. */
static void w8_quantize_row(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                            float *scale) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        const __m512 v = w8_load16(x, bf16, k, m);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float a = _mm512_reduce_max_ps(amax);
    float inv;
    if (!w8_row_prologue(x, bf16, K, Kp, q, a, !nan && !isinf(a), scale, &inv)) return;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        const __m512 v = w8_load16(x, bf16, k, m);
        /* round half to even (the default MXCSR mode), as torch.round */
        const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
        _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(i));
    }
}

/* Sums of one (32-row, 32-column) block -> y, scaled: rows m0 .. m0 + mr - 1, columns
 * n0 .. n0 + nc - 1 (mr, nc <= 32). */
static void w8_store(const int32_t (*c)[16][16], const float *sx, const uint16_t *sw, int64_t m0,
                     int64_t mr, int64_t n0, int64_t nc, void *y, int64_t ldy, int y_bf16) {
    for (int t = 0; t < 2; t++) { /* column half t: tiles t (rows 0..15) and 2 + t (16..31) */
        const int64_t cols = nc - 16 * t;
        if (cols <= 0) break;
        const __mmask16 mask = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
        const __m256i h = _mm256_maskz_loadu_epi16(mask, sw + n0 + 16 * t);
        const __m512 ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        for (int64_t i = 0; i < mr; i++) {
            const int32_t *row = c[(i >= 16 ? 2 : 0) + t][i & 15];
            const __m512 s = _mm512_cvtepi32_ps(_mm512_loadu_si512(row));
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx[m0 + i])), ws);
            const int64_t at = (m0 + i) * ldy + n0 + 16 * t;
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, hkv_f32x16_to_bf16(v));
            else
                _mm512_mask_storeu_ps((float *)y + at, mask, v);
        }
    }
}

/* The sums of rows m0 .. m0 + mr - 1 (mr <= 32) and columns 32 p .. 32 p + 31 -> y: two A
 * tiles of xq (rows) against the B tiles of column blocks 2p and 2p + 1, 64 k a step. */
static void w8_block(const int8_t *xq, const float *sx, int64_t m0, int64_t mr, int64_t Kp,
                     const int8_t *wp, const uint16_t *sw, int64_t N, int64_t p, void *y,
                     int64_t ldy, int y_bf16) {
    const int64_t KB = Kp / 64, n0 = 32 * p, nc = N - n0 < 32 ? N - n0 : 32;
    const int two_cols = nc > 16, two_rows = mr > 16;
    const int8_t *B0 = wp + (2 * p) * KB * 1024, *B1 = B0 + KB * 1024;
    const int8_t *A0 = xq + m0 * Kp, *A1 = A0 + 16 * Kp;
    int32_t c[4][16][16];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_loadd(4, A0 + 64 * kb, Kp);
        _tile_loadd(6, B0 + 1024 * kb, 64);
        _tile_dpbssd(0, 4, 6);
        if (two_cols) {
            _tile_loadd(7, B1 + 1024 * kb, 64);
            _tile_dpbssd(1, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, A1 + 64 * kb, Kp);
            _tile_dpbssd(2, 5, 6);
            if (two_cols) _tile_dpbssd(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    if (two_cols) _tile_stored(1, c[1], 64);
    if (two_rows) _tile_stored(2, c[2], 64);
    if (two_rows && two_cols) _tile_stored(3, c[3], 64);
    w8_store((const int32_t(*)[16][16])c, sx, sw, m0, mr, n0, nc, y, ldy, y_bf16);
}

/* y = w8a8(x) (the top of this file). Returns 0, or -1: no tiles here / no memory. */
int hkv_w8a8_linear(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *wp,
                    const uint16_t *sw, int64_t N, void *y, int64_t ldy, int y_bf16) {
    if (!hkv_amx_ready()) return -1;
    const int64_t Kp = (K + 63) / 64 * 64, Mp = (M + 31) / 32 * 32; /* A tiles read 32 rows */
    int8_t *xq = aligned_alloc(64, (size_t)(Mp * Kp + 64));
    float *sx = malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    if (xq == NULL || sx == NULL) {
        free(xq), free(sx);
        return -1;
    }
    memset(xq + M * Kp, 0, (size_t)((Mp - M) * Kp)); /* rows past M: zero sums, not stored */
    /* Tasks: W8_PAIRS column-block pairs (their B tiles, 2 KiB per 64 k, stay in L2) by
     * every 32-row block of x in turn (its two A tiles in L1 for the task's pairs): y is
     * written a row's W8_PAIRS * 32 columns at a time. */
    const int64_t pairs = (N + 31) / 32, esz = x_bf16 ? 2 : 4;
    const int64_t tasks = (pairs + W8_PAIRS - 1) / W8_PAIRS;
    const int parallel = N * K >= W8_PARALLEL_MIN;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            w8_quantize_row((const char *)x + m * ldx * esz, x_bf16, K, Kp, xq + m * Kp, sx + m);
        hkv_tiles_16x64();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t p1 = (t + 1) * W8_PAIRS < pairs ? (t + 1) * W8_PAIRS : pairs;
            for (int64_t m0 = 0; m0 < M; m0 += 32)
                for (int64_t p = t * W8_PAIRS; p < p1; p++)
                    w8_block(xq, sx, m0, M - m0 < 32 ? M - m0 : 32, Kp, wp, sw, N, p, y, ldy,
                             y_bf16);
        }
        _tile_release();
    }
    free(xq), free(sx);
    return 0;
}

#else /* no AMX-INT8 in this build */

int hkv_w8a8_linear(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, const int8_t *wp,
                    const uint16_t *sw, int64_t N, void *y, int64_t ldy, int y_bf16) {
    (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)wp, (void)sw, (void)N, (void)y;
    (void)ldy, (void)y_bf16;
    return -1;
}

#endif

/* ---- The vector kernels' driver (AVX2, NEON): quantize every row of x, then register tiles --
 * of up to `rows` rows of x by 16 columns, the threads splitting the 16-column blocks (each
 * block's weights, K bytes per column, read once per `rows` rows of x). */

#if HKV_AVX2 || HKV_NEON
/* One row of x -> Kp int8 values (zero past K) and its scale (the top of this file). */
typedef void (*w8_quantize_fn)(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                               float *scale);
/* Columns 16 nb .. 16 nb + 15 of y for the quantized rows m0 .. m0 + mr - 1 (xq [M][Kp], sx
 * [M]): (xq, sx, m0, mr, Kp, wp, sw, N, nb, y, ldy, y_bf16). */
typedef void (*w8_tile_fn)(const int8_t *, const float *, int64_t, int64_t, int64_t,
                           const int8_t *, const uint16_t *, int64_t, int64_t, void *, int64_t,
                           int);

#define W8_VECTOR_PARALLEL_MIN (1 << 18) /* weights (N * K) from which the threads split */

/* y = w8a8(x) (the arguments and result of hkv_w8a8_linear) with this ISA's `quantize` and
 * `tile` of up to `rows` rows. 0, or -1: no memory. */
static int w8_vector_run(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         const int8_t *wp, const uint16_t *sw, int64_t N, void *y, int64_t ldy,
                         int y_bf16, w8_quantize_fn quantize, w8_tile_fn tile, int64_t rows) {
    const int64_t Kp = (K + 63) / 64 * 64, NB = (N + 15) / 16, esz = x_bf16 ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * Kp + 64));
    float *sx = malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    if (xq == NULL || sx == NULL) {
        free(xq), free(sx);
        return -1;
    }
    const int parallel = N * K >= W8_VECTOR_PARALLEL_MIN;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize((const char *)x + m * ldx * esz, x_bf16, K, Kp, xq + m * Kp, sx + m);
#pragma omp for schedule(dynamic, 4)
        for (int64_t nb = 0; nb < NB; nb++)
            for (int64_t m0 = 0; m0 < M; m0 += rows)
                tile(xq, sx, m0, M - m0 < rows ? M - m0 : rows, Kp, wp, sw, N, nb, y, ldy,
                     y_bf16);
    }
    free(xq), free(sx);
    return 0;
}
#endif

/* ---- AVX2: the same packed weight, 8-bit products on 256-bit vectors ------------------------
 *
 * A row r of a B tile holds, for 16 columns n, the 4 weights of k = 4r .. 4r + 3: the layout
 * of a 4-wide dot product per 32-bit lane. So x's 4 values of those k are broadcast to every
 * lane and multiplied with the row, 8 columns per vector. vpmaddubsw multiplies unsigned by
 * signed bytes into pairs of 16-bit sums: x's magnitudes as the unsigned side and its signs
 * moved onto the weights (vpsignb: negated where x < 0, zero where x = 0), so no pair leaves
 * 16 bits (2 x 127 x 127 < 2^15; no weight is -128); vpmaddwd with ones sums the pairs into
 * the lane's int32 (with AVX-VNNI, vpdpbusd does both and adds). Exact, as the tiles: the same
 * sums, the same scaling, the same result bit for bit. Register tiles of W8_AVX2_ROWS rows of x
 * by 16 columns; threads split the 16-column blocks, each block's weights (K bytes per
 * column) read once per W8_AVX2_ROWS rows of x. */

#if HKV_AVX2
#include <immintrin.h>

#define W8_AVX2_ROWS 4

/* One row of x -> Kp int8 values (zero past K) and its scale (the top of this file). */
static void w8_quantize_row_avx2(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                 float *scale) {
    /* max |x| and whether any value is not finite (an infinity makes the max infinite) */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = bf16 ? hkv_bf16x8_load((const uint16_t *)x + k)
                              : _mm256_loadu_ps((const float *)x + k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float a = 0.0f;
    for (int i = 0; i < 8; i++) a = lanes[i] > a ? lanes[i] : a;
    int bad = _mm256_movemask_ps(nan) != 0;
    for (; k < K; k++) {
        const float v = bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        bad |= isnan(v);
        a = fabsf(v) > a ? fabsf(v) : a;
    }
    bad |= isinf(a);
    float inv;
    if (!w8_row_prologue(x, bf16, K, Kp, q, a, !bad, scale, &inv)) return;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= K; k += 8) {
        const __m256 v = bf16 ? hkv_bf16x8_load((const uint16_t *)x + k)
                              : _mm256_loadu_ps((const float *)x + k);
        const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv)); /* nearest even */
        const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(h, h));
    }
    for (; k < K; k++) { /* the same rounding, one at a time */
        const float v = bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        const __m128i i = _mm_cvtps_epi32(_mm_set_ss(v * inv));
        q[k] = (int8_t)_mm_cvtsi128_si32(i);
    }
}

static inline __m256i w8_dot4(__m256i acc, __m256i w, __m256i xb) {
#if HKV_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(acc, _mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
#else
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* y[row + n0 .. n0 + 7] (those below N) = ((float) sums * sx) * sw[n], the reference's order,
 * rounded once to y's dtype. */
static void w8_avx2_store8(__m256i sums, float sx, const uint16_t *sw, int64_t N, int64_t n0,
                           void *y, int64_t row, int y_bf16) {
    const int64_t cols = N - n0 < 8 ? N - n0 : 8;
    if (cols <= 0) return;
    __m256 ws;
    if (cols == 8) {
        ws = hkv_bf16x8_load(sw + n0);
    } else {
        uint16_t part[8] = {0};
        memcpy(part, sw + n0, 2 * (size_t)cols);
        ws = hkv_bf16x8_load(part);
    }
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(sx)), ws);
    const int64_t at = row + n0;
    if (y_bf16) {
        const __m128i b = hkv_f32x8_to_bf16(v);
        if (cols == 8) _mm_storeu_si128((__m128i *)((uint16_t *)y + at), b);
        else {
            uint16_t part[8];
            _mm_storeu_si128((__m128i *)part, b);
            memcpy((uint16_t *)y + at, part, 2 * (size_t)cols);
        }
    } else if (cols == 8) {
        _mm256_storeu_ps((float *)y + at, v);
    } else {
        float part[8];
        _mm256_storeu_ps(part, v);
        memcpy((float *)y + at, part, 4 * (size_t)cols);
    }
}

/* Columns 16 nb .. 16 nb + 15 for rows m0 .. m0 + mr - 1 (mr <= W8_AVX2_ROWS). */
static void w8_avx2_tile(const int8_t *xq, const float *sx, int64_t m0, int64_t mr, int64_t Kp,
                         const int8_t *wp, const uint16_t *sw, int64_t N, int64_t nb, void *y,
                         int64_t ldy, int y_bf16) {
    const int64_t KB = Kp / 64, NB = (N + 15) / 16;
    const int8_t *W = wp + nb * KB * 1024;
    __m256i acc[W8_AVX2_ROWS][2];
    for (int i = 0; i < W8_AVX2_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    /* The next block's weights, a line per step (one line per row r): decode steps stream the
     * weights from memory, and the hardware prefetcher alone kept this loop at about two
     * thirds of the int8 kernel's pace there (the 100m model at batch 1, AVX2 build). */
    const int8_t *ahead = nb + 1 < NB ? W + KB * 1024 : W;
    for (int64_t kr = 0; kr < KB * 16; kr++) { /* rows r of the tiles, 4 k each */
        const int8_t *row = W + (kr >> 4) * 1024 + (kr & 15) * 64;
        _mm_prefetch((const char *)(ahead + (row - W)), _MM_HINT_T1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)row);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(row + 32));
        const int64_t at = (kr >> 4) * 64 + (kr & 15) * 4;
        for (int64_t i = 0; i < mr; i++) {
            int32_t four;
            memcpy(&four, xq + (m0 + i) * Kp + at, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            acc[i][0] = w8_dot4(acc[i][0], w0, xb);
            acc[i][1] = w8_dot4(acc[i][1], w1, xb);
        }
    }
    for (int64_t i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) w8_avx2_store8(acc[i][h], sx[m0 + i], sw, N, 16 * nb + 8 * h,
                                                   y, (m0 + i) * ldy, y_bf16);
}

/* y = w8a8(x) with AVX2 (the same arguments and result as hkv_w8a8_linear). 0, or -1: no
 * memory. */
int hkv_w8a8_linear_avx2(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         const int8_t *wp, const uint16_t *sw, int64_t N, void *y, int64_t ldy,
                         int y_bf16) {
    return w8_vector_run(x, ldx, x_bf16, M, K, wp, sw, N, y, ldy, y_bf16, w8_quantize_row_avx2,
                         w8_avx2_tile, W8_AVX2_ROWS);
}

#else /* no AVX2: no kernel (the PyTorch reference runs) */

int hkv_w8a8_linear_avx2(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         const int8_t *wp, const uint16_t *sw, int64_t N, void *y, int64_t ldy,
                         int y_bf16) {
    (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)wp, (void)sw, (void)N, (void)y;
    (void)ldy, (void)y_bf16;
    return -1;
}

#endif

/* ---- AVX-512 VNNI: a whole row r of a B tile per vector ------------------------------------
 *
 * A row r of a B tile (64 bytes: 16 columns x the 4 weights of k = 4r .. 4r + 3) is one 512-bit
 * vector, the layout of vpdpbusd (each 32-bit lane adds the products of its 4 unsigned bytes
 * with the same lane's 4 signed bytes). Its unsigned side is x: the quantized row is stored as
 * xq + 128 (xq ^ 0x80: 1..255, zero padding 128), broadcast 4 bytes to every lane, so one
 * instruction adds 16 columns' 4 products; sum((xq + 128) w) - 128 sum(w) is the exact sum, the
 * second term made once per tile and k step by a vpdpbusd of 128s with the same weights and
 * shared by the tile's rows (|sums| <= 255 x 127 x K: exact in int32 up to K = 66,000). Register
 * tiles of W8_VNNI_ROWS rows of x by 16 columns; the scaling and rounding are the AVX2
 * kernel's (w8_avx2_store8), so the result is the reference's bit for bit. Ice Lake, Cascade
 * Lake, Zen 4 and Sapphire Rapids without the tile permission run it; AMX-INT8 goes first. */

#if HKV_AVX512_VNNI && HKV_AVX2

#define W8_VNNI_ROWS 8

/* w8_quantize_row_avx2's row, moved to the unsigned side: xq + 128 */
static void w8_quantize_row_vnni(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                 float *scale) {
    w8_quantize_row_avx2(x, bf16, K, Kp, q, scale);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < Kp; k += 64) /* Kp is a multiple of 64 */
        _mm512_storeu_si512(q + k, _mm512_xor_si512(_mm512_loadu_si512(q + k), flip));
}

/* Columns 16 nb .. 16 nb + 15 for rows m0 .. m0 + mr - 1 (mr <= W8_VNNI_ROWS). */
static void w8_vnni_tile(const int8_t *xq, const float *sx, int64_t m0, int64_t mr, int64_t Kp,
                         const int8_t *wp, const uint16_t *sw, int64_t N, int64_t nb, void *y,
                         int64_t ldy, int y_bf16) {
    const int64_t KB = Kp / 64, NB = (N + 15) / 16;
    const int8_t *W = wp + nb * KB * 1024;
    const __m512i offset = _mm512_set1_epi8((char)0x80); /* 128 as the unsigned side */
    __m512i acc[W8_VNNI_ROWS], shift = _mm512_setzero_si512();
    for (int i = 0; i < W8_VNNI_ROWS; i++) acc[i] = _mm512_setzero_si512();
    const int8_t *ahead = nb + 1 < NB ? W + KB * 1024 : W; /* as the AVX2 tile: a line a step */
    for (int64_t kr = 0; kr < KB * 16; kr++) {             /* rows r of the tiles, 4 k each */
        const int8_t *row = W + (kr >> 4) * 1024 + (kr & 15) * 64;
        _mm_prefetch((const char *)(ahead + (row - W)), _MM_HINT_T1);
        const __m512i w = _mm512_loadu_si512(row);
        shift = _mm512_dpbusd_epi32(shift, offset, w); /* 128 sum(w) per column */
        const int64_t at = (kr >> 4) * 64 + (kr & 15) * 4;
        for (int64_t i = 0; i < mr; i++) {
            int32_t four;
            memcpy(&four, xq + (m0 + i) * Kp + at, 4);
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), w);
        }
    }
    for (int64_t i = 0; i < mr; i++) {
        const __m512i sums = _mm512_sub_epi32(acc[i], shift);
        for (int h = 0; h < 2; h++)
            w8_avx2_store8(h ? _mm512_extracti64x4_epi64(sums, 1) : _mm512_castsi512_si256(sums),
                           sx[m0 + i], sw, N, 16 * nb + 8 * h, y, (m0 + i) * ldy, y_bf16);
    }
}

int hkv_w8a8_linear_avx512_vnni(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                                const int8_t *wp, const uint16_t *sw, int64_t N, void *y,
                                int64_t ldy, int y_bf16) {
    return w8_vector_run(x, ldx, x_bf16, M, K, wp, sw, N, y, ldy, y_bf16, w8_quantize_row_vnni,
                         w8_vnni_tile, W8_VNNI_ROWS);
}

#else /* no AVX-512 VNNI in this build */

int hkv_w8a8_linear_avx512_vnni(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                                const int8_t *wp, const uint16_t *sw, int64_t N, void *y,
                                int64_t ldy, int y_bf16) {
    (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)wp, (void)sw, (void)N, (void)y;
    (void)ldy, (void)y_bf16;
    return -1;
}

#endif

/* ---- aarch64 NEON: the same packed weight, 4-wide dot products -----------------------------
 *
 * A row r of a B tile (64 bytes: 16 columns n x the 4 weights of k = 4r .. 4r + 3) is four
 * 128-bit vectors of 4 columns each, the layout of sdot (vdotq_s32: each 32-bit lane adds the
 * dot product of its 4 bytes with the same lane's 4 bytes of the other operand). x's 4 values
 * of those k are replicated to every lane, so one sdot adds 4 columns' 4 products. Without the
 * dot product (ARMv8.0 cores: Cortex-A72, Graviton 1) vmull_s8 makes the 16 products of a
 * vector in 16 bits (|p| <= 128 x 127: xq is never -128), vpaddq_s16 adds neighbours (2 x 128
 * x 127 < 2^15: still exact) and vpadalq_s16 adds each column's two pairs into its 32-bit
 * lane: the same lanes as sdot. Both sums exact, the quantizer and the scaling as the tiles': the same result
 * bit for bit. Register tiles of up to W8_NEON_ROWS rows of x by 16 columns (16 accumulators,
 * 4 weight vectors); threads split the 16-column blocks, as the AVX2 kernel does. */

#if HKV_NEON
#include <arm_neon.h>

#define W8_NEON_ROWS 4

/* 4 values of x from k as float32 (bfloat16: exactly, each shifted into the top half). */
static inline float32x4_t w8_neon_load4(const void *x, int bf16, int64_t k) {
    if (!bf16) return vld1q_f32((const float *)x + k);
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)x + k), 16));
}

static inline float w8_neon_at(const void *x, int bf16, int64_t k) {
    return bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
}

/* max |x[0 .. K - 1]|: NaN where any value is NaN (fmax keeps NaN), infinite with an infinity */
static float w8_neon_absmax(const void *x, int bf16, int64_t K) {
    float32x4_t amax = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) amax = vmaxq_f32(amax, vabsq_f32(w8_neon_load4(x, bf16, k)));
    float a = vmaxvq_f32(amax);
    for (; k < K; k++) {
        const float v = fabsf(w8_neon_at(x, bf16, k));
        a = isnan(v) || v > a ? v : a;
    }
    return a;
}

/* One row of x -> Kp int8 values (zero past K) and its scale (the top of this file). */
static void w8_quantize_row_neon(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                 float *scale) {
    const float a = w8_neon_absmax(x, bf16, K);
    float inv;
    if (!w8_row_prologue(x, bf16, K, Kp, q, a, isfinite(a), scale, &inv)) return;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) { /* fcvtns: round to nearest, ties to even (torch.round) */
        const int32x4_t lo = vcvtnq_s32_f32(vmulq_n_f32(w8_neon_load4(x, bf16, k), inv));
        const int32x4_t hi = vcvtnq_s32_f32(vmulq_n_f32(w8_neon_load4(x, bf16, k + 4), inv));
        vst1_s8(q + k, vqmovn_s16(vcombine_s16(vqmovn_s32(lo), vqmovn_s32(hi))));
    }
    for (; k < K; k++) q[k] = (int8_t)vcvtns_s32_f32(w8_neon_at(x, bf16, k) * inv);
}

/* acc lane c += the dot product of w's 4 bytes of lane c with xb's (the same 4 in each lane). */
static inline __attribute__((always_inline)) int32x4_t w8_neon_dot4(int32x4_t acc, int8x16_t w,
                                                                    int8x16_t xb, int sdot) {
#if HKV_NEON_DOT
    if (sdot) return vdotq_s32(acc, w, xb);
#endif
    (void)sdot;
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(xb)); /* columns 0, 1: 4 each */
    const int16x8_t hi = vmull_high_s8(w, xb);                      /* columns 2, 3 */
    return vpadalq_s16(acc, vpaddq_s16(lo, hi)); /* pairs of pairs: one sum per column */
}

/* acc[i][c] = the sums of row i of xq (i < rows) with columns 4c .. 4c + 3 of the block whose
 * tiles start at W (KB tiles of 1 KiB: tile row kr = kb * 16 + r at W + 64 kr, k = 4 kr). */
static inline __attribute__((always_inline)) void w8_neon_sums(const int8_t *xq, int64_t Kp,
                                                               const int8_t *W, int64_t KB,
                                                               int rows, int sdot,
                                                               int32x4_t acc[][4]) {
    /* local sums, their loops unrolled early (before GCC's scalar replacement): so they stay
     * in registers (acc, which the int8 loads may alias, would be stored at every step) */
    int32x4_t a[W8_NEON_ROWS][4];
    _Pragma("GCC unroll 4") for (int i = 0; i < rows; i++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) a[i][c] = vdupq_n_s32(0);
    for (int64_t kr = 0; kr < KB * 16; kr++) {
        const int8x16x4_t w = vld1q_s8_x4(W + 64 * kr);
        _Pragma("GCC unroll 4") for (int i = 0; i < rows; i++) {
            int32_t four; /* xq[i, 4 kr .. 4 kr + 3] */
            memcpy(&four, xq + i * Kp + 4 * kr, 4);
            const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(four));
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                a[i][c] = w8_neon_dot4(a[i][c], w.val[c], xb, sdot);
        }
    }
    memcpy(acc, a, sizeof(int32x4_t) * 4 * (size_t)rows);
}

/* hkv_f32_to_bf16 of 4 values (nearest even, NaN -> 0x7fc0). */
static inline uint16x4_t w8_neon_to_bf16(float32x4_t v) {
    const uint32x4_t bits = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
    return vmovn_u32(vbslq_u32(nan, vdupq_n_u32(0x7fc0), r));
}

/* y[m0 + i, n0 .. n0 + 15] (i < mr, columns < N) = (sum * sx[m0 + i]) * sw[n], rounded once. */
static void w8_neon_store(int32x4_t acc[][4], const float *sx, int64_t m0, int64_t mr,
                          const uint16_t *sw, int64_t N, int64_t n0, void *y, int64_t ldy,
                          int y_bf16) {
    for (int c = 0; c < 4; c++) {
        const int64_t n = n0 + 4 * c, cols = N - n < 4 ? N - n : 4;
        if (cols <= 0) break;
        uint16_t s[4] = {0};
        memcpy(s, sw + n, 2 * (size_t)cols);
        const float32x4_t ws = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(s), 16));
        for (int64_t i = 0; i < mr; i++) {
            const float32x4_t v = vmulq_f32(vmulq_n_f32(vcvtq_f32_s32(acc[i][c]), sx[m0 + i]), ws);
            const int64_t at = (m0 + i) * ldy + n;
            if (y_bf16) {
                uint16_t b[4];
                vst1_u16(b, w8_neon_to_bf16(v));
                memcpy((uint16_t *)y + at, b, 2 * (size_t)cols);
            } else if (cols == 4) {
                vst1q_f32((float *)y + at, v);
            } else {
                float f[4];
                vst1q_f32(f, v);
                memcpy((float *)y + at, f, 4 * (size_t)cols);
            }
        }
    }
}

/* Columns 16 nb .. 16 nb + 15 of rows m0 .. m0 + mr - 1 (mr <= W8_NEON_ROWS): the sums with
 * a constant row count (the accumulators stay in registers), then y. */
static inline __attribute__((always_inline)) void w8_neon_block(
    const int8_t *xq, const float *sx, int64_t m0, int64_t mr, int64_t Kp, const int8_t *wp,
    const uint16_t *sw, int64_t N, int64_t nb, void *y, int64_t ldy, int y_bf16, int sdot) {
    const int64_t KB = Kp / 64;
    const int8_t *W = wp + nb * KB * 1024, *X = xq + m0 * Kp;
    int32x4_t acc[W8_NEON_ROWS][4];
    switch (mr) {
    case 1: w8_neon_sums(X, Kp, W, KB, 1, sdot, acc); break;
    case 2: w8_neon_sums(X, Kp, W, KB, 2, sdot, acc); break;
    case 3: w8_neon_sums(X, Kp, W, KB, 3, sdot, acc); break;
    default: w8_neon_sums(X, Kp, W, KB, W8_NEON_ROWS, sdot, acc); break;
    }
    w8_neon_store(acc, sx, m0, mr, sw, N, 16 * nb, y, ldy, y_bf16);
}

static void w8_neon_block_plain(const int8_t *xq, const float *sx, int64_t m0, int64_t mr,
                                int64_t Kp, const int8_t *wp, const uint16_t *sw, int64_t N,
                                int64_t nb, void *y, int64_t ldy, int y_bf16) {
    w8_neon_block(xq, sx, m0, mr, Kp, wp, sw, N, nb, y, ldy, y_bf16, 0);
}

#if HKV_NEON_DOT
static void w8_neon_block_sdot(const int8_t *xq, const float *sx, int64_t m0, int64_t mr,
                               int64_t Kp, const int8_t *wp, const uint16_t *sw, int64_t N,
                               int64_t nb, void *y, int64_t ldy, int y_bf16) {
    w8_neon_block(xq, sx, m0, mr, Kp, wp, sw, N, nb, y, ldy, y_bf16, 1);
}
#endif

/* y = w8a8(x) with NEON's 16-bit products (any aarch64 CPU). */
int hkv_w8a8_linear_neon(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         const int8_t *wp, const uint16_t *sw, int64_t N, void *y, int64_t ldy,
                         int y_bf16) {
    return w8_vector_run(x, ldx, x_bf16, M, K, wp, sw, N, y, ldy, y_bf16, w8_quantize_row_neon,
                         w8_neon_block_plain, W8_NEON_ROWS);
}
#endif /* HKV_NEON */

#if HKV_NEON_DOT
/* y = w8a8(x) with sdot (ARMv8.2's dot product: Neoverse N1 / V1 / V2, Graviton 2+, Apple M). */
int hkv_w8a8_linear_neon_dot(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                             const int8_t *wp, const uint16_t *sw, int64_t N, void *y,
                             int64_t ldy, int y_bf16) {
    return w8_vector_run(x, ldx, x_bf16, M, K, wp, sw, N, y, ldy, y_bf16, w8_quantize_row_neon,
                         w8_neon_block_sdot, W8_NEON_ROWS);
}
#else /* no dot product in this build (or no NEON): no kernel */
int hkv_w8a8_linear_neon_dot(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                             const int8_t *wp, const uint16_t *sw, int64_t N, void *y,
                             int64_t ldy, int y_bf16) {
    (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)wp, (void)sw, (void)N, (void)y;
    (void)ldy, (void)y_bf16;
    return -1;
}
#endif

#if !HKV_NEON
int hkv_w8a8_linear_neon(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K,
                         const int8_t *wp, const uint16_t *sw, int64_t N, void *y, int64_t ldy,
                         int y_bf16) {
    (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)wp, (void)sw, (void)N, (void)y;
    (void)ldy, (void)y_bf16;
    return -1;
}
#endif
