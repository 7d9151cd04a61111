/* Helpers shared by the C files of hybridkv/ops/native (each includes this header; they are
 * compiled together into one library, and the header is part of the build's hash). */
#ifndef HKV_COMMON_H
#define HKV_COMMON_H

#include <stdint.h>
#include <string.h>

/* The instruction sets this library is built for (one place: every C file of this folder tests
 * these, never the compiler's macros). Each is 0 or 1; cpu.c reports them and what the CPU has
 * (hybridkv/ops/native/cpu.py: the CPU record). -march decides them: native by default,
 * HYBRIDKV_NATIVE_MARCH=x86-64-v3 for AVX2 + FMA + F16C, x86-64 for none of them. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HKV_AVX2 1 /* 8 float32 lanes with fused multiply-adds; bf16 widened by a shift */
#else
#define HKV_AVX2 0
#endif
#if defined(__AVXVNNI__) && HKV_AVX2
#define HKV_AVX_VNNI 1 /* 8-bit dot products on 256-bit vectors (vpdpbusd, VEX) */
#else
#define HKV_AVX_VNNI 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                 \
    defined(__AVX512DQ__)
#define HKV_AVX512 1 /* 16 float32 lanes, mask registers */
#else
#define HKV_AVX512 0
#endif
#if HKV_AVX512 && defined(__AVX512BF16__)
#define HKV_AVX512_BF16 1 /* vdpbf16ps, vcvtneps2bf16 */
#else
#define HKV_AVX512_BF16 0
#endif
#if HKV_AVX512 && defined(__AVX512VNNI__)
#define HKV_AVX512_VNNI 1
#else
#define HKV_AVX512_VNNI 0
#endif
#if HKV_AVX512_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HKV_AMX_BF16 1 /* tiles (the process asks the kernel's permission once: hkv_amx_ready) */
#else
#define HKV_AMX_BF16 0
#endif
#if HKV_AMX_BF16 && defined(__AMX_INT8__)
#define HKV_AMX_INT8 1
#else
#define HKV_AMX_INT8 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define HKV_NEON 1
#else
#define HKV_NEON 0
#endif
#if HKV_NEON && defined(__ARM_FEATURE_DOTPROD)
#define HKV_NEON_DOT 1
#else
#define HKV_NEON_DOT 0
#endif
#if HKV_NEON && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#define HKV_NEON_BF16 1
#else
#define HKV_NEON_BF16 0
#endif
#if HKV_AVX2 || HKV_AVX512
#include <immintrin.h>
#endif

/* bfloat16 -> float32: a bfloat16 is the top half of a float32's bits (exact). */
static inline float hkv_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounded to nearest even as torch rounds (NaN -> the quiet NaN 0x7fc0). */
static inline uint16_t hkv_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* tanh(y) = sign(y) (1 - e) / (1 + e), e = e^(-2|y|), and below |y| = HKV_TANH_SMALL (where
 * 1 - e would lose digits) y times its Taylor polynomial in y^2 (tanh(y) / y: 1, -1/3, 2/15,
 * -17/315, 62/2835): relative error below 3e-7. The soft-caps of decode_attention.c and
 * elementwise.c take these steps. */
#define HKV_TANH_SMALL 0.3f
#define HKV_TANH_T3 (-0.33333333f)
#define HKV_TANH_T5 0.13333333f
#define HKV_TANH_T7 (-0.053968254f)
#define HKV_TANH_T9 0.021869489f

/* e^x for x <= 0 in plain arithmetic, so that loops calling it vectorize (libm's expf is a
 * scalar call). e^x = 2^k * e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-6
 * Taylor polynomial: relative error below 3e-7. Inputs below -87 give about 1.6e-38 instead of
 * a denormal or zero (a softmax weight that small vanishes next to e^0 = 1). */
static inline float hkv_exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float k = (x * 1.44269504f + shift) - shift;
    const float r = (x - k * 0.693145751953125f) - k * 1.42860677e-6f;
    const float p =
        1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f
                                + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(v) = v / (1 + e^-v), from e^-|v| (<= 1, so hkv_exp_nonpositive applies): relative
 * error below 4e-7. Below -87, where e^v leaves float32's normal range (and the clamped
 * exponential would give v * 1.6e-38, -4.9 at v = -3e38), v * 0: -0 as torch's silu, NaN
 * at -inf. */
static inline float hkv_silu(float v) {
    const float z = hkv_exp_nonpositive(v < 0.0f ? v : -v);
    return v < -87.0f ? v * 0.0f : (v < 0.0f ? v * z : v) / (1.0f + z);
}

#if HKV_AVX512

/* hkv_exp_nonpositive and hkv_silu on 16 lanes: the same operations in the same order (no
 * fused multiply-adds), so that vector and scalar loops give the same bits. */
static inline __attribute__((always_inline)) __m512 hkv_exp16_nonpositive(__m512 x) {
#define HKV_C(v) _mm512_set1_ps(v)
    x = _mm512_max_ps(x, HKV_C(-87.0f));
    const __m512 shift = HKV_C(12582912.0f);
    const __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, HKV_C(1.44269504f)), shift),
                                   shift);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, HKV_C(0.693145751953125f))),
                                   _mm512_mul_ps(k, HKV_C(1.42860677e-6f)));
    __m512 p = _mm512_add_ps(HKV_C(8.3333338e-3f), _mm512_mul_ps(r, HKV_C(1.3888889e-3f)));
    p = _mm512_add_ps(HKV_C(4.1666668e-2f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(HKV_C(1.6666667e-1f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(HKV_C(0.5f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(HKV_C(1.0f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(HKV_C(1.0f), _mm512_mul_ps(r, p));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __attribute__((always_inline)) __m512 hkv_silu16(__m512 v) {
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 z =
        hkv_exp16_nonpositive(_mm512_mask_blend_ps(neg, _mm512_sub_ps(HKV_C(0.0f), v), v));
    const __m512 num = _mm512_mask_mul_ps(v, neg, v, z);
    const __mmask16 under = _mm512_cmp_ps_mask(v, HKV_C(-87.0f), _CMP_LT_OQ);
    const __m512 y = _mm512_div_ps(num, _mm512_add_ps(HKV_C(1.0f), z));
    return _mm512_mask_mul_ps(y, under, v, _mm512_setzero_ps()); /* as hkv_silu below -87 */
#undef HKV_C
}
/* lane p of the result = the sum of the 16 lanes of v[p] (a 16 x 16 transpose folded into the
 * additions: each level halves the vectors and doubles the sums each lane holds; every lane
 * only ever adds its own vector's numbers). The small-batch linears' tile reduction. */
static inline __attribute__((always_inline)) __m512 hkv_reduce16(const __m512 v[16]) {
    __m512 h[8], s[4];
    /* h[i], 128-bit lane t: v[2i] lanes t and t + 2 summed (t = 0, 1), then v[2i + 1]'s */
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)
        h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    /* s[i], 128-bit lane t: 4 partial sums (one per 32-bit lane) of v[4i + t] */
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xdd));
    /* within each 128-bit lane, a 4 x 4 transpose-and-add of s[0..3] */
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(s[0], s[1]), _mm512_unpackhi_ps(s[0], s[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(s[2], s[3]), _mm512_unpackhi_ps(s[2], s[3]));
    /* 128-bit lane t, lane c: the whole sum of v[4c + t] */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, u);
}

/* hkv_f32_to_bf16 of 16 values (nearest even, NaN -> 0x7fc0; vcvtneps2bf16 would flush
 * denormals) */
static inline __attribute__((always_inline)) __m256i hkv_f32x16_to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

/* One step of a block's far prefetch spread evenly over its `total` steps (Bresenham): `lines`
 * of them issue one cache line each at pf (lines <= total). The small-batch linears' stream. */
#define HKV_FAR_STEP(debt, lines, total, pf)                                                 \
    do {                                                                                     \
        (debt) += (lines);                                                                   \
        if ((debt) >= (total)) {                                                             \
            _mm_prefetch((const char *)(pf), _MM_HINT_T1);                                   \
            (pf) += 64;                                                                      \
            (debt) -= (total);                                                               \
        }                                                                                    \
    } while (0)
#endif

#if HKV_AMX_BF16
/* Whether this process may use AMX tiles (cpu.c asks the kernel once; 0 without AMX). */
int hkv_amx_ready(void);

struct hkv_tilecfg { /* the 64-byte operand of ldtilecfg */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0..7 all 16 rows of 64 bytes: 16 x 32 bfloat16 (A), 16 pairs x 16 x 2 (B) or 16 x 16
 * float32 (C). */
static inline void hkv_tiles_16x64(void) {
    struct hkv_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}
#endif

#if HKV_AVX2
/* AVX2 helpers of the small-batch linears (f32_linear.c, bf16_linear.c, int8_linear.c). */

/* lane p of the result = the sum of the 8 lanes of v[p] (hkv_reduce16 on 8 lanes: pairwise
 * horizontal adds fold the transpose into the sums, then the two 128-bit halves are added) */
static inline __attribute__((always_inline)) __m256 hkv_reduce8(const __m256 v[8]) {
    /* a[i]: v[2i] lanes 0+1, 2+3, then v[2i + 1]'s (each 128-bit half on its own) */
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    /* b0, 128-bit half h: the sums of lanes 4h .. 4h + 3 of v[0], v[1], v[2], v[3] */
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                         _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* f32_linear.c: the AVX2 GEMM of the native linears at larger M, for float32 (wtype 0),
 * bfloat16 (1) and int8 (2) weights [N, K]: y = x @ w^T * scale + bias, float32 products and
 * sums; x [M, K] float32 or bfloat16 (xbf16), bias [N] of the weight's dtype (float32 for
 * wtype 0, else bfloat16) or NULL, scale [N] bfloat16 or NULL, y [M, N] float32 or bfloat16
 * (ybf16). Returns 0, or -1 without the memory for its copy of x (nothing written). */
int hkv_avx2_gemm(const void *x, int64_t ldx, int xbf16, const void *w, int wtype,
                  const void *bias, const uint16_t *scale, int64_t M, int64_t N, int64_t K,
                  void *y, int64_t ldy, int ybf16);

#ifndef HKV_FAR_STEP /* (the AVX-512 section defines the same) */
#define HKV_FAR_STEP(debt, lines, total, pf)                                                 \
    do {                                                                                     \
        (debt) += (lines);                                                                   \
        if ((debt) >= (total)) {                                                             \
            _mm_prefetch((const char *)(pf), _MM_HINT_T1);                                   \
            (pf) += 64;                                                                      \
            (debt) -= (total);                                                               \
        }                                                                                    \
    } while (0)
#endif
#endif

#if HKV_AVX2
/* ---- 8-lane (AVX2 + FMA + F16C) helpers of the decode attention, state and row kernels: what
 * an AVX2-only CPU (AMD Zen 2/3, most laptops) runs where AVX-512 machines take the 16-lane
 * ones above. GCC leaves loops over hkv_silu and hkv_exp_nonpositive scalar for AVX2 ("control
 * flow in loop"): their conditionals are float comparisons, which may raise FP exceptions, and
 * GCC if-converts those only with AVX-512's masks (-ftrapping-math, the default): silu_and_mul
 * of [64, 3072] took 1.5 ms on one thread of the x86-64-v3 build, 0.095 ms with hkv_silu8
 * (AVX-512: 0.085). */

#define HKV_C8(v) _mm256_set1_ps(v)

/* hkv_exp_nonpositive on 8 lanes: the same operations in the same order, no fused
 * multiply-adds (-std=c11 does not contract the scalar version's either), so vector and
 * scalar loops give the same bits (NaN stays NaN: vmaxps returns its second operand). */
static inline __attribute__((always_inline)) __m256 hkv_exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(HKV_C8(-87.0f), x); /* x < -87 ? -87 : x */
    const __m256 shift = HKV_C8(12582912.0f);
    const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, HKV_C8(1.44269504f)), shift),
                                   shift);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, HKV_C8(0.693145751953125f))),
                                   _mm256_mul_ps(k, HKV_C8(1.42860677e-6f)));
    __m256 p = _mm256_add_ps(HKV_C8(8.3333338e-3f), _mm256_mul_ps(r, HKV_C8(1.3888889e-3f)));
    p = _mm256_add_ps(HKV_C8(4.1666668e-2f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(HKV_C8(1.6666667e-1f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(HKV_C8(0.5f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(HKV_C8(1.0f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(HKV_C8(1.0f), _mm256_mul_ps(r, p));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* hkv_silu on 8 lanes, the same bits (its branches as blends: each lane computes both sides,
 * the division included, and keeps the one hkv_silu takes). */
static inline __attribute__((always_inline)) __m256 hkv_silu8(__m256 v) {
    const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 minus = _mm256_xor_ps(v, HKV_C8(-0.0f)); /* -v */
    const __m256 z = hkv_exp8_nonpositive(_mm256_blendv_ps(minus, v, neg));
    const __m256 num = _mm256_blendv_ps(v, _mm256_mul_ps(v, z), neg);
    const __m256 y = _mm256_div_ps(num, _mm256_add_ps(HKV_C8(1.0f), z));
    const __m256 under = _mm256_cmp_ps(v, HKV_C8(-87.0f), _CMP_LT_OQ);
    return _mm256_blendv_ps(y, _mm256_mul_ps(v, _mm256_setzero_ps()), under);
}

/* Lanes i < n all ones (n clamped to 0 .. 8): the mask of vmaskmovps / vpmaskmovd. */
static inline __m256i hkv_mask8(int64_t n) {
    const int32_t c = n <= 0 ? 0 : n >= 8 ? 8 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 bfloat16 numbers at p (unaligned) as float32 (exact: a shift of each into the top half). */
static inline __attribute__((always_inline)) __m256 hkv_bf16x8_load(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* hkv_f32_to_bf16 of 8 values (nearest even, NaN -> 0x7fc0), in order in 128 bits. */
static inline __attribute__((always_inline)) __m128i hkv_f32x8_to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
    /* (each lane < 2^16: the unsigned saturation of packusdw keeps it) */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* hkv_bf16_to_f32(hkv_f32_to_bf16(v)) of 8 lanes: v rounded to a bfloat16 value, in float32. */
static inline __attribute__((always_inline)) __m256 hkv_round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hkv_f32x8_to_bf16(v)), 16));
}

/* The sum of v's 8 lanes, and their maximum. */
static inline float hkv_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hkv_hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif /* HKV_AVX2 */

#endif
