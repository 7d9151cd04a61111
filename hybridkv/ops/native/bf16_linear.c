/* bfloat16 linear for small batches on the CPU: y = x @ w^T (+ bias), all bfloat16, float32
 * sums rounded once. hybridkv/layers/linear.py (PackedLinear) calls it for bfloat16 weights at
 * the batch sizes where it beats oneDNN's packed linear; hybridkv/ops/native/bf16_linear.py
 * declares it. Compiled into the one native library with the other C files of this folder.
 *
 *     x     [M, K] bfloat16 rows at a row stride (unit column stride)
 *     w     [N, K] bfloat16, contiguous: the nn.Linear weight itself, not repacked
 *     bias  [N] bfloat16 or NULL
 *     y     [M, N] bfloat16 rows at a row stride
 *
 * A decode step's linears are bound by streaming the weight (at M = 1, 2 bytes of weight per
 * multiply-add), so each weight vector is read once from memory and used for every row of x.
 * Register tiles: MB rows of x by NB weight rows, MB * NB = 16 float32 accumulators, each
 * summing 16 lanes of pair products (vdpbf16ps: 32 values of k per step; masked loads for the
 * last K % 32, zeros past K); the 16 sums of a tile are reduced together by a transposing tree
 * (45 shuffles and adds, not 16 horizontal reductions), the bias added in float32, rounded to
 * bfloat16 once. Tiles: M = 1 one row of x by 16 weight rows, M = 2 two by 8, otherwise four
 * by 4 (the last rows of x in a tile of 1..3). Weight rows past N read the last row again
 * (their sums are dropped).
 *
 * Memory order (measured on Zen 5, weights out of cache): a thread's weight blocks are one
 * contiguous range, and the first tile of rows of every block reads its NB weight rows one after
 * the other (one sequential stream, prefetched B16_AHEAD bytes ahead): reading the NB rows side
 * by side, k step by k step, streamed 20-25% below a plain read at M = 1. When M needs more
 * than one tile of rows, the block is in L1 for the others, which read the NB rows side by side
 * (fewer loads per product) and prefetch the memory B16_SPREAD_AHEAD bytes past the block's
 * start, a few lines per step, so that the stream goes on while they compute.
 *
 * OpenMP splits the blocks into one contiguous range per thread (the same libgomp as PyTorch:
 * torch.set_num_threads applies); weights under B16_PARALLEL_MIN values run on the calling
 * thread.
 *
 * AVX2 + FMA without AVX512-BF16 (HKV_AVX2: AVX2-only CPUs, and AVX-512 ones without BF16):
 * x is widened to float32 once per call (exactly; on the stack up to B16_X_STACK values), then
 * f32_linear.c's 8-lane tiles and stream run on it, each 8 weights widened in registers as
 * they are loaded (vpmovzxwd from memory, a 16-bit shift: 2 uops, one of them on the shuffle
 * port, which the FMAs do not use) and multiplied in float32, the sums rounded to bfloat16
 * once (hkv_f32_to_bf16, after the bias): the same math as above. Tiles: M = 1 one row of x by
 * 8 weight rows, M = 2 two by 4, else four by 2; the last K % 8 weights through a zeroed copy
 * (AVX2 has no masked 16-bit load). Above B16_GEMM_M rows, the AVX2 GEMM of f32_linear.c
 * (hkv_avx2_gemm: x in panels of 16 rows, the weights widened a block at a time), which beats
 * the tiles from 24 rows (0.88-0.92x their time; 0.77-0.80x at 32) and loses at 17-20 (its
 * panel of 16 rows then does 32 rows' work). oneDNN has no bfloat16 on an AVX2 CPU and
 * PyTorch's bfloat16 matmul runs 3-5x below float32 there, so this is the whole bfloat16 linear
 * on AVX2 (hybridkv/layers/linear.py). Measured under the AVX2 simulation (this Xeon: x86-64-v3
 * build, ATen, oneDNN and MKL at AVX2; 1 thread, weights out of cache; benchmarks/README.md
 * "AVX2"): at M = 1 2.3-2.5x the speed of oneDNN's float32 linear of the same layer and
 * 1.6-2.0x PyTorch's bfloat16 matmul, at M = 8 2.0-2.2x and at 16 1.35-1.47x oneDNN's
 * float32; from 24 rows the GEMM runs at 1.02-1.24x oneDNN's float32 speed up to M = 128,
 * 0.94-1.10x at 512 (both at the FMA ports' peak there).
 *
 * Without either a plain loop is built instead (the same result up to summation order) and
 * hkv_bf16_linear_fast() returns 0, so the caller keeps oneDNN. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AVX512_BF16 || HKV_AVX2
#define B16_FAST 1
#else
#define B16_FAST 0
#endif

#define B16_PARALLEL_MIN (32 * 1024) /* weight values: below, a second thread does not pay */
#define B16_AHEAD 4096               /* bytes: the sequential tile's prefetch distance */
#define B16_SPREAD_AHEAD 8192        /* bytes past the block: the other tiles' prefetches */
#define B16_INLINE static inline __attribute__((always_inline))
#define B16_UNROLL _Pragma("GCC unroll 16") /* whole tiles unrolled: sums stay in registers */

int hkv_bf16_linear_fast(void) { return B16_FAST; }

#if HKV_AVX512_BF16

#define B16_LOADZ(MASK, P) _mm512_maskz_loadu_epi16(MASK, P)
#define B16_LOAD(MASK, P) _mm512_loadu_si512(P)

/* acc[i * NB + j] += x[row i, k ..] . w[row j, k ..] over 32 (or MASK) values of k for every
 * row j at once; then `pf_lines` cache lines of prefetch from `pf` on */
#define B16_STEP(MASK, LOAD)                                                                 \
    do {                                                                                     \
        __m512bh wv[16];                                                                     \
        B16_UNROLL for (int j = 0; j < NB; j++) wv[j] = (__m512bh)LOAD(MASK, wr[j] + k);     \
        for (int64_t l = 0; l < pf_lines; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);      \
        B16_UNROLL for (int i = 0; i < mb; i++) {                                            \
            const __m512bh xv = (__m512bh)LOAD(MASK, xr[i] + k);                             \
            B16_UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] =                        \
                _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]);                                \
        }                                                                                    \
    } while (0)

/* the same for weight row j alone (rows one after the other: one sequential stream) */
#define B16_ROW_STEP(MASK, LOAD)                                                             \
    do {                                                                                     \
        const __m512bh wv = (__m512bh)LOAD(MASK, wr[j] + k);                                 \
        _mm_prefetch((const char *)(wr[j] + k) + B16_AHEAD, _MM_HINT_T0);                    \
        B16_UNROLL for (int i = 0; i < mb; i++) acc[i * NB + j] =                            \
            _mm512_dpbf16_ps(acc[i * NB + j], (__m512bh)LOAD(MASK, xr[i] + k), wv);          \
    } while (0)

/* rows m0 .. m0 + mb - 1 of y, columns n0 .. n0 + nb - 1 (nb <= NB); mb, NB and seq are
 * constants at every call. seq: the weight rows one after the other; else side by side, with
 * pf_lines lines of prefetch from pf per step */
B16_INLINE void b16_tile(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                         int64_t K, uint16_t *y, int64_t ldy, int64_t m0, int64_t n0,
                         int64_t nb, const int mb, const int NB, const int seq, const char *pf,
                         int64_t pf_lines) {
    const uint16_t *xr[4], *wr[16];
    B16_UNROLL for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * ldx;
    B16_UNROLL for (int j = 0; j < NB; j++) wr[j] = w + (n0 + (j < nb ? j : nb - 1)) * K;
    __m512 acc[16];
    B16_UNROLL for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    const int64_t whole = K & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((1ull << (K - whole)) - 1);
    if (seq && mb <= 2) {
        /* one or two rows of x: a second sum per row of x and weight row takes every other
         * step, so that a step's vdpbf16ps does not wait for the one before it (one chain per
         * row of x held the stream back: benchmarks/native_ab.py, 2 threads on Zen 4, weights
         * from memory: 6-18% less time per layer at M = 1 while the memory kept up, 1-7% when
         * it streamed slower; 6-10% at M = 2, where unchanged code read +1-5% in the same runs;
         * four sums gain nothing over two) */
        B16_UNROLL for (int j = 0; j < NB; j++) {
            __m512 odd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            int64_t k = 0;
            for (; k + 64 <= whole; k += 64) {
                const uint16_t *wk = wr[j] + k;
                _mm_prefetch((const char *)wk + B16_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)wk + B16_AHEAD + 64, _MM_HINT_T0);
                const __m512bh w0 = (__m512bh)B16_LOAD(0, wk);
                const __m512bh w1 = (__m512bh)B16_LOAD(0, wk + 32);
                B16_UNROLL for (int i = 0; i < mb; i++) {
                    acc[i * NB + j] = _mm512_dpbf16_ps(
                        acc[i * NB + j], (__m512bh)B16_LOAD(0, xr[i] + k), w0);
                    odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)B16_LOAD(0, xr[i] + k + 32), w1);
                }
            }
            for (; k < whole; k += 32) B16_ROW_STEP(0, B16_LOAD);
            if (k < K) B16_ROW_STEP(tail, B16_LOADZ);
            B16_UNROLL for (int i = 0; i < mb; i++)
                acc[i * NB + j] = _mm512_add_ps(acc[i * NB + j], odd[i]);
        }
    } else if (seq) {
        B16_UNROLL for (int j = 0; j < NB; j++) {
            int64_t k = 0;
            for (; k < whole; k += 32) B16_ROW_STEP(0, B16_LOAD);
            if (k < K) B16_ROW_STEP(tail, B16_LOADZ);
        }
    } else {
        int64_t k = 0;
        for (; k < whole; k += 32) B16_STEP(0, B16_LOAD);
        if (k < K) B16_STEP(tail, B16_LOADZ);
    }
    __m512 sums = hkv_reduce16(acc); /* lane i * NB + j: y[m0 + i, n0 + j] */
    if (bias) {
        float b[16];
        B16_UNROLL for (int t = 0; t < 16; t++) {
            const int j = t % NB;
            b[t] = j < nb ? hkv_bf16_to_f32(bias[n0 + j]) : 0.0f;
        }
        sums = _mm512_add_ps(sums, _mm512_loadu_ps(b));
    }
    uint16_t out[16];
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(sums));
    B16_UNROLL for (int i = 0; i < mb; i++)
        memcpy(y + (m0 + i) * ldy + n0, out + i * NB, (size_t)nb * 2);
}

#define B16_TILE(MB_, SEQ_)                                                                  \
    b16_tile(x, ldx, w, bias, K, y, ldy, m0, n0, nb, MB_, NB, SEQ_, pf, pf_lines)

/* block n0 .. n0 + nb - 1 of weight rows against every row of x: the first tile of rows reads
 * the block from memory, the others from L1 while they prefetch what follows (`more`: a block
 * follows this one) */
B16_INLINE void b16_block(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                          int64_t M, int64_t K, uint16_t *y, int64_t ldy, int64_t n0, int64_t nb,
                          const int NB, const int MB, int more) {
    const int64_t tiles = (M + MB - 1) / MB, steps = (K + 31) / 32;
    const int64_t lines = (NB * K * 2 + 63) / 64, spread = steps * (tiles - 1);
    const int64_t pf_lines = more && tiles > 1 ? (lines + spread - 1) / spread : 0;
    const char *pf = (const char *)(w + n0 * K) + B16_SPREAD_AHEAD;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const int seq = m0 == 0;
        if (MB == 1 || left == 1) {
            if (seq) B16_TILE(1, 1); else B16_TILE(1, 0);
        } else if (MB == 2 || left == 2) {
            if (seq) B16_TILE(2, 1); else B16_TILE(2, 0);
        } else if (left == 3) {
            if (seq) B16_TILE(3, 1); else B16_TILE(3, 0);
        } else {
            if (seq) B16_TILE(4, 1); else B16_TILE(4, 0);
        }
        if (!seq) pf += steps * pf_lines * 64;
    }
}

#define B16_BLOCKS(NB_, MB_)                                                                 \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (parallel)")                          \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            b16_block(x, ldx, w, bias, M, K, y, ldy, n0, nb, NB_, MB_, b + 1 < blocks);      \
        }                                                                                    \
    } while (0)

void hkv_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     int64_t M, int64_t N, int64_t K, uint16_t *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* no products: the bias, or zeros */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0;
        return;
    }
    const int parallel = N * K >= B16_PARALLEL_MIN;
    if (M == 1)
        B16_BLOCKS(16, 1);
    else if (M == 2)
        B16_BLOCKS(8, 2);
    else
        B16_BLOCKS(4, 4);
}

#else /* AVX2 + FMA, or no vectors at all */

/* one output at a time: the build without AVX2, and the AVX2 build's fallback when it cannot
 * allocate its float32 copy of x */
static void b16_plain(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                      int64_t M, int64_t N, int64_t K, uint16_t *y, int64_t ldy) {
#pragma omp parallel for schedule(static) if (N * K >= B16_PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++)
                sum += hkv_bf16_to_f32(x[m * ldx + k]) * hkv_bf16_to_f32(w[n * K + k]);
            y[m * ldy + n] = hkv_f32_to_bf16(sum + (bias ? hkv_bf16_to_f32(bias[n]) : 0.0f));
        }
}

#if HKV_AVX2

#define B16_NEAR 2048 /* bytes: a sequential row's prefetch into L1, ahead of its loads */
#define B16_FAR 16384 /* bytes: the stream's prefetch into L2, ahead of the block's start */
#define B16_X_STACK 8192 /* float32 values of x widened on the stack; more: on the heap */
#define B16_GEMM_M 20    /* rows of x above which hkv_avx2_gemm (f32_linear.c) runs instead */

/* 8 bfloat16 at P -> float32 (exact): zero-extended to 32 bits, shifted into the top half */
#define B16_W8(P)                                                                            \
    _mm256_castsi256_ps(                                                                     \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(P))), 16))

/* the last K % 8 weights of a row, zeros past them (never reads past the row) */
B16_INLINE __m256 b16_w8_tail(const uint16_t *p, int64_t n) {
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * 2);
    return B16_W8(t);
}

#define B16_W8Z(P) b16_w8_tail(P, K - whole)

/* bfloat16 rows x [M, K] (row stride ldx) -> float32 xw [M, ldw] (exact; zeros from K to
 * ldw, a multiple of 8) */
static void b16_widen_x(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xw,
                        int64_t ldw) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *r = x + m * ldx;
        float *o = xw + m * ldw;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, B16_W8(r + k));
        for (; k < ldw; k++) o[k] = k < K ? hkv_bf16_to_f32(r[k]) : 0.0f;
    }
}

/* weight rows side by side: acc[i * NB + j] += x[row i, k .. k + 7] * w[row j, same] (x
 * widened already: full loads, zeros past K) */
#define B16_SIDE_STEP8(WLOAD)                                                                \
    do {                                                                                     \
        __m256 wv[8];                                                                        \
        B16_UNROLL for (int j = 0; j < NB; j++) wv[j] = WLOAD(wr[j] + k);                    \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        B16_UNROLL for (int i = 0; i < mb; i++) {                                            \
            const __m256 xv = _mm256_loadu_ps(xr[i] + k);                                    \
            B16_UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] =                        \
                _mm256_fmadd_ps(xv, wv[j], acc[i * NB + j]);                                 \
        }                                                                                    \
    } while (0)

/* weight row j alone (one sequential stream): SUM[i] += x[row i, K0 .. K0 + 7] * w[row j,
 * same] */
#define B16_ROW_STEP8(WLOAD, SUM, K0)                                                        \
    do {                                                                                     \
        const __m256 wv = WLOAD(wr[j] + (K0));                                               \
        HKV_FAR_STEP(debt, lines, total, pf);                                                \
        B16_UNROLL for (int i = 0; i < mb; i++) SUM[i] =                                     \
            _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + (K0)), wv, SUM[i]);                      \
    } while (0)

typedef struct { /* a block's far prefetch: the next line, and where its spread stands */
    const char *at;
    int64_t debt, lines, total;
} B16Far;

/* rows m0 .. m0 + mb - 1 of y by columns n0 .. n0 + nb - 1 (nb <= NB, mb * NB <= 8; mb, NB
 * and seq constants at every call) from x widened to float32 (xw, row stride ldw). seq: the
 * weight rows one after the other (two sets of sums per row: chains of K / 16 dependent
 * FMAs), each with a near prefetch per 64-byte line; else side by side. Every 8-value step
 * takes its turn in the block's far prefetch */
B16_INLINE void b16_tile8(const float *xw, int64_t ldw, const uint16_t *w, const uint16_t *bias,
                          int64_t K, uint16_t *y, int64_t ldy, int64_t m0, int64_t n0,
                          int64_t nb, const int mb, const int NB, const int seq, B16Far *far) {
    const float *xr[4];
    const uint16_t *wr[8];
    B16_UNROLL for (int i = 0; i < mb; i++) xr[i] = xw + (m0 + i) * ldw;
    B16_UNROLL for (int j = 0; j < NB; j++) wr[j] = w + (n0 + (j < nb ? j : nb - 1)) * K;
    const char *pf = far->at;
    int64_t debt = far->debt;
    const int64_t lines = far->lines, total = far->total;
    __m256 acc[8];
    B16_UNROLL for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    const int64_t whole = K & ~(int64_t)7;
    if (seq) {
        B16_UNROLL for (int j = 0; j < NB; j++) {
            __m256 even[4], odd[4];
            B16_UNROLL for (int i = 0; i < mb; i++) even[i] = odd[i] = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= whole; k += 32) { /* a cache line of the row */
                _mm_prefetch((const char *)(wr[j] + k) + B16_NEAR, _MM_HINT_T0);
                B16_ROW_STEP8(B16_W8, even, k);
                B16_ROW_STEP8(B16_W8, odd, k + 8);
                B16_ROW_STEP8(B16_W8, even, k + 16);
                B16_ROW_STEP8(B16_W8, odd, k + 24);
            }
            for (; k + 16 <= whole; k += 16) {
                B16_ROW_STEP8(B16_W8, even, k);
                B16_ROW_STEP8(B16_W8, odd, k + 8);
            }
            if (k < whole) {
                B16_ROW_STEP8(B16_W8, even, k);
                k += 8;
            }
            if (k < K) B16_ROW_STEP8(B16_W8Z, odd, k);
            B16_UNROLL for (int i = 0; i < mb; i++) acc[i * NB + j] =
                _mm256_add_ps(even[i], odd[i]);
        }
    } else {
        int64_t k = 0;
        for (; k < whole; k += 8) B16_SIDE_STEP8(B16_W8);
        if (k < K) B16_SIDE_STEP8(B16_W8Z);
    }
    far->at = pf, far->debt = debt;
    float out[8]; /* lane i * NB + j: y[m0 + i, n0 + j] */
    _mm256_storeu_ps(out, hkv_reduce8(acc));
    B16_UNROLL for (int i = 0; i < mb; i++) B16_UNROLL for (int j = 0; j < NB; j++) {
            if (j >= nb) break;
            const float b = bias ? hkv_bf16_to_f32(bias[n0 + j]) : 0.0f;
            y[(m0 + i) * ldy + n0 + j] = hkv_f32_to_bf16(out[i * NB + j] + b);
        }
}

#define B16_TILE8(MB_, SEQ_)                                                                 \
    b16_tile8(xw, ldw, w, bias, K, y, ldy, m0, n0, nb, MB_, NB, SEQ_, &far)

/* block n0 .. n0 + nb - 1 of weight rows against every row of x: the first tile of rows
 * streams the block, the others read it from L1; the block's far prefetch (its size in bytes,
 * B16_FAR past its start, not past w_end) is spread over all the tiles' steps */
B16_INLINE void b16_block8(const float *xw, int64_t ldw, const uint16_t *w, const uint16_t *bias,
                           int64_t M, int64_t K, uint16_t *y, int64_t ldy, int64_t n0,
                           int64_t nb, const int NB, const int MB, const char *w_end) {
    const int64_t tiles = (M + MB - 1) / MB, steps = (K + 7) / 8;
    const int64_t lines = (NB * K * 2 + 63) / 64;
    const char *pf = (const char *)(w + n0 * K) + B16_FAR;
    const int64_t left_lines = pf < w_end ? (w_end - pf) / 64 : 0;
    B16Far far = {pf, 0, lines < left_lines ? lines : left_lines, (NB + tiles - 1) * steps};
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const int seq = m0 == 0;
        if (MB == 1 || left == 1) {
            if (seq) B16_TILE8(1, 1); else B16_TILE8(1, 0);
        } else if (MB == 2 || left == 2) {
            if (seq) B16_TILE8(2, 1); else B16_TILE8(2, 0);
        } else if (left == 3) {
            if (seq) B16_TILE8(3, 1); else B16_TILE8(3, 0);
        } else {
            if (seq) B16_TILE8(4, 1); else B16_TILE8(4, 0);
        }
    }
}

#define B16_BLOCKS8(NB_, MB_)                                                                \
    do {                                                                                     \
        const int64_t blocks = (N + NB_ - 1) / NB_;                                          \
        _Pragma("omp parallel for schedule(static) if (parallel)")                          \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const int64_t n0 = b * NB_, nb = N - n0 < NB_ ? N - n0 : NB_;                    \
            b16_block8(xw, ldw, w, bias, M, K, y, ldy, n0, nb, NB_, MB_, w_end);             \
        }                                                                                    \
    } while (0)

/* x widened to float32 once (exactly: each row's values read by every block), then tiles of
 * one row of x by 8 weight rows (M = 1), two by 4 (M = 2), else four by 2 */
void hkv_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     int64_t M, int64_t N, int64_t K, uint16_t *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* no products: the bias, or zeros */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0;
        return;
    }
    if (M > B16_GEMM_M && hkv_avx2_gemm(x, ldx, 1, w, 1, bias, NULL, M, N, K, y, ldy, 1) == 0)
        return;
    const int64_t ldw = (K + 7) & ~(int64_t)7;
    float stack[B16_X_STACK] __attribute__((aligned(32)));
    float *heap = M * ldw > B16_X_STACK ? aligned_alloc(32, (size_t)(M * ldw) * sizeof(float))
                                        : NULL;
    float *xw = M * ldw > B16_X_STACK ? heap : stack;
    if (xw == NULL) { /* (no memory for the copy) */
        b16_plain(x, ldx, w, bias, M, N, K, y, ldy);
        return;
    }
    b16_widen_x(x, ldx, M, K, xw, ldw);
    const int parallel = N * K >= B16_PARALLEL_MIN;
    const char *w_end = (const char *)(w + N * K);
    if (M == 1)
        B16_BLOCKS8(8, 1);
    else if (M == 2)
        B16_BLOCKS8(4, 2);
    else
        B16_BLOCKS8(2, 4);
    free(heap);
}

#else /* neither AVX512-BF16 nor AVX2: one output at a time */

void hkv_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     int64_t M, int64_t N, int64_t K, uint16_t *y, int64_t ldy) {
    b16_plain(x, ldx, w, bias, M, N, K, y, ldy);
}

#endif

#endif
