/* The gated delta rule's decode step (Qwen3-Next, Qwen3.5): one token per request, each state
 * read once from memory and written once. hybridkv/ops/native/gdn_decode.py declares it;
 * hybridkv/ops/gdn_ops.py (NativeGDNOps) calls it for steps of one-token requests only (the
 * general kernel, hkv_gated_delta_rule in kernels.c, takes every other step). Compiled into the
 * one native library with the other C files of this folder.
 *
 * Per request and value head, S [K, V] its state, qn = q / |q| / sqrt(K), kn = k / |k|:
 *
 *     S' = e^g S + kn (outer) delta,    delta = beta (v - e^g S^T kn)
 *     o  = S'^T qn = e^g (S^T qn) + (kn . qn) delta
 *
 * so one read of S gives both S^T kn and S^T qn (pass 1), delta and o follow from them, and a
 * second pass writes S' (pass 2). The general kernel reads the state into a float32 copy (for
 * bfloat16 states or a V that is not a multiple of 16), sweeps it twice and writes it back: four
 * passes over 64 KiB (K = V = 128) where L1 holds 48. Here the columns are taken 128 at a time
 * (K rows of 128 bfloat16 values: 32 KiB, in L1 for pass 2), 8 vectors of sums in registers.
 * The new state is the general kernel's (decay * s + kn * delta, fused, rounded to bfloat16 as
 * torch rounds); o differs from it by float32 rounding (summed from S, not S').
 *
 * Arguments are hkv_gated_delta_rule's (same layouts): requests with lens[r] != 1 are left alone
 * (the caller sends only one-token requests). The math is float32. *failed: 1 when K exceeds
 * GD_MAX_K (nothing done), else 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "hkv_common.h"

#define GD_FAST HKV_AVX512_BF16
#define GD_AVX2 (HKV_AVX2 && !GD_FAST) /* 8-lane passes (AVX-512 without BF16 included) */

#define GD_EPS 1e-6f            /* of the L2 norm, as transformers' l2norm */
#define GD_MIN_LOG_DECAY -80.0f /* as the general kernel: no denormal decays */
#define GD_MAX_K 1024           /* the normalised q and k on the stack */

static inline float gd_load(const void *x, int bf16, int64_t i) {
    return bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* out = x[i .. i + n) / sqrt(|x|^2 + eps) * scale */
static void gd_normalise(const void *x, int bf16, int64_t i, int64_t n, float scale,
                         float *out) {
    float sq = 0.0f;
    for (int64_t l = 0; l < n; l++) {
        out[l] = gd_load(x, bf16, i + l);
        sq += out[l] * out[l];
    }
    const float inv = 1.0f / sqrtf(sq + GD_EPS) * scale;
    for (int64_t l = 0; l < n; l++) out[l] *= inv;
}

/* 1 where the passes run on vectors (AVX512-BF16, or AVX2 below), 0 for the plain loops */
int hkv_gdn_decode_fast(void) { return GD_FAST || GD_AVX2; }

#if GD_FAST

#define GD_NV 8 /* vectors of 16 columns per block: 128 columns */
#define GD_UNROLL _Pragma("GCC unroll 8")

static inline __mmask16 gd_mask(int64_t n) {
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

static inline __m512 gd_load16(const void *p, int bf16, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, p);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void gd_store16(void *p, int bf16, __m512 v, __mmask16 m) {
    if (bf16)
        _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps(p, m, v);
}

/* Qwen3-Next's gated norm of one head, norm first (ops.norm.gated_rms_norm with
 * norm_before_gate, as hkv_gated_rms_norm_mixed computes it): x = bf16(o), y = bf16(w * (x /
 * sqrt(mean(x^2) + eps)) * silu(z)); o [V] float32, z [V] bfloat16, w [V] float32. */
static void gd_gated_norm(const float *o, const uint16_t *z, const float *w, int64_t V, float eps,
                          uint16_t *y) {
    __m512 sq = _mm512_setzero_ps();
    for (int64_t c = 0; c < V; c += 16) {
        const __mmask16 m = gd_mask(V - c);
        const __m512i rb = _mm512_cvtepu16_epi32(
            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, o + c)));
        const __m512 xb = _mm512_castsi512_ps(_mm512_slli_epi32(rb, 16));
        sq = _mm512_add_ps(sq, _mm512_mul_ps(xb, xb));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)V + eps));
    for (int64_t c = 0; c < V; c += 16) {
        const __mmask16 m = gd_mask(V - c);
        const __m512i rb = _mm512_cvtepu16_epi32(
            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, o + c)));
        const __m512 xb = _mm512_castsi512_ps(_mm512_slli_epi32(rb, 16));
        const __m512 wx = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + c), _mm512_mul_ps(xb, inv));
        const __m512 out = _mm512_mul_ps(wx, hkv_silu16(gd_load16(z + c, 1, m)));
        _mm256_mask_storeu_epi16(y + c, m, (__m256i)_mm512_cvtneps_pbh(out));
    }
}

#define GD_INLINE static inline __attribute__((always_inline))

/* Columns c0 .. c0 + 127 of one state (fewer past V when !full): pass 1, delta and o, pass 2.
 * sb, init and full are constants where inlined (no masks, no dtype tests in the loops). */
GD_INLINE void gd_block(const int sb, const int init, const int full, char *base, int64_t K,
                        int64_t V, int64_t c0, const float *qn, const float *kn, float qk,
                        const void *vrow, int vb, float decay, float beta, float *o,
                        const char *next, int64_t per_row, int64_t *next_left) {
    const int64_t elem = sb ? 2 : 4, stride = V * elem;
    __mmask16 m[GD_NV];
    __m512 p[GD_NV], s_q[GD_NV], delta[GD_NV];
    GD_UNROLL for (int j = 0; j < GD_NV; j++) {
        m[j] = full ? (__mmask16)0xffff : gd_mask(V - c0 - 16 * j);
        p[j] = s_q[j] = _mm512_setzero_ps();
    }
    base += c0 * elem;
    if (init) { /* pass 1: S^T kn and S^T qn */
        for (int64_t k = 0; k < K; k++) {
            const char *row = base + k * stride;
            const __m512 kk = _mm512_set1_ps(kn[k]), qq = _mm512_set1_ps(qn[k]);
            GD_UNROLL for (int j = 0; j < GD_NV; j++) {
                const __m512 x = gd_load16(row + 16 * j * elem, sb, m[j]);
                p[j] = _mm512_fmadd_ps(x, kk, p[j]);
                s_q[j] = _mm512_fmadd_ps(x, qq, s_q[j]);
            }
        }
    }
    const __m512 dv = _mm512_set1_ps(decay), bv = _mm512_set1_ps(beta);
    const __m512 qkv = _mm512_set1_ps(qk);
    GD_UNROLL for (int j = 0; j < GD_NV; j++) { /* delta, o */
        const __m512 v = gd_load16((const char *)vrow + (c0 + 16 * j) * (vb ? 2 : 4), vb, m[j]);
        delta[j] = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_mul_ps(p[j], dv)), bv);
        const __m512 out =
            _mm512_add_ps(_mm512_mul_ps(s_q[j], dv), _mm512_mul_ps(delta[j], qkv));
        _mm512_mask_storeu_ps(o + c0 + 16 * j, m[j], out);
    }
    for (int64_t k = 0; k < K; k++) { /* pass 2: S' = decay S + kn delta */
        char *row = base + k * stride;
        const __m512 kk = _mm512_set1_ps(kn[k]);
        for (int64_t l = 0; l < per_row && *next_left > 0; l++, (*next_left)--, next += 64)
            _mm_prefetch(next, _MM_HINT_T0);
        GD_UNROLL for (int j = 0; j < GD_NV; j++) {
            if (!full && !m[j]) continue;
            char *at = row + 16 * j * elem;
            const __m512 x = init ? gd_load16(at, sb, m[j]) : _mm512_setzero_ps();
            gd_store16(at, sb, _mm512_fmadd_ps(delta[j], kk, _mm512_mul_ps(x, dv)), m[j]);
        }
    }
}

/* One (request, value head): S [K, V] at `head` (float32, or bfloat16 when sb), not read when
 * !init (it starts at zero). qn, kn: [K]; vrow: the token's [V] values (bf16 when vb); o: [V].
 * next: the next task's state (NULL: none), prefetched during pass 2, a few lines per row. */
static void gd_head(void *head, int sb, int init, int64_t K, int64_t V, const float *qn,
                    const float *kn, float qk, const void *vrow, int vb, float decay, float beta,
                    float *o, const char *next) {
    const int64_t elem = sb ? 2 : 4, blocks = (V + GD_NV * 16 - 1) / (GD_NV * 16);
    int64_t next_left = next == NULL ? 0 : (K * V * elem + 63) / 64;
    const int64_t per_row = (next_left + K * blocks - 1) / (K * blocks);
    for (int64_t c0 = 0; c0 < V; c0 += GD_NV * 16) {
        const int full = V - c0 >= GD_NV * 16;
        const char *nx = next == NULL ? NULL : next + 64 * ((K * V * elem + 63) / 64 - next_left);
#define GD_CALL(SB, INIT, FULL)                                                                \
    gd_block(SB, INIT, FULL, (char *)head, K, V, c0, qn, kn, qk, vrow, vb, decay, beta, o, nx,  \
             per_row, &next_left)
        switch ((sb != 0) * 4 + (init != 0) * 2 + full) { /* flags: any nonzero is 1 */
        case 0: GD_CALL(0, 0, 0); break;
        case 1: GD_CALL(0, 0, 1); break;
        case 2: GD_CALL(0, 1, 0); break;
        case 3: GD_CALL(0, 1, 1); break;
        case 4: GD_CALL(1, 0, 0); break;
        case 5: GD_CALL(1, 0, 1); break;
        case 6: GD_CALL(1, 1, 0); break;
        default: GD_CALL(1, 1, 1); break;
        }
#undef GD_CALL
    }
}

#elif GD_AVX2 /* AVX2 + FMA: the same passes on 8-lane vectors */

/* Blocks of GD_NV2 vectors of 8 columns: pass 1 keeps 2 x 4 sums, the broadcasts and a row
 * vector in 11 of the 16 ymm registers (8 vectors, as the AVX-512 block has, would spill). A
 * block's K rows of 32 bfloat16 columns are 8 KiB (K = 128): in L1 for pass 2. bfloat16
 * values are widened by a shift and rounded back (nearest even, NaN -> 0x7fc0: torch's
 * rounding) in integer arithmetic: AVX2 has no vcvtneps2bf16. */
#define GD_NV2 4
#define GD_UNROLL _Pragma("GCC unroll 4")

/* n (0 .. 8) values at p, float32 or bfloat16 (sb), as float32; zeros past n */
static inline __m256 gd_load8(const void *p, int bf16, int64_t n) {
    if (n >= 8) return bf16 ? hkv_bf16x8_load(p) : _mm256_loadu_ps(p);
    if (!bf16) return _mm256_maskload_ps(p, hkv_mask8(n));
    uint16_t buf[8] = {0};
    memcpy(buf, p, sizeof(uint16_t) * (size_t)(n < 0 ? 0 : n));
    return hkv_bf16x8_load(buf);
}

static inline void gd_store8(void *p, int bf16, __m256 v, int64_t n) {
    if (!bf16) {
        if (n >= 8)
            _mm256_storeu_ps(p, v);
        else
            _mm256_maskstore_ps(p, hkv_mask8(n), v);
        return;
    }
    const __m128i r = hkv_f32x8_to_bf16(v);
    if (n >= 8) {
        _mm_storeu_si128(p, r);
        return;
    }
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, r);
    memcpy(p, buf, sizeof(uint16_t) * (size_t)(n < 0 ? 0 : n));
}

/* v rounded to bfloat16 values, as float32 */
static inline __m256 gd_round8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hkv_f32x8_to_bf16(v)), 16));
}

/* Qwen3-Next's gated norm of one head (the plain version's numbers: bf16(o), its mean square,
 * then bf16(w * (x * inv) * silu(z)) with hkv_silu8's bits). */
static void gd_gated_norm(const float *o, const uint16_t *z, const float *w, int64_t V, float eps,
                          uint16_t *y) {
    __m256 sq = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= V; c += 8) {
        const __m256 x = gd_round8(_mm256_loadu_ps(o + c));
        sq = _mm256_add_ps(sq, _mm256_mul_ps(x, x));
    }
    float tail = 0.0f;
    for (int64_t t = c; t < V; t++) {
        const float x = hkv_bf16_to_f32(hkv_f32_to_bf16(o[t]));
        tail += x * x;
    }
    const float inv = 1.0f / sqrtf((hkv_hsum8(sq) + tail) / (float)V + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (c = 0; c + 8 <= V; c += 8) {
        const __m256 x = gd_round8(_mm256_loadu_ps(o + c));
        const __m256 wx = _mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(x, iv));
        const __m256 out = _mm256_mul_ps(wx, hkv_silu8(hkv_bf16x8_load(z + c)));
        _mm_storeu_si128((__m128i *)(y + c), hkv_f32x8_to_bf16(out));
    }
    for (; c < V; c++) {
        const float x = hkv_bf16_to_f32(hkv_f32_to_bf16(o[c]));
        y[c] = hkv_f32_to_bf16(w[c] * (x * inv) * hkv_silu(hkv_bf16_to_f32(z[c])));
    }
}

#define GD_INLINE static inline __attribute__((always_inline))

/* Columns c0 .. c0 + 31 of one state (fewer past V when !full): gd_block of the AVX-512 path
 * on 4 vectors of 8. */
GD_INLINE void gd_block(const int sb, const int init, const int full, char *base, int64_t K,
                        int64_t V, int64_t c0, const float *qn, const float *kn, float qk,
                        const void *vrow, int vb, float decay, float beta, float *o,
                        const char *next, int64_t per_row, int64_t *next_left) {
    const int64_t elem = sb ? 2 : 4, stride = V * elem;
    int64_t m[GD_NV2]; /* valid columns of each vector */
    __m256 p[GD_NV2], s_q[GD_NV2], delta[GD_NV2];
    GD_UNROLL for (int j = 0; j < GD_NV2; j++) {
        m[j] = full ? 8 : V - c0 - 8 * j;
        p[j] = s_q[j] = _mm256_setzero_ps();
    }
    base += c0 * elem;
    if (init) { /* pass 1: S^T kn and S^T qn */
        for (int64_t k = 0; k < K; k++) {
            const char *row = base + k * stride;
            const __m256 kk = _mm256_broadcast_ss(kn + k), qq = _mm256_broadcast_ss(qn + k);
            GD_UNROLL for (int j = 0; j < GD_NV2; j++) {
                const __m256 x = gd_load8(row + 8 * j * elem, sb, full ? 8 : m[j]);
                p[j] = _mm256_fmadd_ps(x, kk, p[j]);
                s_q[j] = _mm256_fmadd_ps(x, qq, s_q[j]);
            }
        }
    }
    const __m256 dv = _mm256_set1_ps(decay), bv = _mm256_set1_ps(beta);
    const __m256 qkv = _mm256_set1_ps(qk);
    GD_UNROLL for (int j = 0; j < GD_NV2; j++) { /* delta, o */
        const __m256 v =
            gd_load8((const char *)vrow + (c0 + 8 * j) * (vb ? 2 : 4), vb, full ? 8 : m[j]);
        delta[j] = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_mul_ps(p[j], dv)), bv);
        const __m256 out =
            _mm256_add_ps(_mm256_mul_ps(s_q[j], dv), _mm256_mul_ps(delta[j], qkv));
        gd_store8(o + c0 + 8 * j, 0, out, full ? 8 : m[j]);
    }
    for (int64_t k = 0; k < K; k++) { /* pass 2: S' = decay S + kn delta */
        char *row = base + k * stride;
        const __m256 kk = _mm256_broadcast_ss(kn + k);
        for (int64_t l = 0; l < per_row && *next_left > 0; l++, (*next_left)--, next += 64)
            _mm_prefetch(next, _MM_HINT_T0);
        GD_UNROLL for (int j = 0; j < GD_NV2; j++) {
            if (!full && m[j] <= 0) continue;
            char *at = row + 8 * j * elem;
            const __m256 x = init ? gd_load8(at, sb, full ? 8 : m[j]) : _mm256_setzero_ps();
            gd_store8(at, sb, _mm256_fmadd_ps(delta[j], kk, _mm256_mul_ps(x, dv)),
                      full ? 8 : m[j]);
        }
    }
}

/* bfloat16 states: each 16 columns as two vectors, their 8 even columns and their 8 odd ones.
 * A row's 16 values are then widened by a shift and a mask of one 256-bit load, and rounded
 * back into one 256-bit store (the even results' bits shifted down, the odd ones' masked,
 * or-ed), where 8 columns in order cost a vpmovzxwd to widen and a vpackusdw and a
 * vextracti128 to store (the shuffle port was the bound). The columns of v and o are
 * permuted to match once per block. */

/* 16 bfloat16 values at p (n < 16: the first n, zeros after) as their even and odd elements */
GD_INLINE void gd_load16_eo(const void *p, int64_t n, __m256 *e, __m256 *o) {
    __m256i raw;
    if (n >= 16) {
        raw = _mm256_loadu_si256((const __m256i *)p);
    } else {
        uint16_t buf[16] __attribute__((aligned(32))) = {0};
        memcpy(buf, p, sizeof(uint16_t) * (size_t)(n < 0 ? 0 : n));
        raw = _mm256_load_si256((const __m256i *)buf);
    }
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000)));
}

/* hkv_f32_to_bf16 of the even elements e and odd elements o, in order, to 16 values at p
 * (n < 16: the first n) */
GD_INLINE void gd_store16_eo(void *p, __m256 e, __m256 o, int64_t n) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i be = _mm256_castps_si256(e), bo = _mm256_castps_si256(o);
    be = _mm256_add_epi32(be, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(be, 16), one),
                                               half));
    bo = _mm256_add_epi32(bo, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bo, 16), one),
                                               half));
    const __m256 lo = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_srli_epi32(be, 16)),
                                       _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                       _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
    const __m256 hi = _mm256_blendv_ps(
        _mm256_castsi256_ps(_mm256_and_si256(bo, _mm256_set1_epi32((int)0xffff0000))),
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(o, o, _CMP_UNORD_Q));
    const __m256i r = _mm256_castps_si256(_mm256_or_ps(lo, hi));
    if (n >= 16) {
        _mm256_storeu_si256((__m256i *)p, r);
        return;
    }
    uint16_t buf[16] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)buf, r);
    memcpy(p, buf, sizeof(uint16_t) * (size_t)(n < 0 ? 0 : n));
}

/* 16 float32 values at p (n < 16: the first n, zeros after) as their even and odd elements */
GD_INLINE void gd_loadf_eo(const float *p, int64_t n, __m256 *e, __m256 *o) {
    const __m256 a = n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, hkv_mask8(n));
    const __m256 b = n >= 16 ? _mm256_loadu_ps(p + 8) : _mm256_maskload_ps(p + 8, hkv_mask8(n - 8));
    /* [a0 a2 b0 b2 | a4 a6 b4 b6] -> 64-bit units 0, 2, 1, 3: a0 a2 a4 a6 b0 b2 b4 b6 */
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)),
                                                0xd8));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)),
                                                0xd8));
}

/* even and odd elements e, o in order to 16 float32 values at p (n < 16: the first n) */
GD_INLINE void gd_storef_eo(float *p, __m256 e, __m256 o, int64_t n) {
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
    const __m256 a = _mm256_permute2f128_ps(lo, hi, 0x20), b = _mm256_permute2f128_ps(lo, hi, 0x31);
    if (n >= 16) {
        _mm256_storeu_ps(p, a);
        _mm256_storeu_ps(p + 8, b);
    } else {
        _mm256_maskstore_ps(p, hkv_mask8(n), a);
        _mm256_maskstore_ps(p + 8, hkv_mask8(n - 8), b);
    }
}

/* gd_block for a bfloat16 state: columns c0 .. c0 + 31 as 2 x 16 (even, odd) */
GD_INLINE void gd_block_eo(const int init, const int full, char *base, int64_t K, int64_t V,
                           int64_t c0, const float *qn, const float *kn, float qk,
                           const void *vrow, int vb, float decay, float beta, float *o,
                           const char *next, int64_t per_row, int64_t *next_left) {
    const int64_t stride = V * 2;
    int64_t m[2]; /* valid columns of each 16 */
    __m256 p[4], s_q[4], delta[4];
    GD_UNROLL for (int j = 0; j < 4; j++) p[j] = s_q[j] = _mm256_setzero_ps();
    m[0] = full ? 16 : V - c0;
    m[1] = full ? 16 : V - c0 - 16;
    base += c0 * 2;
    if (init) { /* pass 1: S^T kn and S^T qn */
        for (int64_t k = 0; k < K; k++) {
            const char *row = base + k * stride;
            const __m256 kk = _mm256_broadcast_ss(kn + k), qq = _mm256_broadcast_ss(qn + k);
            GD_UNROLL for (int c = 0; c < 2; c++) {
                __m256 x[2];
                gd_load16_eo(row + 32 * c, full ? 16 : m[c], x, x + 1);
                GD_UNROLL for (int h = 0; h < 2; h++) {
                    p[2 * c + h] = _mm256_fmadd_ps(x[h], kk, p[2 * c + h]);
                    s_q[2 * c + h] = _mm256_fmadd_ps(x[h], qq, s_q[2 * c + h]);
                }
            }
        }
    }
    const __m256 dv = _mm256_set1_ps(decay), bv = _mm256_set1_ps(beta);
    const __m256 qkv = _mm256_set1_ps(qk);
    GD_UNROLL for (int c = 0; c < 2; c++) { /* delta, o */
        const int64_t n = full ? 16 : m[c];
        __m256 v[2], out[2];
        if (vb)
            gd_load16_eo((const uint16_t *)vrow + c0 + 16 * c, n, v, v + 1);
        else
            gd_loadf_eo((const float *)vrow + c0 + 16 * c, n, v, v + 1);
        GD_UNROLL for (int h = 0; h < 2; h++) {
            const int j = 2 * c + h;
            delta[j] = _mm256_mul_ps(_mm256_sub_ps(v[h], _mm256_mul_ps(p[j], dv)), bv);
            out[h] = _mm256_add_ps(_mm256_mul_ps(s_q[j], dv), _mm256_mul_ps(delta[j], qkv));
        }
        if (n > 0) gd_storef_eo(o + c0 + 16 * c, out[0], out[1], n);
    }
    for (int64_t k = 0; k < K; k++) { /* pass 2: S' = decay S + kn delta */
        char *row = base + k * stride;
        const __m256 kk = _mm256_broadcast_ss(kn + k);
        for (int64_t l = 0; l < per_row && *next_left > 0; l++, (*next_left)--, next += 64)
            _mm_prefetch(next, _MM_HINT_T0);
        GD_UNROLL for (int c = 0; c < 2; c++) {
            if (!full && m[c] <= 0) continue;
            __m256 x[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            if (init) gd_load16_eo(row + 32 * c, full ? 16 : m[c], x, x + 1);
            gd_store16_eo(row + 32 * c,
                          _mm256_fmadd_ps(delta[2 * c], kk, _mm256_mul_ps(x[0], dv)),
                          _mm256_fmadd_ps(delta[2 * c + 1], kk, _mm256_mul_ps(x[1], dv)),
                          full ? 16 : m[c]);
        }
    }
}

static void gd_head(void *head, int sb, int init, int64_t K, int64_t V, const float *qn,
                    const float *kn, float qk, const void *vrow, int vb, float decay, float beta,
                    float *o, const char *next) {
    const int64_t elem = sb ? 2 : 4, blocks = (V + GD_NV2 * 8 - 1) / (GD_NV2 * 8);
    int64_t next_left = next == NULL ? 0 : (K * V * elem + 63) / 64;
    const int64_t per_row = (next_left + K * blocks - 1) / (K * blocks);
    for (int64_t c0 = 0; c0 < V; c0 += GD_NV2 * 8) {
        const int full = V - c0 >= GD_NV2 * 8;
        const char *nx = next == NULL ? NULL : next + 64 * ((K * V * elem + 63) / 64 - next_left);
#define GD_CALL(SB, INIT, FULL)                                                                \
    gd_block(SB, INIT, FULL, (char *)head, K, V, c0, qn, kn, qk, vrow, vb, decay, beta, o, nx,  \
             per_row, &next_left)
        switch ((sb != 0) * 4 + (init != 0) * 2 + full) { /* flags: any nonzero is 1 */
        case 0: GD_CALL(0, 0, 0); break;
        case 1: GD_CALL(0, 0, 1); break;
        case 2: GD_CALL(0, 1, 0); break;
        case 3: GD_CALL(0, 1, 1); break;
#define GD_CALL_EO(INIT, FULL)                                                                 \
    gd_block_eo(INIT, FULL, (char *)head, K, V, c0, qn, kn, qk, vrow, vb, decay, beta, o, nx,    \
                per_row, &next_left)
        case 4: GD_CALL_EO(0, 0); break;
        case 5: GD_CALL_EO(0, 1); break;
        case 6: GD_CALL_EO(1, 0); break;
        default: GD_CALL_EO(1, 1); break;
        }
#undef GD_CALL
#undef GD_CALL_EO
    }
}

#else /* plain C: the same passes, one column at a time */

static void gd_gated_norm(const float *o, const uint16_t *z, const float *w, int64_t V, float eps,
                          uint16_t *y) {
    float sq = 0.0f;
    for (int64_t c = 0; c < V; c++) {
        const float x = hkv_bf16_to_f32(hkv_f32_to_bf16(o[c]));
        sq += x * x;
    }
    const float inv = 1.0f / sqrtf(sq / (float)V + eps);
    for (int64_t c = 0; c < V; c++) {
        const float x = hkv_bf16_to_f32(hkv_f32_to_bf16(o[c]));
        y[c] = hkv_f32_to_bf16(w[c] * (x * inv) * hkv_silu(hkv_bf16_to_f32(z[c])));
    }
}

static void gd_head(void *head, int sb, int init, int64_t K, int64_t V, const float *qn,
                    const float *kn, float qk, const void *vrow, int vb, float decay, float beta,
                    float *o, const char *next) {
    (void)next;
    for (int64_t c = 0; c < V; c++) {
        float p = 0.0f, s_q = 0.0f;
        if (init)
            for (int64_t k = 0; k < K; k++) {
                const float s = gd_load(head, sb, k * V + c);
                p += s * kn[k], s_q += s * qn[k];
            }
        const float delta = (gd_load(vrow, vb, c) - p * decay) * beta;
        o[c] = s_q * decay + delta * qk;
        for (int64_t k = 0; k < K; k++) {
            const float s = init ? gd_load(head, sb, k * V + c) : 0.0f;
            const float n = s * decay + delta * kn[k];
            if (sb)
                ((uint16_t *)head)[k * V + c] = hkv_f32_to_bf16(n);
            else
                ((float *)head)[k * V + c] = n;
        }
    }
}

#endif

int hkv_gdn_decode(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                   const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                   int64_t R, int64_t Hk, int64_t Hv, int64_t K, int64_t V, const void *q,
                   int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                   int64_t v_stride, int in_bf16, const float *g, const float *beta, float *o,
                   uint16_t *y, const uint16_t *z, int64_t z_stride, const float *norm_w,
                   float eps) {
    const int64_t elem = state_bf16 ? 2 : 4, group = Hv / Hk;
    if (K > GD_MAX_K || (y != NULL && V > GD_MAX_K)) return 1;
#pragma omp parallel if (R * Hv > 1)
    {
    /* denormals flushed to zero and read as zero (see gdn_chunk.c): a state decayed by e^-80
     * reaches them, and each costs a microcode assist */
#if GD_FAST || GD_AVX2
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < Hv; h++) {
            if (lens[r] != 1) continue;
            /* the task after this one (the same thread's next, in a static schedule) */
            const int64_t nr = h + 1 < Hv ? r : r + 1, nh = h + 1 < Hv ? h + 1 : 0;
            const char *next = nr < R && lens[nr] == 1 && has_initial[nr]
                ? (const char *)state + (pages[nr] * page_stride + nh * K * V) * elem : NULL;
            const int64_t t = starts[r], kh = h / group, th = t * Hv + h;
            float qn[GD_MAX_K], kn[GD_MAX_K];
            gd_normalise(q, in_bf16, t * q_stride + kh * K, K, 1.0f / sqrtf((float)K), qn);
            gd_normalise(k, in_bf16, t * k_stride + kh * K, K, 1.0f, kn);
            float qk = 0.0f;
            for (int64_t l = 0; l < K; l++) qk += qn[l] * kn[l];
            const float log_decay = g[th] < GD_MIN_LOG_DECAY ? GD_MIN_LOG_DECAY : g[th];
            char *head = (char *)state + (pages[r] * page_stride + h * K * V) * elem;
            const char *vrow = (const char *)v + (t * v_stride + h * V) * (in_bf16 ? 2 : 4);
            float o_head[GD_MAX_K]; /* (the head's o, when it goes on to the norm) */
            float *oh = y == NULL ? o + th * V : o_head;
            gd_head(head, state_bf16, has_initial[r], K, V, qn, kn, qk, vrow, in_bf16,
                    expf(log_decay), beta[th], oh, next);
            if (y != NULL)
                gd_gated_norm(oh, z + t * z_stride + h * V, norm_w, V, eps, y + th * V);
        }
    }
#if GD_FAST || GD_AVX2
    _mm_setcsr(csr);
#endif
    }
    return 0;
}
