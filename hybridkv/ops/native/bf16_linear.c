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
 * thread. Without AVX512-BF16 (and AVX-512 F/BW/VL) a plain loop is built instead (the same
 * result up to summation order) and hkv_bf16_linear_fast() returns 0, so the caller keeps
 * oneDNN. */

#include <stdint.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AVX512_BF16
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

#if B16_FAST

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
    if (seq) {
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

#else /* no AVX512-BF16: one output at a time */

void hkv_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
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

#endif
