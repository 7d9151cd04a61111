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
 * The math is float32: x widened as read, each int8 weight converted to float32 in a register
 * and reused for a block of rows of x, products summed in float32, the row's scale applied
 * once to the sum (it factors out of the dot product), rounded once to y's dtype. So a
 * float32 model gets the dequantized weight's product to float32 rounding (no bfloat16 step).
 *
 * With AVX-512 (F, BW, VL): register tiles of I8_MB rows of x by I8_NB weight rows, each
 * (row, column) pair summing 16 lanes along K (masked loads for the last K % 16), reduced at
 * the end: I8_MB x I8_NB sums + I8_NB weight vectors + 1 input vector fill 31 of the 32
 * registers. OpenMP splits the weight rows into blocks (torch.set_num_threads applies: the
 * same libgomp). Without AVX-512 a plain loop (hkv_int8_vectorized() says which was built, so
 * the caller can keep PyTorch's path instead). */

#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define I8_AVX512 1
#else
#define I8_AVX512 0
#endif

#define I8_CHUNK_BYTES (256 * 1024) /* int8 weights per chunk when M spans several tiles */
#define I8_M_CHUNK 32 /* rows of x (and y) per pass over the weights */
#define I8_MB 4 /* rows of x per register tile */
#define I8_NB 6 /* weight rows (outputs) per register tile */
#define I8_INLINE static inline __attribute__((always_inline))
#define I8_UNROLL _Pragma("GCC unroll 8") /* whole tiles unrolled: the sums stay in registers */

static inline float i8_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t i8_f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float i8_load1(const void *x, int bf16, int64_t i) {
    return bf16 ? i8_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline void i8_store1(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = i8_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

int hkv_int8_vectorized(void) { return I8_AVX512; }

#if I8_AVX512

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

#ifdef __AVX512BF16__
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
            i8_store1(y, ybf16, (m0 + i) * ldy + n0 + j, sum * i8_bf16_to_f32(scale[n0 + j]));
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

/* rows m_lo .. m_hi - 1 of y, outputs n0 .. n0 + nb - 1 */
static void i8_block(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t m_lo, int64_t m_hi, int64_t K, void *y,
                     int64_t ldy, int ybf16, int64_t n0, int64_t nb) {
    if (xbf16)
        I8_ROWS(1);
    else
        I8_ROWS(0);
}

#else /* no AVX-512: one output at a time */

static void i8_block(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t m_lo, int64_t m_hi, int64_t K, void *y,
                     int64_t ldy, int ybf16, int64_t n0, int64_t nb) {
    for (int64_t m = m_lo; m < m_hi; m++)
        for (int64_t n = n0; n < n0 + nb; n++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += i8_load1(x, xbf16, m * ldx + k) * q[n * K + k];
            i8_store1(y, ybf16, m * ldy + n, sum * i8_bf16_to_f32(scale[n]));
        }
}

#endif

void hkv_int8_linear(const void *x, int64_t ldx, int xbf16, const int8_t *q,
                     const uint16_t *scale, int64_t M, int64_t N, int64_t K, void *y,
                     int64_t ldy, int ybf16) {
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
