/* int8 weight-only linear on the CPU (quantization="int8"): y = x @ (q * scale)^T.
 * hybridkv/layers/quantization.py is the reference (and says what is quantized and how); this
 * file is compiled into the one native library with kernels.c and declared by
 * hybridkv/ops/native/int8_linear.py.
 *
 *     x      [M, K] float32 or bfloat16 rows at a row stride (unit column stride)
 *     q      [N, K] int8, contiguous (the weight, one row per output)
 *     scale  [N] bfloat16 (the per-row scale the weight was rounded against)
 *     y      [M, N] float32 or bfloat16 rows at a row stride
 *
 * The math is float32: each int8 weight converted to float32 in a register and reused for
 * several rows of x, float32 products (exact for bfloat16 x: 8 x 7 significant bits) summed in
 * float32, the row's scale applied once to the sum (it factors out of the dot product),
 * rounded once to y's dtype. So a float32 model gets the dequantized weight's product to
 * float32 rounding (no bfloat16 step). Two paths, with AVX-512 (F, BW, VL):
 *
 * The streaming path, M <= I8_SMALL_M rows of x (or x of at most I8_STREAM_X values): decode
 * steps, bound by reading the weight (1 byte per multiply-add at M = 1). Each weight row is
 * read from memory once per call and used for every row of x: register tiles of MB rows of x
 * by NB weight rows (M = 1: 1 x 16, M = 2: 2 x 8, else 4 x 4 and a last tile of M % 4 rows),
 * MB * NB <= 16 accumulators of 16 float32 lanes reduced together by a transposing tree (31
 * shuffles and adds, not 16 horizontal reductions). The NB rows go in groups of I8_G = 4, one
 * group after the other, the rows of a group side by side: per step, 16 values of k of each
 * row widened (vpmovsxbd from memory, vcvtdq2ps) and multiplied with the MB rows of x, masked
 * loads for the last K % 16. A thread's blocks of NB rows are one contiguous range of q. Two
 * software prefetches keep memory busy: a far one into L2, I8_FAR bytes past the block's
 * start, the block's size in bytes spread evenly over all its steps (all its tiles: memory
 * streams at one pace whatever M), and a near one into L1, I8_NEAR bytes ahead of each row's
 * loads. bfloat16 x is widened to float32 once per call (exactly) and takes the same tiles.
 *
 * Measured on the development CPU (Xeon, 2 cores, AVX-512; 1 thread, weights out of cache:
 * 768 -> 3224 and 1536 -> 768, for the row orders also 768 -> 256, 4096 -> 1024 and
 * 14336 -> 256; benchmarks/README.md has the tables). Before this path (the chunked tiles below
 * at every M, with a T0 prefetch of the next block only) M = 1 read 9.0-10.3 GB/s where the
 * float32 kernel (f32_linear.c) read 13.2-13.7 (2 threads: 16 vs 25): too few lines in flight.
 * The far prefetch is what fixes it: without it this path is 28-44% slower at M = 1 (33-52% at
 * M = 4), without any software prefetch about 2x; the near one gains 2-4%; near distances of
 * 512-4096 bytes and far ones of 8-32 KiB are within 2% of each other. Groups of 4 rows: the 16
 * rows of M = 1 all side by side were 12-43% slower (16 streams), 8 at M = 2 6-22% slower; one
 * row after the other (f32_linear.c's order; 4 sums per row for the FMA latency) was within 2%
 * on 768 -> 3224 and 4-12% slower elsewhere (x re-read for every row: 56 KiB of it at K =
 * 14336, more than L1). A float32 copy of the block, widened once and read by every tile of
 * rows, was 14-30% slower at M = 4 than widening per tile (2 uops per 16 weights and 4 rows of
 * x). From M = 4 on the path is bound by the vector ports (2 FMAs a cycle; vpmovsxbd on one of
 * the two ports): about a cycle per FMA with the weight in L2. bfloat16 x: vdpbf16ps runs at
 * one every 2 cycles here (32 products: the float32 FMAs' rate) and pairing the weights for it
 * costs 3 more uops per 32, hence the widening of x.
 *
 * The chunked path, more rows of x: register tiles of I8_MB rows of x by I8_NB weight rows,
 * each (row, column) pair summing 16 lanes along K (masked loads for the last K % 16), reduced
 * at the end: I8_MB x I8_NB sums + I8_NB weight vectors + 1 input vector fill 31 of the 32
 * registers; the weights in L2-sized chunks, each reused for 32 rows of x (bfloat16 x: pair
 * products, vdpbf16ps, with AVX512-BF16).
 *
 * OpenMP splits the weight rows into blocks (torch.set_num_threads applies: the same libgomp);
 * on the streaming path weights under I8_PARALLEL_MIN values run on the calling thread.
 *
 * AVX2 + FMA without AVX-512 (I8_AVX2): the streaming path on 8 lanes at up to I8_GEMM_M rows
 * of x: tiles of 1 x 8 (M = 1), 2 x 4 (M = 2), else 4 x 2 (the last of M % 4 rows), the
 * weight rows in groups of up to 4 side by side as above, 8 int8 weights per step widened
 * (vpmovsxbd from memory, vcvtdq2ps) and reused for the tile's rows of x, the same far and near
 * prefetches, the 8 sums reduced together (hkv_reduce8) and scaled once; the last K % 8 weights
 * through a zeroed copy (no masked byte loads), x's through vmaskmovps. Above I8_GEMM_M rows,
 * the AVX2 GEMM of f32_linear.c (hkv_avx2_gemm: q converted to float32 a block at a time,
 * the scale once per sum), which beats these tiles from 24 rows on. bfloat16 x is widened once
 * (exactly), as above. The same float32 math, so the tests' bounds are the same; no 8-bit
 * activations (AVX-VNNI's vpdpbusd would need x quantized: another result). Measured under
 * the AVX2 simulation (this Xeon: x86-64-v3 build, oneDNN and MKL capped at AVX2; 1 thread,
 * weights out of cache; benchmarks/README.md "AVX2"): M = 1 streams 768 -> 3224 in 0.26 ms
 * where the float32 kernel takes 0.85 and oneDNN's float32 1.14; M = 8-16 0.77-0.92x the
 * bfloat16 kernel's time; from 24 rows 0.87-1.0x it (the same GEMM, half the weight bytes;
 * 1.08x on the 32000-row lm_head at M = 512, whose float32 outputs are twice bfloat16's
 * bytes); against PyTorch's paths 0.17-0.22x their time at 24-64 rows (dequantize +
 * bfloat16 GEMM), 0.76-0.92x at 128 and 0.88-1.02x at 512 (float32 chunks).
 *
 * Without either a plain loop (hkv_int8_vectorized() says which was built, so the caller can
 * keep PyTorch's path instead). */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AVX512
#define I8_AVX512 1
#else
#define I8_AVX512 0
#endif
#if HKV_AVX2 && !HKV_AVX512
#define I8_AVX2 1 /* the streaming path on 8 lanes, at every M */
#else
#define I8_AVX2 0
#endif

#define I8_SMALL_M 16 /* rows of x up to which the streaming path runs */
#define I8_STREAM_X (64 * 1024) /* or x's values (256 KiB of float32, read for every block) */
#define I8_PARALLEL_MIN (64 * 1024) /* weights (64 KiB): below, one thread (streaming path) */
#define I8_G 4 /* weight rows read side by side */
#define I8_NEAR 2048 /* bytes: each row's prefetch into L1, ahead of its loads */
#define I8_FAR 16384 /* bytes: the stream's prefetch into L2, ahead of the block's start */
#define I8_CHUNK_BYTES (256 * 1024) /* int8 weights per chunk when M spans several tiles */
#define I8_M_CHUNK 32 /* rows of x (and y) per pass over the weights */
#define I8_GEMM_M 20 /* AVX2: rows of x above which hkv_avx2_gemm (f32_linear.c) runs instead */
#define I8_MB 4 /* rows of x per register tile */
#define I8_NB 6 /* weight rows (outputs) per register tile */
#define I8_INLINE static inline __attribute__((always_inline))
#define I8_UNROLL _Pragma("GCC unroll 8") /* whole tiles unrolled: the sums stay in registers */
#define I8_UNROLL16 _Pragma("GCC unroll 16") /* (streaming tiles: up to 16 sums) */

static inline float i8_load1(const void *x, int bf16, int64_t i) {
    return bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline void i8_store1(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = hkv_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

int hkv_int8_vectorized(void) { return I8_AVX512 || I8_AVX2; }

#if I8_AVX512

/* ---- the chunked path ---------------------------------------------------------------------- */

I8_INLINE __m512 i8_load_x(const void *x, int bf16, int64_t i, __mmask16 mask) {
    if (bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
}

I8_INLINE __m512 i8_load_w(const int8_t *q, int64_t i, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + i)));
}

/* The next block's weight rows, one cache line each, while the first rows of x run on this
 * block: with more than one tile of rows per block the hardware prefetcher loses the weight
 * streams (a 32000-row lm_head at M = 8 ran 5x slower than two calls of M = 4). Prefetches past
 * the last row are harmless (they never fault). */
#define I8_PREFETCH_NEXT(K_)                                                                 \
    I8_UNROLL for (int j = 0; j < I8_NB; j++)                                                \
        _mm_prefetch((const char *)(q + (n0 + I8_NB + j) * K + (K_)), _MM_HINT_T0)

/* acc[i][j] += x[m0 + i, k ..] . w[j] for 16 (or `mask`) values of k */
#define I8_STEP(MASK)                                                                        \
    do {                                                                                     \
        __m512 w[I8_NB];                                                                     \
        I8_UNROLL for (int j = 0; j < nb; j++) w[j] = i8_load_w(q, (n0 + j) * K + k, MASK);  \
        if (first && (k & 63) == 0) I8_PREFETCH_NEXT(k);                                     \
        I8_UNROLL for (int i = 0; i < mb; i++) {                                             \
            const __m512 xv = i8_load_x(x, xbf16, (m0 + i) * ldx + k, MASK);                 \
            I8_UNROLL for (int j = 0; j < nb; j++) acc[i][j] =                               \
                _mm512_fmadd_ps(xv, w[j], acc[i][j]);                                        \
        }                                                                                    \
    } while (0)

#if HKV_AVX512_BF16
/* bfloat16 x with AVX512-BF16: 32 values of k per step, each weight pair widened to bfloat16
 * (exact for |q| <= 127) and multiplied pairwise with vdpbf16ps, float32 sums: half the
 * multiply instructions of the float32 step */
#define I8_DPBF16 1
I8_INLINE __m512bh i8_load_w_bf16(const int8_t *q, int64_t i, __mmask32 mask) {
    const __m256i b = _mm256_maskz_loadu_epi8(mask, q + i);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo); /* k .. k + 15 in the low half */
}

I8_INLINE __m512bh i8_load_x_bf16(const void *x, int64_t i, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
}

#define I8_STEP_DP(MASK)                                                                     \
    do {                                                                                     \
        __m512bh w[I8_NB];                                                                   \
        I8_UNROLL for (int j = 0; j < nb; j++) w[j] =                                        \
            i8_load_w_bf16(q, (n0 + j) * K + k, MASK);                                       \
        if (first && (k & 63) == 0) I8_PREFETCH_NEXT(k);                                     \
        I8_UNROLL for (int i = 0; i < mb; i++) {                                             \
            const __m512bh xv = i8_load_x_bf16(x, (m0 + i) * ldx + k, MASK);                 \
            I8_UNROLL for (int j = 0; j < nb; j++) acc[i][j] =                               \
                _mm512_dpbf16_ps(acc[i][j], xv, w[j]);                                       \
        }                                                                                    \
    } while (0)
#else
#define I8_DPBF16 0
#endif

/* rows m0 .. m0 + mb - 1 of y, columns n0 .. n0 + nb - 1 (mb <= I8_MB, nb <= I8_NB); xbf16,
 * mb and nb are constants at every call, so the tile's sums stay in registers */
I8_INLINE void i8_tile(const void *x, int64_t ldx, const int xbf16, const int8_t *q,
                       const uint16_t *scale, int64_t K, void *y, int64_t ldy, int ybf16,
                       int64_t m0, int64_t n0, const int mb, const int nb, const int first) {
    __m512 acc[I8_MB][I8_NB];
    I8_UNROLL for (int i = 0; i < mb; i++) I8_UNROLL for (int j = 0; j < nb; j++) acc[i][j] =
        _mm512_setzero_ps();
    int64_t k = 0;
#if I8_DPBF16
    if (xbf16) {
        for (; k + 32 <= K; k += 32) I8_STEP_DP((__mmask32)0xffffffffu);
        if (k < K) I8_STEP_DP((__mmask32)((1ull << (K - k)) - 1));
        k = K;
    }
#endif
    for (; k + 16 <= K; k += 16) I8_STEP((__mmask16)0xffff);
    if (k < K) I8_STEP((__mmask16)((1u << (K - k)) - 1));
    I8_UNROLL for (int i = 0; i < mb; i++) I8_UNROLL for (int j = 0; j < nb; j++) {
            const float sum = _mm512_reduce_add_ps(acc[i][j]);
            i8_store1(y, ybf16, (m0 + i) * ldy + n0 + j, sum * hkv_bf16_to_f32(scale[n0 + j]));
        }
}

#define I8_TILE(XBF16, MB, NB)                                                               \
    i8_tile(x, ldx, XBF16, q, scale, K, y, ldy, ybf16, m0, n, MB, NB, m0 == m_lo)

/* every mb, for one input dtype: a full block of I8_NB outputs, or the last few one by one */
#define I8_ROWS(XBF16)                                                                       \
    do {                                                                                     \
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += I8_MB) {                                    \
            const int64_t mb = m_hi - m0 < I8_MB ? m_hi - m0 : I8_MB;                        \
            if (nb == I8_NB) {                                                               \
                const int64_t n = n0;                                                        \
                switch (mb) {                                                                \
                case 1: I8_TILE(XBF16, 1, I8_NB); break;                                     \
                case 2: I8_TILE(XBF16, 2, I8_NB); break;                                     \
                case 3: I8_TILE(XBF16, 3, I8_NB); break;                                     \
                default: I8_TILE(XBF16, I8_MB, I8_NB); break;                                \
                }                                                                            \
            } else {                                                                         \
                for (int64_t n = n0; n < n0 + nb; n++) {                                     \
                    switch (mb) {                                                            \
                    case 1: I8_TILE(XBF16, 1, 1); break;                                     \
                    case 2: I8_TILE(XBF16, 2, 1); break;                                     \
                    case 3: I8_TILE(XBF16, 3, 1); break;                                     \
                    default: I8_TILE(XBF16, I8_MB, 1); break;                                \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* rows m_lo .. m_hi - 1 of y, outputs n0 .. n0 + nb - 1 (the chunked path) */
static void i8_block(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t m_lo, int64_t m_hi, int64_t K, void *y,
                     int64_t ldy, int ybf16, int64_t n0, int64_t nb) {
    if (xbf16)
        I8_ROWS(1);
    else
        I8_ROWS(0);
}

/* ---- the streaming path ------------------------------------------------------------------ */

/* 16 int8 weights at P widened to float32: vpmovsxbd from memory, vcvtdq2ps (MASK: the first
 * values only, zeros past them; never reads past them) */
#define I8_W(MASK, P) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(P))))
#define I8_WZ(MASK, P) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(MASK, P)))
#define I8_X(MASK, P) _mm512_loadu_ps(P)
#define I8_XZ(MASK, P) _mm512_maskz_loadu_ps(MASK, P)

/* bfloat16 rows x [M, K] (row stride ldx) -> float32 xw [M, ldw] (exact) */
static void i8_widen_x(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xw,
                       int64_t ldw) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            const __m256i h = _mm256_maskz_loadu_epi16(mask, x + m * ldx + k);
            const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_mask_storeu_ps(xw + m * ldw + k, mask, _mm512_castsi512_ps(bits));
        }
}

/* A block's far prefetch: `lines` cache lines from `at` on, spread evenly (Bresenham) over
 * its `total` steps (lines <= total: a step reads 4 rows x 16 weights, one line's worth) */
typedef struct {
    const char *at;
    int64_t debt, lines, total;
} I8Far;

/* one step of group g (weight rows g * I8_G ..): acc[i * NB + g * I8_G + j] += x[row i, K0 ..
 * K0 + 15] * w[row g * I8_G + j, same], each weight vector widened once for the mb rows of x */
#define I8S_STEP(K0, WLOAD, XLOAD, MASK)                                                     \
    do {                                                                                     \
        __m512 wv[I8_G];                                                                     \
        I8_UNROLL16 for (int j = 0; j < G; j++) wv[j] = WLOAD(MASK, wr[g * G + j] + (K0));   \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        I8_UNROLL16 for (int i = 0; i < mb; i++) {                                           \
            const __m512 xv = XLOAD(MASK, xr + i * ldx + (K0));                              \
            I8_UNROLL16 for (int j = 0; j < G; j++) acc[i * NB + g * G + j] =                \
                _mm512_fmadd_ps(xv, wv[j], acc[i * NB + g * G + j]);                         \
        }                                                                                    \
    } while (0)

/* rows m0 .. m0 + mb - 1 of y by columns n0 .. n0 + nb - 1 (nb <= NB, mb * NB <= 16; mb and NB
 * constants at every call; weight rows past nb read the last one again, their sums dropped).
 * The NB weight rows go in groups of G = min(NB, I8_G), one group after the other, the rows of
 * a group side by side: 16 values of k of each per step, widened once for all mb rows of x;
 * the near prefetch (into L1) runs I8_NEAR bytes ahead of each row's loads, and every step
 * takes its turn in the block's far prefetch */
I8_INLINE void i8s_tile(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                        int64_t K, void *y, int64_t ldy, int ybf16, int64_t m0, int64_t n0,
                        int64_t nb, const int mb, const int NB, I8Far *far) {
    const int G = NB < I8_G ? NB : I8_G;
    const float *xr = x + m0 * ldx;
    const int8_t *wr[16];
    I8_UNROLL16 for (int j = 0; j < NB; j++) wr[j] = q + (n0 + (j < nb ? j : nb - 1)) * K;
    const char *pf = far->at;
    int64_t debt = far->debt;
    const int64_t lines = far->lines, total = far->total;
    const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1);
    __m512 acc[16];
    I8_UNROLL16 for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    I8_UNROLL16 for (int g = 0; g < NB / G; g++) {
        if (g * G >= nb) break; /* (the last block: groups of rows past N) */
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) { /* a cache line of each row of the group */
            I8_UNROLL16 for (int j = 0; j < G; j++)
                _mm_prefetch((const char *)(wr[g * G + j] + k) + I8_NEAR, _MM_HINT_T0);
            I8_UNROLL16 for (int v = 0; v < 4; v++) I8S_STEP(k + 16 * v, I8_W, I8_X, 0);
        }
        for (; k + 16 <= K; k += 16) I8S_STEP(k, I8_W, I8_X, 0);
        if (k < K) I8S_STEP(k, I8_WZ, I8_XZ, tail);
    }
    far->at = pf, far->debt = debt;
    /* the row's scale once per sum; lane i * NB + j: y[m0 + i, n0 + j] */
    float s[16];
    I8_UNROLL16 for (int t = 0; t < 16; t++) {
        const int j = t % NB;
        s[t] = j < nb ? hkv_bf16_to_f32(scale[n0 + j]) : 0.0f;
    }
    const __m512 sums = _mm512_mul_ps(hkv_reduce16(acc), _mm512_loadu_ps(s));
    if (ybf16) {
        uint16_t out[16];
        _mm256_storeu_si256((__m256i *)out, hkv_f32x16_to_bf16(sums));
        I8_UNROLL16 for (int i = 0; i < mb; i++)
            memcpy((uint16_t *)y + (m0 + i) * ldy + n0, out + i * NB, (size_t)nb * 2);
    } else {
        float out[16];
        _mm512_storeu_ps(out, sums);
        I8_UNROLL16 for (int i = 0; i < mb; i++)
            memcpy((float *)y + (m0 + i) * ldy + n0, out + i * NB, (size_t)nb * sizeof(float));
    }
}

#define I8S_TILE(MB_) i8s_tile(x, ldx, q, scale, K, y, ldy, ybf16, m0, n0, nb, MB_, NB, &far)

/* every row of x against weight rows n0 .. n0 + nb - 1 (a block), in tiles of MB rows (the
 * last one of M % MB). The far prefetch of the block's size in bytes, I8_FAR bytes past its
 * start (not past q_end), is spread over all the block's steps: memory streams at one pace
 * whether the block's time goes to one tile or to several */
I8_INLINE void i8s_block(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                         int64_t M, int64_t K, void *y, int64_t ldy, int ybf16, int64_t n0,
                         int64_t nb, const int NB, const int MB, const char *q_end) {
    const int64_t groups = NB < I8_G ? 1 : NB / I8_G, tiles = (M + MB - 1) / MB;
    const char *pf = (const char *)(q + n0 * K) + I8_FAR;
    const int64_t lines = (NB * K + 63) / 64, left = pf < q_end ? (q_end - pf) / 64 : 0;
    I8Far far = {pf, 0, lines < left ? lines : left, tiles * groups * ((K + 15) / 16)};
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0;
        if (MB == 1 || rows == 1) I8S_TILE(1);
        else if (MB == 2 || rows == 2) I8S_TILE(2);
        else if (rows == 3) I8S_TILE(3);
        else I8S_TILE(4);
    }
}

#define I8S_BLOCKS(NB_, MB_)                                                                 \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (N * K >= I8_PARALLEL_MIN)")           \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            i8s_block(x, ldx, q, scale, M, K, y, ldy, ybf16, n0, nb, NB_, MB_, q_end);       \
        }                                                                                    \
    } while (0)

/* float32 x, 1 <= K: tiles of one row of x by 16 weight rows (M = 1), two by 8 (M = 2), else
 * four by 4 */
static void i8_stream(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                      int64_t M, int64_t N, int64_t K, void *y, int64_t ldy, int ybf16) {
    const char *q_end = (const char *)(q + N * K);
    if (M == 1)
        I8S_BLOCKS(16, 1);
    else if (M == 2)
        I8S_BLOCKS(8, 2);
    else
        I8S_BLOCKS(4, 4);
}

#else /* no AVX-512: one output at a time */

static void i8_block(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t m_lo, int64_t m_hi, int64_t K, void *y,
                     int64_t ldy, int ybf16, int64_t n0, int64_t nb) {
    for (int64_t m = m_lo; m < m_hi; m++)
        for (int64_t n = n0; n < n0 + nb; n++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += i8_load1(x, xbf16, m * ldx + k) * q[n * K + k];
            i8_store1(y, ybf16, m * ldy + n, sum * hkv_bf16_to_f32(scale[n]));
        }
}

#endif

#if I8_AVX2 /* ---- the streaming path on 8 lanes (AVX2 + FMA) ---------------------------- */

/* 8 int8 weights at P widened to float32 (vpmovsxbd, vcvtdq2ps); the last K % 8 of a row
 * through a zeroed copy (AVX2 has no masked byte load; never reads past the row) */
#define I8_W8(P) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(P))))
I8_INLINE __m256 i8_w8_tail(const int8_t *p, int64_t n) {
    int8_t t[16] = {0};
    memcpy(t, p, (size_t)n);
    return I8_W8(t);
}
#define I8_W8Z(P) i8_w8_tail(P, K & 7)
#define I8_X8(P) _mm256_loadu_ps(P)
#define I8_X8Z(P) _mm256_maskload_ps(P, tail) /* lanes past K: zeros, never read */

/* bfloat16 rows x [M, K] (row stride ldx) -> float32 xw [M, ldw] (exact) */
static void i8_widen_x8(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xw,
                        int64_t ldw) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *r = x + m * ldx;
        float *o = xw + m * ldw;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + k)));
            _mm256_storeu_ps(o + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
        for (; k < K; k++) o[k] = hkv_bf16_to_f32(r[k]);
    }
}

typedef struct { /* a block's far prefetch (as I8Far) */
    const char *at;
    int64_t debt, lines, total;
} I8Far8;

/* I8S_STEP on 8 lanes: acc[i * NB + g * G + j] += x[row i, K0 .. K0 + 7] * w[row g * G + j,
 * same], each weight vector widened once for the mb rows of x */
#define I8S_STEP8(K0, WLOAD, XLOAD)                                                          \
    do {                                                                                     \
        __m256 wv[I8_G];                                                                     \
        I8_UNROLL16 for (int j = 0; j < G; j++) wv[j] = WLOAD(wr[g * G + j] + (K0));         \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        I8_UNROLL16 for (int i = 0; i < mb; i++) {                                           \
            const __m256 xv = XLOAD(xr + i * ldx + (K0));                                    \
            I8_UNROLL16 for (int j = 0; j < G; j++) acc[i * NB + g * G + j] =                \
                _mm256_fmadd_ps(xv, wv[j], acc[i * NB + g * G + j]);                         \
        }                                                                                    \
    } while (0)

/* i8s_tile on 8 lanes: rows m0 .. m0 + mb - 1 of y by columns n0 .. n0 + nb - 1 (nb <= NB,
 * mb * NB <= 8), the NB weight rows in groups of G = min(NB, I8_G) side by side, one group
 * after the other; a near prefetch per 64-byte line of each row, every step a turn of the
 * block's far prefetch; the 8 sums reduced together (hkv_reduce8), the row's scale once */
I8_INLINE void i8s_tile8(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                         int64_t K, void *y, int64_t ldy, int ybf16, int64_t m0, int64_t n0,
                         int64_t nb, const int mb, const int NB, I8Far8 *far) {
    const int G = NB < I8_G ? NB : I8_G;
    const float *xr = x + m0 * ldx;
    const int8_t *wr[8];
    I8_UNROLL16 for (int j = 0; j < NB; j++) wr[j] = q + (n0 + (j < nb ? j : nb - 1)) * K;
    const char *pf = far->at;
    int64_t debt = far->debt;
    const int64_t lines = far->lines, total = far->total;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K & 7)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 acc[8];
    I8_UNROLL16 for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    I8_UNROLL16 for (int g = 0; g < NB / G; g++) {
        if (g * G >= nb) break; /* (the last block: groups of rows past N) */
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) { /* a cache line of each row of the group */
            I8_UNROLL16 for (int j = 0; j < G; j++)
                _mm_prefetch((const char *)(wr[g * G + j] + k) + I8_NEAR, _MM_HINT_T0);
            I8_UNROLL16 for (int v = 0; v < 8; v++) I8S_STEP8(k + 8 * v, I8_W8, I8_X8);
        }
        for (; k + 8 <= K; k += 8) I8S_STEP8(k, I8_W8, I8_X8);
        if (k < K) I8S_STEP8(k, I8_W8Z, I8_X8Z);
    }
    far->at = pf, far->debt = debt;
    float out[8]; /* lane i * NB + j: y[m0 + i, n0 + j] before the scale */
    _mm256_storeu_ps(out, hkv_reduce8(acc));
    I8_UNROLL16 for (int i = 0; i < mb; i++) I8_UNROLL16 for (int j = 0; j < NB; j++) {
            if (j >= nb) break;
            i8_store1(y, ybf16, (m0 + i) * ldy + n0 + j,
                      out[i * NB + j] * hkv_bf16_to_f32(scale[n0 + j]));
        }
}

#define I8S_TILE8(MB_) i8s_tile8(x, ldx, q, scale, K, y, ldy, ybf16, m0, n0, nb, MB_, NB, &far)

/* i8s_block on 8 lanes: every row of x against weight rows n0 .. n0 + nb - 1, in tiles of MB
 * rows (the last one of M % MB), the block's far prefetch spread over all its steps */
I8_INLINE void i8s_block8(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                          int64_t M, int64_t K, void *y, int64_t ldy, int ybf16, int64_t n0,
                          int64_t nb, const int NB, const int MB, const char *q_end) {
    const int64_t groups = NB < I8_G ? 1 : NB / I8_G, tiles = (M + MB - 1) / MB;
    const char *pf = (const char *)(q + n0 * K) + I8_FAR;
    const int64_t lines = (NB * K + 63) / 64, left = pf < q_end ? (q_end - pf) / 64 : 0;
    I8Far8 far = {pf, 0, lines < left ? lines : left, tiles * groups * ((K + 7) / 8)};
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = M - m0;
        if (MB == 1 || rows == 1) I8S_TILE8(1);
        else if (MB == 2 || rows == 2) I8S_TILE8(2);
        else if (rows == 3) I8S_TILE8(3);
        else I8S_TILE8(4);
    }
}

#define I8S_BLOCKS8(NB_, MB_)                                                                \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (N * K >= I8_PARALLEL_MIN)")           \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            i8s_block8(x, ldx, q, scale, M, K, y, ldy, ybf16, n0, nb, NB_, MB_, q_end);      \
        }                                                                                    \
    } while (0)

/* float32 x, 1 <= K: tiles of one row of x by 8 weight rows (M = 1), two by 4 (M = 2), else
 * four by 2 */
static void i8_stream8(const float *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                       int64_t M, int64_t N, int64_t K, void *y, int64_t ldy, int ybf16) {
    const char *q_end = (const char *)(q + N * K);
    if (M == 1)
        I8S_BLOCKS8(8, 1);
    else if (M == 2)
        I8S_BLOCKS8(4, 2);
    else
        I8S_BLOCKS8(2, 4);
}

#endif

void hkv_int8_linear(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                     int64_t ldy, int ybf16) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* no products: zeros */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) i8_store1(y, ybf16, m * ldy + n, 0.0f);
        return;
    }
#if I8_AVX512
    if (M <= I8_SMALL_M || M * K <= I8_STREAM_X) {
        if (!xbf16) {
            i8_stream(x, ldx, q, scale, M, N, K, y, ldy, ybf16);
            return;
        }
        /* bfloat16 x widened once (exact), rows 64-byte aligned: the float32 tiles */
        const int64_t ldw = (K + 15) & ~(int64_t)15;
        float *xw = aligned_alloc(64, (size_t)(M * ldw) * sizeof(float));
        if (xw) {
            i8_widen_x(x, ldx, M, K, xw, ldw);
            i8_stream(xw, ldw, q, scale, M, N, K, y, ldy, ybf16);
            free(xw);
            return;
        } /* (no memory for it: the chunked path reads x as it is) */
    }
#endif
#if I8_AVX2
    if (M > I8_GEMM_M &&
        hkv_avx2_gemm(x, ldx, xbf16, q, 2, NULL, scale, M, N, K, y, ldy, ybf16) == 0)
        return;
    if (!xbf16) {
        i8_stream8(x, ldx, q, scale, M, N, K, y, ldy, ybf16);
        return;
    }
    { /* bfloat16 x widened once (exact): the float32 tiles */
        const int64_t ldw = (K + 7) & ~(int64_t)7;
        float *xw = aligned_alloc(32, (size_t)(M * ldw) * sizeof(float));
        if (xw) {
            i8_widen_x8(x, ldx, M, K, xw, ldw);
            i8_stream8(xw, ldw, q, scale, M, N, K, y, ldy, ybf16);
            free(xw);
            return;
        } /* (no memory for it: the plain loop reads x as it is) */
    }
#endif
    const int64_t blocks = (N + I8_NB - 1) / I8_NB; /* of I8_NB weight rows */
    /* More than one tile of rows: the blocks go in chunks of about I8_CHUNK_BYTES of weights,
     * each chunk's blocks once per tile of rows, so a chunk read from memory for the first
     * tile stays in L2 for the others (at least two chunks per thread); and at most
     * I8_M_CHUNK rows at a time, so that the rows of y being written (a power-of-two stride
     * maps them to few cache sets) stay in cache */
    int64_t per = M <= I8_MB ? 1 : I8_CHUNK_BYTES / (K * I8_NB);
    const int64_t spread = (blocks + 2 * omp_get_max_threads() - 1) / (2 * omp_get_max_threads());
    per = per > spread ? spread : per;
    per = per < 1 ? 1 : per;
    const int64_t chunks = (blocks + per - 1) / per;
    for (int64_t m_c = 0; m_c < M; m_c += I8_M_CHUNK) {
        const int64_t m_end = M - m_c < I8_M_CHUNK ? M : m_c + I8_M_CHUNK;
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t last = (c + 1) * per < blocks ? (c + 1) * per : blocks;
            for (int64_t m_lo = m_c; m_lo < m_end; m_lo += I8_MB) {
                const int64_t m_hi = m_end - m_lo < I8_MB ? m_end : m_lo + I8_MB;
                for (int64_t b = c * per; b < last; b++) {
                    const int64_t n0 = b * I8_NB;
                    const int64_t nb = N - n0 < I8_NB ? N - n0 : I8_NB;
                    i8_block(x, ldx, xbf16, q, scale, m_lo, m_hi, K, y, ldy, ybf16, n0, nb);
                }
            }
        }
    }
}
