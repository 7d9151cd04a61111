/* The small element-wise steps of a forward pass between the kernels that do the real work:
 * the embedding lookup, a residual add, the rotary cos/sin of the step's positions and the
 * float32 logits, the concatenation of two rows. Each is a handful of PyTorch ops,
 * microseconds apiece at decode sizes; here they are kernel calls, so that a decode step is
 * nothing but kernel calls and can be replayed without the interpreter (program.c). Wrapped
 * by hybridkv/ops/native/elementwise.py.
 *
 * Every result is rounded where PyTorch's ops round it (float32 math, bfloat16 results
 * rounded to nearest even), so a step computes the same values with or without them. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "hkv_common.h"

#define EW_PARALLEL_MIN 32768 /* elements below which a second thread does not pay */

/* out[i, :] = table[ids[i], :], times `scale` when `scaled` (embedding(ids) * scale: the
 * product rounded to the table's dtype).
 *   ids [n] int64; table [rows, cols] float32 or bfloat16 (bf16), contiguous; out [n, cols].
 * An id outside [0, rows) gets a zero row; the result is how many there were. */
int hkv_embedding(const int64_t *ids, int64_t n, const void *table, int64_t rows, int64_t cols,
                  int bf16, float scale, int scaled, void *out) {
    const size_t size = bf16 ? 2 : 4, row_bytes = size * (size_t)cols;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (n * cols >= EW_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        char *dst = (char *)out + (size_t)i * row_bytes;
        if (ids[i] < 0 || ids[i] >= rows) {
            memset(dst, 0, row_bytes);
            bad++;
            continue;
        }
        const char *src = (const char *)table + (size_t)ids[i] * row_bytes;
        if (!scaled) {
            memcpy(dst, src, row_bytes);
        } else if (bf16) {
            const uint16_t *s = (const uint16_t *)src;
            uint16_t *d = (uint16_t *)dst;
            for (int64_t c = 0; c < cols; c++)
                d[c] = hkv_f32_to_bf16(hkv_bf16_to_f32(s[c]) * scale);
        } else {
            const float *s = (const float *)src;
            float *d = (float *)dst;
            for (int64_t c = 0; c < cols; c++) d[c] = s[c] * scale;
        }
    }
    return bad;
}

/* out = x + h * mult over n elements of float32 or bfloat16 (bf16) arrays, as PyTorch's
 * `x + h * mult` rounds (the product first, then the sum); mult == 1 adds h itself. */
void hkv_add_scaled(const void *x, const void *h, float mult, void *out, int64_t n, int bf16) {
    const int scaled = mult != 1.0f;
    if (bf16) {
        const uint16_t *xs = (const uint16_t *)x, *hs = (const uint16_t *)h;
        uint16_t *o = (uint16_t *)out;
#pragma omp parallel for schedule(static) if (n >= EW_PARALLEL_MIN)
        for (int64_t i = 0; i < n; i++) {
            float v = hkv_bf16_to_f32(hs[i]);
            if (scaled) v = hkv_bf16_to_f32(hkv_f32_to_bf16(v * mult));
            o[i] = hkv_f32_to_bf16(hkv_bf16_to_f32(xs[i]) + v);
        }
    } else {
        const float *xs = (const float *)x, *hs = (const float *)h;
        float *o = (float *)out;
#pragma omp parallel for schedule(static) if (n >= EW_PARALLEL_MIN)
        for (int64_t i = 0; i < n; i++) {
            const float v = scaled ? hs[i] * mult : hs[i]; /* (ISO C: no fused multiply-add) */
            o[i] = xs[i] + v;
        }
    }
}

/* Rotary cos and sin of n positions, as RotaryEmbedding.cos_sin computes them:
 *   angle[t, i] = float(positions[t]) * inv_freq[i % half]        (i < 2 * half: two halves)
 *   cos[t, i] = cos(angle) * scaling, sin likewise (scaling == 1: unscaled), float32 math,
 *   rounded to bfloat16 when bf16.
 * cos, sin: [n, 2 * half] of that dtype. */
void hkv_rope_cos_sin(const int64_t *positions, int64_t n, const float *inv_freq, int64_t half,
                      float scaling, int bf16, void *cos_out, void *sin_out) {
    const int64_t width = 2 * half;
    for (int64_t t = 0; t < n; t++) {
        const float p = (float)positions[t];
        for (int64_t i = 0; i < half; i++) {
            const float angle = p * inv_freq[i];
            float c = cosf(angle), s = sinf(angle);
            if (scaling != 1.0f) {
                c *= scaling;
                s *= scaling;
            }
            const int64_t at = t * width + i;
            if (bf16) {
                uint16_t *co = (uint16_t *)cos_out, *so = (uint16_t *)sin_out;
                co[at] = co[at + half] = hkv_f32_to_bf16(c);
                so[at] = so[at + half] = hkv_f32_to_bf16(s);
            } else {
                float *co = (float *)cos_out, *so = (float *)sin_out;
                co[at] = co[at + half] = c;
                so[at] = so[at + half] = s;
            }
        }
    }
}

/* v rounded to bfloat16, kept in float32 */
static inline float ew_round(float v) { return hkv_bf16_to_f32(hkv_f32_to_bf16(v)); }

/* tanh(y) in plain arithmetic, so that a loop of it vectorizes (libm's tanhf is a scalar call:
 * 6.3 ms for one row of Gemma 3's 262144 logits, 14x PyTorch's vectorized tanh):
 * hkv_common.h's HKV_TANH steps (e^(-2|y|) by hkv_exp_nonpositive, the Taylor polynomial below
 * |y| = HKV_TANH_SMALL). Both sides are computed and one kept (a blend, no branch); +-inf ->
 * +-1, NaN stays NaN. */
static inline float ew_tanh(float y) {
    const float a = fabsf(y), a2 = a * a;
    const float e = hkv_exp_nonpositive(-2.0f * a);
    const float big = (1.0f - e) / (1.0f + e);
    const float small =
        a * (1.0f + a2 * (HKV_TANH_T3 + a2 * (HKV_TANH_T5 + a2 * (HKV_TANH_T7 +
                                                                  a2 * HKV_TANH_T9))));
    return copysignf(a < HKV_TANH_SMALL ? small : big, y);
}

#if HKV_AVX2 && !HKV_AVX512
/* ew_tanh of 8 lanes, the same steps in the same order (the same bits): without AVX-512's
 * masks GCC leaves a loop with ew_tanh's float select scalar (1.8 ms a 262144-logit row on the
 * x86-64-v3 build against 0.3 vectorized). The select is a blend. */
static inline __m256 ew_tanh8(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(sign, y), a2 = _mm256_mul_ps(a, a);
    const __m256 e = hkv_exp8_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    __m256 p = _mm256_mul_ps(a2, _mm256_set1_ps(HKV_TANH_T9));
    p = _mm256_mul_ps(a2, _mm256_add_ps(_mm256_set1_ps(HKV_TANH_T7), p));
    p = _mm256_mul_ps(a2, _mm256_add_ps(_mm256_set1_ps(HKV_TANH_T5), p));
    p = _mm256_mul_ps(a2, _mm256_add_ps(_mm256_set1_ps(HKV_TANH_T3), p));
    const __m256 small = _mm256_mul_ps(a, _mm256_add_ps(one, p));
    const __m256 lt = _mm256_cmp_ps(a, _mm256_set1_ps(HKV_TANH_SMALL), _CMP_LT_OQ);
    return _mm256_or_ps(_mm256_blendv_ps(big, small, lt), _mm256_and_ps(sign, y));
}

/* The soft-capped block's first n - n % 8 values (ew_softcap_block); returns how many. */
static int64_t ew_softcap8(const void *x, int bf16, float *o, int64_t n, float softcap,
                           float divisor) {
    const __m256 cap = _mm256_set1_ps(softcap), div = _mm256_set1_ps(divisor);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 v;
        if (bf16) {
            v = _mm256_div_ps(hkv_bf16x8_load((const uint16_t *)x + c), cap);
            v = hkv_round8_bf16(_mm256_mul_ps(hkv_round8_bf16(ew_tanh8(hkv_round8_bf16(v))), cap));
        } else {
            v = _mm256_mul_ps(ew_tanh8(_mm256_div_ps(_mm256_loadu_ps((const float *)x + c), cap)),
                              cap);
        }
        _mm256_storeu_ps(o + c, _mm256_div_ps(v, div));
    }
    return c;
}
#endif

#define EW_CAP_BLOCK 4096 /* logits per task of the soft-capped path */

/* One block of a row, soft-capped as hkv_logits_f32 says: o[c] = cap(x[c]) / divisor. */
static void ew_softcap_block(const void *x, int bf16, float *o, int64_t n, float softcap,
                             float divisor) {
    int64_t c0 = 0;
#if HKV_AVX2 && !HKV_AVX512
    c0 = ew_softcap8(x, bf16, o, n, softcap, divisor);
#endif
    if (bf16) { /* the quotient, the tanh and the product each rounded, as PyTorch in bf16 */
        const uint16_t *xb = x;
        for (int64_t c = c0; c < n; c++) {
            const float v = ew_round(ew_tanh(ew_round(hkv_bf16_to_f32(xb[c]) / softcap)));
            o[c] = ew_round(v * softcap) / divisor;
        }
    } else {
        const float *xf = x;
        for (int64_t c = c0; c < n; c++) o[c] = ew_tanh(xf[c] / softcap) * softcap / divisor;
    }
}

/* Float32 logits from the lm_head's rows: out = float(x) / divisor (divisor == 1: widened
 * only). x: [rows, cols] float32 or bfloat16 at a row stride; out: [rows, cols] contiguous.
 * softcap != 0 first caps every value in x's dtype, as Gemma's `tanh(x / c) * c` in PyTorch
 * (bfloat16: the quotient, the tanh and the product each rounded): then the work is spread
 * over blocks of EW_CAP_BLOCK values, not rows (a decode step's one row holds the whole
 * vocabulary). */
void hkv_logits_f32(const void *x, int64_t x_stride, int bf16, float *out, int64_t rows,
                    int64_t cols, float divisor, float softcap) {
    const int divide = divisor != 1.0f;
    if (softcap != 0.0f) {
        const int64_t blocks = (cols + EW_CAP_BLOCK - 1) / EW_CAP_BLOCK;
        const size_t esz = bf16 ? 2 : 4;
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols >= EW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t c0 = b * EW_CAP_BLOCK;
                const int64_t n = cols - c0 < EW_CAP_BLOCK ? cols - c0 : EW_CAP_BLOCK;
                const char *xr = (const char *)x + (size_t)(r * x_stride + c0) * esz;
                ew_softcap_block(xr, bf16, out + r * cols + c0, n, softcap, divisor);
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * cols >= 4 * EW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * cols;
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride;
            for (int64_t c = 0; c < cols; c++) o[c] = hkv_bf16_to_f32(xr[c]);
        } else {
            memcpy(o, (const float *)x + r * x_stride, sizeof(float) * (size_t)cols);
        }
        if (divide)
            for (int64_t c = 0; c < cols; c++) o[c] = o[c] / divisor;
    }
}

/* out = x rounded to bfloat16 (nearest even, NaN -> 0x7fc0, as torch) over n float32
 * elements. */
void hkv_to_bf16(const float *x, uint16_t *out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= 4 * EW_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = hkv_f32_to_bf16(x[i]);
}

/* relu(x)^2 over n elements (Nemotron-H's MLP activation): the square of the float32 value,
 * rounded once to bfloat16 when bf16, as F.relu(x).square() does (NaN stays NaN, as F.relu
 * keeps it). */
/* relu(v)^2 in integer arithmetic on the bits (masks, no conditional): GCC if-converts a
 * float comparison (which may raise an FP exception) only with AVX-512's masks, and sinks
 * v * v into the branch that uses it, so `v > 0.0f ? v * v : ...` left these loops scalar for
 * AVX2 and older CPUs. b > 0: v above +0; NaN bits pass through. */
static inline float ew_relu2(float v) {
    const float sq = v * v;
    int32_t b, s;
    memcpy(&b, &v, sizeof b);
    memcpy(&s, &sq, sizeof s);
    const int32_t pos = -(int32_t)(b > 0), nan = -(int32_t)((b & 0x7fffffff) > 0x7f800000);
    const int32_t r = (b & nan) | (s & pos & ~nan);
    float out;
    memcpy(&out, &r, sizeof out);
    return out;
}

void hkv_relu2(const void *x, void *out, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *xs = (const uint16_t *)x;
        uint16_t *o = (uint16_t *)out;
#pragma omp parallel for schedule(static) if (n >= EW_PARALLEL_MIN)
        for (int64_t i = 0; i < n; i++) o[i] = hkv_f32_to_bf16(ew_relu2(hkv_bf16_to_f32(xs[i])));
    } else {
        const float *xs = (const float *)x;
        float *o = (float *)out;
#pragma omp parallel for schedule(static) if (n >= EW_PARALLEL_MIN)
        for (int64_t i = 0; i < n; i++) o[i] = ew_relu2(xs[i]);
    }
}

/* out = a * b over [rows, cols], a and b float32 or bfloat16 rows at their row strides (unit
 * column stride), out contiguous. A bfloat16 out rounds as PyTorch's `a * b.to(bf16)`: a
 * float32 operand is rounded to bfloat16 first, then the product once. */
void hkv_mul_rows(const void *a, int64_t a_stride, int a_bf16, const void *b, int64_t b_stride,
                  int b_bf16, void *out, int out_bf16, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= EW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        /* the dtypes' tests out of the column loops (GCC unswitches them for AVX-512 only) */
        const uint16_t *ah = (const uint16_t *)a + r * a_stride;
        const uint16_t *bh = (const uint16_t *)b + r * b_stride;
        const float *af = (const float *)a + r * a_stride, *bf = (const float *)b + r * b_stride;
        uint16_t *oh = (uint16_t *)out + r * cols;
        float *of = (float *)out + r * cols;
        if (out_bf16 && a_bf16 && b_bf16) { /* (rounding a bfloat16 value keeps it) */
            for (int64_t c = 0; c < cols; c++)
                oh[c] = hkv_f32_to_bf16(hkv_bf16_to_f32(ah[c]) * hkv_bf16_to_f32(bh[c]));
        } else if (!out_bf16 && !a_bf16 && !b_bf16) {
            for (int64_t c = 0; c < cols; c++) of[c] = af[c] * bf[c];
        } else {
            for (int64_t c = 0; c < cols; c++) {
                float va = a_bf16 ? hkv_bf16_to_f32(ah[c]) : af[c];
                float vb = b_bf16 ? hkv_bf16_to_f32(bh[c]) : bf[c];
                if (out_bf16) {
                    va = hkv_bf16_to_f32(hkv_f32_to_bf16(va));
                    vb = hkv_bf16_to_f32(hkv_f32_to_bf16(vb));
                    oh[c] = hkv_f32_to_bf16(va * vb);
                } else {
                    of[c] = va * vb;
                }
            }
        }
    }
}

/* out = [a | b] over rows (torch.cat([a, b], dim=-1) of two [rows, *] tensors of one dtype):
 * each row of out (contiguous, a_bytes + b_bytes) is a's row then b's row, copied bytes (any
 * dtype, bit for bit). a and b rows at their row strides in bytes, each row contiguous. */
void hkv_concat_rows(const void *a, int64_t a_stride, int64_t a_bytes, const void *b,
                     int64_t b_stride, int64_t b_bytes, void *out, int64_t rows) {
    const int64_t width = a_bytes + b_bytes;
#pragma omp parallel for schedule(static) if (rows * width >= 4 * EW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        char *o = (char *)out + r * width;
        memcpy(o, (const char *)a + r * a_stride, (size_t)a_bytes);
        memcpy(o + a_bytes, (const char *)b + r * b_stride, (size_t)b_bytes);
    }
}

/* out = gelu_tanh(gate) * up over [rows, cols] (Gemma's MLP), gate and up rows at their row
 * strides, out contiguous: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in float32, the
 * activation rounded to bfloat16 before the product when bf16 (as F.gelu(gate) * up). */
void hkv_gelu_tanh_mul(const void *gate, int64_t g_stride, const void *up, int64_t u_stride,
                       void *out, int64_t rows, int64_t cols, int bf16) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
#pragma omp parallel for schedule(static) if (rows * cols >= EW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t gi = r * g_stride + c, ui = r * u_stride + c, oi = r * cols + c;
            const float g = bf16 ? hkv_bf16_to_f32(((const uint16_t *)gate)[gi])
                                 : ((const float *)gate)[gi];
            const float inner = beta * (g + kappa * (g * g * g));
            float act = 0.5f * g * (1.0f + tanhf(inner));
            if (bf16) {
                act = hkv_bf16_to_f32(hkv_f32_to_bf16(act));
                const float u = hkv_bf16_to_f32(((const uint16_t *)up)[ui]);
                ((uint16_t *)out)[oi] = hkv_f32_to_bf16(act * u);
            } else {
                ((float *)out)[oi] = act * ((const float *)up)[ui];
            }
        }
}
