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
 * thread. Without AVX-512 F a plain loop is built instead (the same result up to summation
 * order) and hkv_f32_linear_fast() returns 0, so the caller keeps oneDNN. */

#include <stdint.h>
#include <string.h>
#include "hkv_common.h"

#if HKV_AVX512
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

#if F32_FAST

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

#else /* no AVX-512: one output at a time */

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
