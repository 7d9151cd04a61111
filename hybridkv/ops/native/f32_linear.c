/* float32 linear for small batches on the CPU: y = x @ w^T (+ bias), float32 throughout (float32
 * products and sums, no bfloat16 or TF32 step). hybridkv/layers/linear.py (PackedLinear) calls
 * it for float32 weights at the batch sizes where it beats oneDNN's packed linear;
 * hybridkv/ops/native/f32_linear.py declares it. Compiled into the one native library with the
 * other C files of this folder; bf16_linear.c is its bfloat16 counterpart.
 *
 *     x     [M, K] float32 rows at a row stride (unit column stride)
 *     w     [N, K] float32, contiguous: the nn.Linear weight itself, not repacked
 *     bias  [N] float32 or NULL
 *     y     [M, N] float32 rows at a row stride
 *
 * A decode step's linears are bound by streaming the weight (at M = 1, 4 bytes of weight per
 * multiply-add), so each weight row is read from memory once per call and used for every row
 * of x. Register tiles: MB rows of x by NB weight rows, MB * NB = 16 accumulators of 16 float32
 * lanes (one vfmadd231ps per 16 values of k; masked loads for the last K % 16, zeros past K);
 * the 16 sums of a tile are reduced together by a transposing tree (15 vector adds, 30 shuffles
 * and a permute, not 16 horizontal reductions), then the bias is added. Tiles: M = 1 one row
 * of x by 16 weight rows, M = 2 two by 8, otherwise four by 4 (the last rows of x in a tile of
 * 1..3). Weight rows past N read the last row again (their sums are dropped).
 *
 * Memory order: a thread's weight blocks (NB rows each) are one contiguous range of w, and the
 * first tile of rows of every block reads its NB weight rows one after the other, so the call
 * is one sequential stream per thread. Two software prefetches keep it ahead: a far one into
 * L2, F32_FAR bytes past the current block's start, spread evenly over every step of the block
 * (all its tiles), and a near one into L1, F32_NEAR bytes ahead of the sequential loads. When M
 * needs more than one tile of rows, the block (NB * K * 4 bytes: 12 KiB at 4 x 768) stays in
 * L1 for the other tiles, which read the NB rows side by side (NB weight loads serve MB * NB
 * products) while the far prefetch goes on, so memory stays busy while they compute.
 *
 * Measured on the development CPU (Xeon, 2 cores, AVX-512; 1 thread, 768 x 3224 and 1536 x 768
 * weights out of cache; benchmarks/README.md has the tables): at M = 1 the stream runs at or
 * above the speed of PyTorch's w.sum() of the same bytes. Without software prefetch M = 1 was
 * ~12% slower; with the near prefetch alone (into L1) M = 4 was ~15% slower; prefetching the
 * next block only during the later tiles (none during the first, as bf16_linear.c does) was
 * 7-15% slower at M = 8-16; reading the first tile side by side too (the fastest order with
 * the weight in cache: ~30% more FMAs a cycle at M = 4-8) was 8-20% slower at M = 4-32. The
 * sequential rows alternate between two sets of sums per row of x (~10% at M = 1-4 with the
 * weight in cache): with one, each would be a chain of K / 16 dependent FMAs (4 cycles each),
 * which set the pace of a 4-row tile rather than its loads.
 *
 * OpenMP splits the blocks into one contiguous range per thread (the same libgomp as PyTorch:
 * torch.set_num_threads applies); weights under F32_PARALLEL_MIN values run on the calling
 * thread.
 *
 * AVX2 + FMA without AVX-512 (HKV_AVX2: AMD Zen 2/3, most laptops; HYBRIDKV_NATIVE_MARCH=
 * x86-64-v3 builds it anywhere): the same stream and prefetches on 8 lanes, tiles for 16
 * registers: M = 1 one row of x by 8 weight rows, M = 2 two by 4, otherwise four by 2 (MB * NB
 * = 8 sums of 8 lanes, reduced together by hkv_reduce8: 6 horizontal adds, 2 permutes, 1 add);
 * vmaskmovps for the last K % 8 (lanes past K never read); the near prefetch once per 64-byte
 * line (two 8-value loads). Measured under the AVX2 simulation (this Xeon: x86-64-v3 build,
 * ATen at AVX2, oneDNN and MKL capped at AVX2; 1 thread, weights out of cache, against
 * oneDNN's packed float32 linear, 768 -> 3224, 1536 -> 768 and 768 -> 32000): 1.2-1.35x at
 * M = 1, 1.5-1.6x at 8, 1.2-1.3x at 16, 1.0-1.08x at 24, 0.9-1.08x at 32
 * (f32_linear.SMALL_M_AVX2 = 24; benchmarks/README.md "AVX2"). This
 * file also holds the AVX2 GEMM the bfloat16 and int8 linears take for more rows
 * (hkv_avx2_gemm, at its end).
 *
 * Without either a plain loop is built instead (the same result up to summation order) and
 * hkv_f32_linear_fast() returns 0, so the caller keeps oneDNN. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AVX512 || HKV_AVX2
#define F32_FAST 1
#else
#define F32_FAST 0
#endif

#define F32_PARALLEL_MIN (16 * 1024) /* weight values (64 KiB): below, one thread */
#define F32_NEAR 2048  /* bytes: a sequential row's prefetch into L1, ahead of its loads */
#define F32_FAR 16384  /* bytes: the stream's prefetch into L2, ahead of the block's start */
#define F32_INLINE static inline __attribute__((always_inline))
#define F32_UNROLL _Pragma("GCC unroll 16") /* whole tiles unrolled: sums stay in registers */

int hkv_f32_linear_fast(void) { return F32_FAST; }

#if HKV_AVX512

#define F32_LOADZ(MASK, P) _mm512_maskz_loadu_ps(MASK, P)
#define F32_LOAD(MASK, P) _mm512_loadu_ps(P)

/* weight rows side by side: acc[i * NB + j] += x[row i, k .. k + 15] * w[row j, same] for every
 * (i, j) of the tile */
#define F32_SIDE_STEP(MASK, LOAD)                                                            \
    do {                                                                                     \
        __m512 wv[16];                                                                       \
        F32_UNROLL for (int j = 0; j < NB; j++) wv[j] = LOAD(MASK, wr[j] + k);               \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        F32_UNROLL for (int i = 0; i < mb; i++) {                                            \
            const __m512 xv = LOAD(MASK, xr[i] + k);                                         \
            F32_UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] =                        \
                _mm512_fmadd_ps(xv, wv[j], acc[i * NB + j]);                                 \
        }                                                                                    \
    } while (0)

/* weight row j alone (the rows one after the other: one sequential stream): SUM[i] += x[row i,
 * K0 .. K0 + 15] * w[row j, same], and the near prefetch of the row */
#define F32_ROW_STEP(MASK, LOAD, SUM, K0)                                                    \
    do {                                                                                     \
        const __m512 wv = LOAD(MASK, wr[j] + (K0));                                          \
        _mm_prefetch((const char *)(wr[j] + (K0)) + F32_NEAR, _MM_HINT_T0);                  \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        F32_UNROLL for (int i = 0; i < mb; i++) SUM[i] =                                     \
            _mm512_fmadd_ps(LOAD(MASK, xr[i] + (K0)), wv, SUM[i]);                           \
    } while (0)

typedef struct { /* a block's far prefetch: the next line, and where its spread stands */
    const char *at;
    int64_t debt, lines, total;
} F32Far;

/* rows m0 .. m0 + mb - 1 of y by columns n0 .. n0 + nb - 1 (nb <= NB); mb, NB and seq are
 * constants at every call. seq: the weight rows one after the other; else side by side. Every
 * step (16 values of k of one weight row when seq, of all NB rows else) takes its turn in the
 * block's far prefetch */
F32_INLINE void f32_tile(const float *x, int64_t ldx, const float *w, const float *bias,
                         int64_t K, float *y, int64_t ldy, int64_t m0, int64_t n0, int64_t nb,
                         const int mb, const int NB, const int seq, F32Far *far) {
    const float *xr[4], *wr[16];
    F32_UNROLL for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * ldx;
    F32_UNROLL for (int j = 0; j < NB; j++) wr[j] = w + (n0 + (j < nb ? j : nb - 1)) * K;
    const char *pf = far->at;
    int64_t debt = far->debt;
    const int64_t lines = far->lines, total = far->total;
    __m512 acc[16];
    F32_UNROLL for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    const int64_t whole = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - whole)) - 1);
    if (seq) {
        /* one row's sums alternate between two sets: a chain of K / 32 dependent FMAs each,
         * not K / 16 (at 4 cycles an FMA the chain, not the loads, would set the pace) */
        F32_UNROLL for (int j = 0; j < NB; j++) {
            __m512 even[4], odd[4];
            F32_UNROLL for (int i = 0; i < mb; i++) even[i] = odd[i] = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= whole; k += 32) {
                F32_ROW_STEP(0, F32_LOAD, even, k);
                F32_ROW_STEP(0, F32_LOAD, odd, k + 16);
            }
            if (k < whole) {
                F32_ROW_STEP(0, F32_LOAD, even, k);
                k += 16;
            }
            if (k < K) F32_ROW_STEP(tail, F32_LOADZ, odd, k);
            F32_UNROLL for (int i = 0; i < mb; i++) acc[i * NB + j] =
                _mm512_add_ps(even[i], odd[i]);
        }
    } else {
        int64_t k = 0;
        for (; k < whole; k += 16) F32_SIDE_STEP(0, F32_LOAD);
        if (k < K) F32_SIDE_STEP(tail, F32_LOADZ);
    }
    far->at = pf, far->debt = debt;
    __m512 sums = hkv_reduce16(acc); /* lane i * NB + j: y[m0 + i, n0 + j] */
    if (bias) {
        float b[16];
        F32_UNROLL for (int t = 0; t < 16; t++) {
            const int j = t % NB;
            b[t] = j < nb ? bias[n0 + j] : 0.0f;
        }
        sums = _mm512_add_ps(sums, _mm512_loadu_ps(b));
    }
    float out[16];
    _mm512_storeu_ps(out, sums);
    F32_UNROLL for (int i = 0; i < mb; i++)
        memcpy(y + (m0 + i) * ldy + n0, out + i * NB, (size_t)nb * sizeof(float));
}

#define F32_TILE(MB_, SEQ_)                                                                  \
    f32_tile(x, ldx, w, bias, K, y, ldy, m0, n0, nb, MB_, NB, SEQ_, &far)

/* block n0 .. n0 + nb - 1 of weight rows against every row of x: the first tile of rows
 * streams the block (from L2, where the far prefetch put it), the others read it from L1. The
 * far prefetch of this block's size in bytes, F32_FAR bytes past its start (not past w_end, the
 * end of the weight), is spread over all the tiles' steps: memory streams at one pace whether
 * the block's time goes to one tile (M <= MB) or to several */
F32_INLINE void f32_block(const float *x, int64_t ldx, const float *w, const float *bias,
                          int64_t M, int64_t K, float *y, int64_t ldy, int64_t n0, int64_t nb,
                          const int NB, const int MB, const char *w_end) {
    const int64_t tiles = (M + MB - 1) / MB, steps = (K + 15) / 16;
    const int64_t bytes = NB * K * (int64_t)sizeof(float), lines = (bytes + 63) / 64;
    const char *pf = (const char *)(w + n0 * K) + F32_FAR;
    const int64_t left_lines = pf < w_end ? (w_end - pf) / 64 : 0;
    F32Far far = {pf, 0, lines < left_lines ? lines : left_lines, (NB + tiles - 1) * steps};
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const int seq = m0 == 0;
        if (MB == 1 || left == 1) {
            if (seq) F32_TILE(1, 1); else F32_TILE(1, 0);
        } else if (MB == 2 || left == 2) {
            if (seq) F32_TILE(2, 1); else F32_TILE(2, 0);
        } else if (left == 3) {
            if (seq) F32_TILE(3, 1); else F32_TILE(3, 0);
        } else {
            if (seq) F32_TILE(4, 1); else F32_TILE(4, 0);
        }
    }
}

#define F32_BLOCKS(NB_, MB_)                                                                 \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (parallel)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            f32_block(x, ldx, w, bias, M, K, y, ldy, n0, nb, NB_, MB_, w_end);               \
        }                                                                                    \
    } while (0)

void hkv_f32_linear(const float *x, int64_t ldx, const float *w, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* no products: the bias, or zeros */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return;
    }
    const int parallel = N * K >= F32_PARALLEL_MIN;
    const char *w_end = (const char *)(w + N * K);
    if (M == 1)
        F32_BLOCKS(16, 1);
    else if (M == 2)
        F32_BLOCKS(8, 2);
    else
        F32_BLOCKS(4, 4);
}

#elif HKV_AVX2 /* AVX2 + FMA: the same stream on 8 lanes, smaller tiles for 16 registers */

#define F32_LOAD8(P) _mm256_loadu_ps(P)
#define F32_LOAD8Z(P) _mm256_maskload_ps(P, tail) /* lanes past K: zeros, never read */

/* weight rows side by side: acc[i * NB + j] += x[row i, k .. k + 7] * w[row j, same] */
#define F32_SIDE_STEP8(LOAD)                                                                 \
    do {                                                                                     \
        __m256 wv[8];                                                                        \
        F32_UNROLL for (int j = 0; j < NB; j++) wv[j] = LOAD(wr[j] + k);                     \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        F32_UNROLL for (int i = 0; i < mb; i++) {                                            \
            const __m256 xv = LOAD(xr[i] + k);                                               \
            F32_UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] =                        \
                _mm256_fmadd_ps(xv, wv[j], acc[i * NB + j]);                                 \
        }                                                                                    \
    } while (0)

/* weight row j alone (one sequential stream): SUM[i] += x[row i, K0 .. K0 + 7] * w[row j,
 * same]; the near prefetch is the caller's (one per 64-byte line, not per load) */
#define F32_ROW_STEP8(LOAD, SUM, K0)                                                         \
    do {                                                                                     \
        const __m256 wv = LOAD(wr[j] + (K0));                                                \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        F32_UNROLL for (int i = 0; i < mb; i++) SUM[i] =                                     \
            _mm256_fmadd_ps(LOAD(xr[i] + (K0)), wv, SUM[i]);                                 \
    } while (0)

typedef struct { /* a block's far prefetch: the next line, and where its spread stands */
    const char *at;
    int64_t debt, lines, total;
} F32Far;

/* f32_tile on 8 lanes: mb * NB <= 8 sums of 8 lanes, reduced together by hkv_reduce8 */
F32_INLINE void f32_tile8(const float *x, int64_t ldx, const float *w, const float *bias,
                          int64_t K, float *y, int64_t ldy, int64_t m0, int64_t n0, int64_t nb,
                          const int mb, const int NB, const int seq, F32Far *far) {
    const float *xr[4], *wr[8];
    F32_UNROLL for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * ldx;
    F32_UNROLL for (int j = 0; j < NB; j++) wr[j] = w + (n0 + (j < nb ? j : nb - 1)) * K;
    const char *pf = far->at;
    int64_t debt = far->debt;
    const int64_t lines = far->lines, total = far->total;
    __m256 acc[8];
    F32_UNROLL for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    const int64_t whole = K & ~(int64_t)7;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - whole)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (seq) {
        /* two sets of sums per row, as on 16 lanes (a chain of K / 16 dependent FMAs each) */
        F32_UNROLL for (int j = 0; j < NB; j++) {
            __m256 even[4], odd[4];
            F32_UNROLL for (int i = 0; i < mb; i++) even[i] = odd[i] = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 16 <= whole; k += 16) {
                _mm_prefetch((const char *)(wr[j] + k) + F32_NEAR, _MM_HINT_T0);
                F32_ROW_STEP8(F32_LOAD8, even, k);
                F32_ROW_STEP8(F32_LOAD8, odd, k + 8);
            }
            if (k < whole) {
                F32_ROW_STEP8(F32_LOAD8, even, k);
                k += 8;
            }
            if (k < K) F32_ROW_STEP8(F32_LOAD8Z, odd, k);
            F32_UNROLL for (int i = 0; i < mb; i++) acc[i * NB + j] =
                _mm256_add_ps(even[i], odd[i]);
        }
    } else {
        int64_t k = 0;
        for (; k < whole; k += 8) F32_SIDE_STEP8(F32_LOAD8);
        if (k < K) F32_SIDE_STEP8(F32_LOAD8Z);
    }
    far->at = pf, far->debt = debt;
    __m256 sums = hkv_reduce8(acc); /* lane i * NB + j: y[m0 + i, n0 + j] */
    if (bias) {
        float b[8];
        F32_UNROLL for (int t = 0; t < 8; t++) {
            const int j = t % NB;
            b[t] = j < nb ? bias[n0 + j] : 0.0f;
        }
        sums = _mm256_add_ps(sums, _mm256_loadu_ps(b));
    }
    float out[8];
    _mm256_storeu_ps(out, sums);
    F32_UNROLL for (int i = 0; i < mb; i++)
        memcpy(y + (m0 + i) * ldy + n0, out + i * NB, (size_t)nb * sizeof(float));
}

#define F32_TILE8(MB_, SEQ_)                                                                 \
    f32_tile8(x, ldx, w, bias, K, y, ldy, m0, n0, nb, MB_, NB, SEQ_, &far)

/* f32_block on 8 lanes (the same far prefetch, spread over every 8-value step) */
F32_INLINE void f32_block8(const float *x, int64_t ldx, const float *w, const float *bias,
                           int64_t M, int64_t K, float *y, int64_t ldy, int64_t n0, int64_t nb,
                           const int NB, const int MB, const char *w_end) {
    const int64_t tiles = (M + MB - 1) / MB, steps = (K + 7) / 8;
    const int64_t bytes = NB * K * (int64_t)sizeof(float), lines = (bytes + 63) / 64;
    const char *pf = (const char *)(w + n0 * K) + F32_FAR;
    const int64_t left_lines = pf < w_end ? (w_end - pf) / 64 : 0;
    F32Far far = {pf, 0, lines < left_lines ? lines : left_lines, (NB + tiles - 1) * steps};
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const int seq = m0 == 0;
        if (MB == 1 || left == 1) {
            if (seq) F32_TILE8(1, 1); else F32_TILE8(1, 0);
        } else if (MB == 2 || left == 2) {
            if (seq) F32_TILE8(2, 1); else F32_TILE8(2, 0);
        } else if (left == 3) {
            if (seq) F32_TILE8(3, 1); else F32_TILE8(3, 0);
        } else {
            if (seq) F32_TILE8(4, 1); else F32_TILE8(4, 0);
        }
    }
}

#define F32_BLOCKS8(NB_, MB_)                                                                \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (parallel)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            f32_block8(x, ldx, w, bias, M, K, y, ldy, n0, nb, NB_, MB_, w_end);              \
        }                                                                                    \
    } while (0)

void hkv_f32_linear(const float *x, int64_t ldx, const float *w, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* no products: the bias, or zeros */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return;
    }
    const int parallel = N * K >= F32_PARALLEL_MIN;
    const char *w_end = (const char *)(w + N * K);
    if (M == 1)
        F32_BLOCKS8(8, 1);
    else if (M == 2)
        F32_BLOCKS8(4, 2);
    else
        F32_BLOCKS8(2, 4);
}

#else /* neither AVX-512 nor AVX2: one output at a time */

void hkv_f32_linear(const float *x, int64_t ldx, const float *w, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ldy) {
#pragma omp parallel for schedule(static) if (N * K >= F32_PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += x[m * ldx + k] * w[n * K + k];
            y[m * ldy + n] = sum + (bias ? bias[n] : 0.0f);
        }
}

#endif

#if HKV_AVX2
/* ---- the AVX2 GEMM (hkv_avx2_gemm, hkv_common.h): larger M ------------------------------
 *
 * The dot-product tiles above vectorize along K: each product needs a vector of x and one of
 * w, so a 4 x 2 tile loads 6 vectors per 8 FMAs, and the rows of x (re-read for every block of
 * 2 weight rows) come from L2 once M * K passes L1: about 60% of the FMA rate at M = 64. Here
 * the tile vectorizes along M instead: x is copied once per call into panels of G8_MR = 16
 * rows, transposed ([k][16] float32, rows past M zero; stored piece by piece of G8_KC values
 * of k, the panels of a piece one after the other: g8_piece), and each weight value is
 * broadcast to 8 lanes: a 16 x 6 tile keeps 12 sums in registers and loads 2 vectors of x and
 * 6 broadcast weights per 12 FMAs (vbroadcastss from memory: a load, no shuffle), the usual
 * AVX2 GEMM kernel shape (a last panel of at most 8 rows takes one vector: half the FMAs).
 * Blocking: a block of G8_NR weight rows is taken G8_KC values of k at a time (bfloat16 and
 * int8 converted exactly into a float32 buffer of the thread, 6 KiB; float32 read in place),
 * and that piece goes through every panel of x of the current pass while it stays in L1, the
 * panels' sums kept in a buffer between the pieces; a pass covers the panels of x that fit in
 * G8_L2 bytes, so that they stay in L2 while every block of weights goes by (1536 -> 768 at M =
 * 512, 3 MiB of x: 36% slower than oneDNN's float32 GEMM without the passes; 2 MiB passes were
 * 10% slower than 1 MiB, 512 KiB 5%). The sums of G8_GROUP blocks (48 columns) are stored
 * together: 8 x 8 transposes make rows of them, then the scale, bias and rounding run on 8
 * lanes and each row of y gets 8 consecutive values per store (per output and per block, the
 * stores took 13% of the time at 2048 x 768 -> 3072; now level with oneDNN there). OpenMP
 * splits the groups of blocks of each pass.
 *
 * Measured under the AVX2 simulation (x86-64-v3 build, oneDNN and MKL capped at AVX2; 1
 * thread, 100m model shapes, weights out of cache; benchmarks/README.md): against the
 * dot-product tiles it wins from M = 24 (bfloat16: 0.88-0.92x their time at 24, 0.77-0.80x at
 * 32) and loses at M <= 20 (a panel of 16 rows computes 32 rows' products at M = 17-20).
 * Against oneDNN's float32 GEMM (weights in cache, M = 512, K = 768 and 1536): 44-47 GFMA/s
 * where oneDNN does 45-50 (bfloat16 weights: 0.94-0.97x its speed); its pieces of x one
 * after the other (not a panel's whole K, then the next) and the k loop unrolled by 4 gained
 * 4% each. */

#define G8_MR 16            /* rows of x per panel: two vectors */
#define G8_NR 6             /* weight rows per block */
#define G8_KC 256           /* values of k per piece of a block */
#define G8_L2 (1024 * 1024) /* bytes of panels of x per pass over the weights */
#define G8_GROUP 8          /* blocks whose outputs are stored together (48 columns) */

/* x [M, K] (float32 or bfloat16, row stride ldx) -> xp, float32: piece by piece of G8_KC values
 * of k, in each the panels one after the other, each [kc][16] (rows past M zero); so a pass
 * reads one piece of all its panels as one sequential stream. Panel p's piece at k0 starts at
 * g8_piece(xp, panels, K, p, k0). */
static inline float *g8_piece(float *xp, int64_t panels, int64_t K, int64_t p, int64_t k0) {
    const int64_t kc = K - k0 < G8_KC ? K - k0 : G8_KC;
    return xp + k0 * panels * G8_MR + p * kc * G8_MR;
}

static void g8_pack_x(const void *x, int64_t ldx, int xbf16, int64_t M, int64_t K, float *xp) {
    const int64_t panels = (M + G8_MR - 1) / G8_MR;
#pragma omp parallel for schedule(static) if (M * K >= 64 * 1024)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t k0 = 0; k0 < K; k0 += G8_KC) {
            const int64_t kc = K - k0 < G8_KC ? K - k0 : G8_KC;
            float *o = g8_piece(xp, panels, K, p, k0);
            for (int l = 0; l < G8_MR; l++) {
                const int64_t m = p * G8_MR + l;
                if (m >= M) {
                    for (int64_t k = 0; k < kc; k++) o[k * G8_MR + l] = 0.0f;
                } else if (xbf16) {
                    const uint16_t *r = (const uint16_t *)x + m * ldx + k0;
                    for (int64_t k = 0; k < kc; k++) o[k * G8_MR + l] = hkv_bf16_to_f32(r[k]);
                } else {
                    const float *r = (const float *)x + m * ldx + k0;
                    for (int64_t k = 0; k < kc; k++) o[k * G8_MR + l] = r[k];
                }
            }
        }
    }
}

/* weights [n0 + j, k0 .. k0 + kc - 1] (bfloat16: wtype 1, int8: 2) -> float32 wb[j][0 .. kc - 1]
 * for j < G8_NR (row stride G8_KC; rows past nb: zeros) */
static void g8_convert_w(const void *w, int wtype, int64_t n0, int64_t nb, int64_t K, int64_t k0,
                         int64_t kc, float *wb) {
    for (int j = 0; j < G8_NR; j++) {
        float *o = wb + j * G8_KC;
        int64_t k = 0;
        if (j >= nb) {
            memset(o, 0, (size_t)kc * sizeof(float));
            continue;
        }
        if (wtype == 1) {
            const uint16_t *r = (const uint16_t *)w + (n0 + j) * K + k0;
            for (; k + 8 <= kc; k += 8) {
                const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + k)));
                _mm256_storeu_ps(o + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
            }
            for (; k < kc; k++) o[k] = hkv_bf16_to_f32(r[k]);
        } else {
            const int8_t *r = (const int8_t *)w + (n0 + j) * K + k0;
            for (; k + 8 <= kc; k += 8)
                _mm256_storeu_ps(o + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64((const __m128i *)(r + k)))));
            for (; k < kc; k++) o[k] = (float)r[k];
        }
    }
}

/* acc[j][l] (+)= panel row l . weight row j over kc values of k, for l < 8 * V, j < 6: xp the
 * panel's piece [kc][16], wr[j] the weight rows' (float32); `first`: acc starts from zero.
 * V = 2 vectors of rows (a panel of 9-16 rows), or 1 (a last panel of at most 8) */
static inline __attribute__((always_inline)) void g8_kernel(const float *xp, const float *wr[6],
                                                            int64_t kc, float acc[6][16],
                                                            int first, const int V) {
    __m256 c0[G8_NR], c1[G8_NR];
    F32_UNROLL for (int j = 0; j < G8_NR; j++) {
        c0[j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[j]);
        c1[j] = first || V == 1 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[j] + 8);
    }
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < kc; k++) {
        const __m256 a0 = _mm256_loadu_ps(xp + k * G8_MR);
        const __m256 a1 = V == 2 ? _mm256_loadu_ps(xp + k * G8_MR + 8) : a0;
        F32_UNROLL for (int j = 0; j < G8_NR; j++) {
            const __m256 b = _mm256_broadcast_ss(wr[j] + k);
            c0[j] = _mm256_fmadd_ps(a0, b, c0[j]);
            if (V == 2) c1[j] = _mm256_fmadd_ps(a1, b, c1[j]);
        }
    }
    F32_UNROLL for (int j = 0; j < G8_NR; j++) {
        _mm256_storeu_ps(acc[j], c0[j]);
        _mm256_storeu_ps(acc[j] + 8, c1[j]);
    }
}

/* hkv_f32_to_bf16 of 8 values (nearest even, NaN -> 0x7fc0), in order */
static inline __attribute__((always_inline)) __m128i g8_bf16x8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i q = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
    /* (every lane below 2^16: packusdw keeps it) */
    return _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

/* r[i] lane j <- r[j] lane i (an 8 x 8 transpose: unpacks, shuffles, 128-bit permutes) */
static inline __attribute__((always_inline)) void g8_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* the sums of panels p0 .. p1 - 1 against a group of blocks of weight rows, columns n0 ..
 * n0 + cols - 1 (acc[p - p0][i][j][l]: row p * 16 + l of y, column n0 + 6i + j) -> y: 8 x 8
 * transposes turn 8 columns' sums into rows, each then times its columns' scales (int8), plus
 * the bias, rounded to bfloat16 (ybf16) or not, and stored as 8 consecutive values of a row
 * of y (storing each row's 6 values of a block, scalar, after the next block's sums had pushed
 * its lines out of L1, took 13% of the time of 2048 x 768 -> 3072) */
static void g8_store(float (*acc)[G8_GROUP][G8_NR][16], int64_t p0, int64_t p1, int64_t M,
                     int64_t n0, int64_t cols, int wtype, const void *bias,
                     const uint16_t *scale, void *y, int64_t ldy, int ybf16) {
    float mul[G8_GROUP * G8_NR + 8], add[G8_GROUP * G8_NR + 8];
    for (int64_t c = 0; c < G8_GROUP * G8_NR + 8; c++) {
        const int in = c < cols;
        mul[c] = in && scale ? hkv_bf16_to_f32(scale[n0 + c]) : 1.0f;
        add[c] = !in || !bias ? 0.0f
                 : wtype == 0 ? ((const float *)bias)[n0 + c]
                              : hkv_bf16_to_f32(((const uint16_t *)bias)[n0 + c]);
    }
    for (int64_t p = p0; p < p1; p++) {
        const int64_t rows = M - p * G8_MR < G8_MR ? M - p * G8_MR : G8_MR;
        float(*a)[16] = acc[p - p0][0]; /* [G8_GROUP * 6][16]: column c's 16 rows */
        for (int64_t c0 = 0; c0 < cols; c0 += 8) {
            const int64_t width = cols - c0 < 8 ? cols - c0 : 8;
            const __m256 mv = _mm256_loadu_ps(mul + c0), av = _mm256_loadu_ps(add + c0);
            for (int half = 0; half < 2 && 8 * half < rows; half++) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) /* (columns past the group's: unused lanes) */
                    r[i] = c0 + i < G8_GROUP * G8_NR ? _mm256_loadu_ps(a[c0 + i] + 8 * half)
                                                     : _mm256_setzero_ps();
                g8_transpose8(r);
                for (int i = 0; i < 8 && 8 * half + i < rows; i++) {
                    /* the scale once per sum (int8), then the bias: as the tiles */
                    const __m256 v = _mm256_add_ps(_mm256_mul_ps(r[i], mv), av);
                    const int64_t at = (p * G8_MR + 8 * half + i) * ldy + n0 + c0;
                    if (ybf16) {
                        const __m128i h = g8_bf16x8(v);
                        if (width == 8) {
                            _mm_storeu_si128((__m128i *)((uint16_t *)y + at), h);
                        } else {
                            uint16_t t[8];
                            _mm_storeu_si128((__m128i *)t, h);
                            memcpy((uint16_t *)y + at, t, (size_t)width * sizeof(uint16_t));
                        }
                    } else if (width == 8) {
                        _mm256_storeu_ps((float *)y + at, v);
                    } else {
                        float t[8];
                        _mm256_storeu_ps(t, v);
                        memcpy((float *)y + at, t, (size_t)width * sizeof(float));
                    }
                }
            }
        }
    }
}

int hkv_avx2_gemm(const void *x, int64_t ldx, int xbf16, const void *w, int wtype,
                  const void *bias, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                  void *y, int64_t ldy, int ybf16) {
    if (M <= 0 || N <= 0 || K <= 0) return -1; /* (the callers handle these) */
    const int64_t panels = (M + G8_MR - 1) / G8_MR, blocks = (N + G8_NR - 1) / G8_NR;
    const int64_t groups = (blocks + G8_GROUP - 1) / G8_GROUP;
    int64_t per_pass = G8_L2 / (K * G8_MR * (int64_t)sizeof(float));
    per_pass = per_pass < 1 ? 1 : per_pass > panels ? panels : per_pass;
    float *xp = aligned_alloc(32, (size_t)(panels * K * G8_MR) * sizeof(float));
    if (xp == NULL) return -1;
    g8_pack_x(x, ldx, xbf16, M, K, xp);
    int failed = 0;
#pragma omp parallel
    {
        /* this thread's float32 piece of a block of weights (not for float32 weights) and
         * the sums of the pass's panels against its block */
        float *wb = wtype == 0 ? NULL : malloc((size_t)(G8_NR * G8_KC) * sizeof(float));
        float(*acc)[G8_GROUP][G8_NR][16] = malloc((size_t)per_pass * sizeof *acc);
        const int ok = acc != NULL && (wtype == 0 || wb != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t p0 = 0; p0 < panels; p0 += per_pass) {
            const int64_t p1 = panels - p0 < per_pass ? panels : p0 + per_pass;
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; gi++) {
                if (!ok) continue;
                const int64_t b0 = gi * G8_GROUP;
                const int64_t b1 = blocks - b0 < G8_GROUP ? blocks : b0 + G8_GROUP;
                for (int64_t b = b0; b < b1; b++) {
                    const int64_t n0 = b * G8_NR, nb = N - n0 < G8_NR ? N - n0 : G8_NR;
                    for (int64_t k0 = 0; k0 < K; k0 += G8_KC) {
                        const int64_t kc = K - k0 < G8_KC ? K - k0 : G8_KC;
                        const float *wr[G8_NR];
                        if (wtype == 0) {
                            for (int j = 0; j < G8_NR; j++)
                                wr[j] = (const float *)w + (n0 + (j < nb ? j : nb - 1)) * K + k0;
                        } else {
                            g8_convert_w(w, wtype, n0, nb, K, k0, kc, wb);
                            for (int j = 0; j < G8_NR; j++) wr[j] = wb + j * G8_KC;
                        }
                        for (int64_t p = p0; p < p1; p++) {
                            const float *piece = g8_piece(xp, panels, K, p, k0);
                            if (M - p * G8_MR > 8)
                                g8_kernel(piece, wr, kc, acc[p - p0][b - b0], k0 == 0, 2);
                            else
                                g8_kernel(piece, wr, kc, acc[p - p0][b - b0], k0 == 0, 1);
                        }
                    }
                }
                const int64_t n0 = b0 * G8_NR, cols = (N < b1 * G8_NR ? N : b1 * G8_NR) - n0;
                g8_store(acc, p0, p1, M, n0, cols, wtype, bias, scale, y, ldy, ybf16);
            }
        }
        free(wb);
        free(acc);
    }
    free(xp);
    return failed ? -1 : 0;
}
#endif
