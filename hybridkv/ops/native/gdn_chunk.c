/* The gated delta rule's prefill in chunks on AMX tiles (Qwen3-Next, Qwen3.5, bfloat16 models):
 * the chunked form of hybridkv/ops/gated_delta.py with its large products on AMX-BF16 and
 * near-float32 accuracy. hybridkv/ops/native/gdn_chunk.py declares it; hybridkv/ops/gdn_ops.py
 * (NativeGDNOps) calls it for the requests of more than one token of a bfloat16 model (one-token
 * requests: gdn_decode.c). Compiled into the one native library with the other C files here.
 *
 * Per request and key head, tokens in chunks of L = 64; per value head of that key head, with
 * the raw (bfloat16) q, k and v of the chunk, a = 1 / |k| and b = 1 / |q| / sqrt(K) per row, G the
 * cumulative log decay, D_ij = exp(G_i - G_j) and S [K, V] the float32 state:
 *
 *     A_ij = beta_i a_i a_j (k_i . k_j) D_ij    (j < i)          T = I + A
 *     P_ij = b_i a_j (q_i . k_j) D_ij            (j <= i)
 *     U'   = T^-1 diag(beta) (v - diag(e^G a) (k S))     forward substitution, float32
 *     o    = diag(e^G b) (q S) + P U'
 *     S    = e^G_L S + k^T diag(a e^(G_L - G)) U'
 *
 * which is the reference's chunked form (U' = U - W S with W = T^-1 (beta k e^G)) written so that
 * every product of the raw q and k is one of bfloat16 values: k k^T and q k^T are exact on
 * AMX (float32 sums of bfloat16 products), and k S, q S and k^T U'' take S and U'' as two
 * bfloat16 parts (x = hi + lo, |x - hi - lo| < 2^-16 |x|) in two passes. Triangular solve, P U'
 * and the rest are float32 AVX-512. The state is read from its page once per request, kept in
 * float32 through its chunks, and written back once (rounded to bfloat16 as torch rounds).
 *
 * Arguments are hkv_gated_delta_rule's (same layouts, q, k, v bfloat16): requests of fewer than
 * two tokens are left alone (the caller sends those to the decode kernel). K a multiple of 32 up
 * to 256, V a multiple of 32 up to 256 (the caller checks). Returns 0, 1 when a work space could
 * not be allocated, 2 for sizes it does not take.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#define GC_AMX HKV_AMX_BF16

#define GC_L 64       /* tokens per chunk */
#define GC_MAX_DIM 256 /* K and V at most */

#if GC_AMX

#define GC_INLINE static inline __attribute__((always_inline))
#define GC_TILE 512 /* bfloat16 values in one packed B tile (16 x 32) */

/* C [M, N] float32 (row stride ldc) = sum over s < nsrc of A [M, 32 Kb] @ B_s: A bfloat16 rows
 * at lda values, B_s packed tiles [N / 16][Kb][16][32] (pairs of k side by side). M and N
 * multiples of 32; 2 x 2 tiles of sums per pass. */
static void gc_gemm(const uint16_t *A, int64_t lda, int64_t M, int64_t Kb, const uint16_t *B0s,
                    const uint16_t *B1s, int64_t N, float *C, int64_t ldc) {
    const int64_t sa = lda * 2, sc = ldc * 4;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int src = 0; src < (B1s ? 2 : 1); src++) {
                const uint16_t *B = src ? B1s : B0s;
                const uint16_t *Bn0 = B + (n0 / 16) * Kb * GC_TILE, *Bn1 = Bn0 + Kb * GC_TILE;
                for (int64_t kb = 0; kb < Kb; kb++) {
                    _tile_loadd(4, A + m0 * lda + kb * 32, sa);
                    _tile_loadd(5, A + (m0 + 16) * lda + kb * 32, sa);
                    _tile_loadd(6, Bn0 + kb * GC_TILE, 64);
                    _tile_loadd(7, Bn1 + kb * GC_TILE, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *c = C + m0 * ldc + n0;
            _tile_stored(0, c, sc);
            _tile_stored(1, c + 16, sc);
            _tile_stored(2, c + 16 * ldc, sc);
            _tile_stored(3, c + 16 * ldc + 16, sc);
        }
    }
}

/* v rounded to bfloat16 values (vcvtneps2bf16), kept in float32 */
GC_INLINE __m512 gc_round(__m512 v) {
    const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Rows r0, r1 (16 float32 each) -> one B tile row: 16 pairs (r0[n], r1[n]) of bfloat16, the
 * high parts to hi, the rest (x - hi, rounded) to lo. */
GC_INLINE void gc_pack_pair(__m512 r0, __m512 r1, uint16_t *hi, uint16_t *lo) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    const __m512 h0 = gc_round(r0), h1 = gc_round(r1);
    _mm512_storeu_si512(hi, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(h1, h0)));
    const __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(r1, h1), _mm512_sub_ps(r0, h0));
    _mm512_storeu_si512(lo, _mm512_permutexvar_epi16(order, (__m512i)l));
}

/* X [rows, N] float32 (row stride ldx; rows a multiple of 32) -> packed B tiles of its hi and lo
 * parts, contraction over the rows: [N / 16][rows / 32][16][32]. */
static void gc_pack(const float *X, int64_t ldx, int64_t rows, int64_t N, uint16_t *hi,
                    uint16_t *lo) {
    const int64_t Kb = rows / 32;
    for (int64_t kb = 0; kb < Kb; kb++)
        for (int64_t kp = 0; kp < 16; kp++) {
            const float *r0 = X + (kb * 32 + 2 * kp) * ldx, *r1 = r0 + ldx;
            for (int64_t nb = 0; nb < N / 16; nb++) {
                const int64_t at = ((nb * Kb + kb) * 16 + kp) * 32;
                gc_pack_pair(_mm512_loadu_ps(r0 + nb * 16), _mm512_loadu_ps(r1 + nb * 16),
                             hi + at, lo + at);
            }
        }
}

/* e^x for x <= 0, 16 lanes (degree-6 polynomial after range reduction, inputs clamped at -87:
 * relative error below 3e-7; hkv_common.h's hkv_exp_nonpositive) */
GC_INLINE __m512 gc_exp(__m512 x) {
#define GC_C(v) _mm512_set1_ps(v)
    x = _mm512_max_ps(x, GC_C(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, GC_C(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(k, GC_C(1.42860677e-6f),
                                      _mm512_fnmadd_ps(k, GC_C(0.693145751953125f), x));
    __m512 p = _mm512_fmadd_ps(r, GC_C(1.3888889e-3f), GC_C(8.3333338e-3f));
    p = _mm512_fmadd_ps(r, p, GC_C(4.1666668e-2f));
    p = _mm512_fmadd_ps(r, p, GC_C(1.6666667e-1f));
    p = _mm512_fmadd_ps(r, p, GC_C(0.5f));
    p = _mm512_fmadd_ps(r, p, GC_C(1.0f));
    p = _mm512_fmadd_ps(r, p, GC_C(1.0f));
    return _mm512_scalef_ps(p, k);
#undef GC_C
}

/* A thread's work space (float32 unless said), kept between calls, grown when needed. */
struct gc_work {
    uint16_t *X;     /* [128, K] bf16: rows 0..63 the chunk's raw k, 64..127 its raw q */
    uint16_t *kB;    /* raw k as B tiles, contraction over K: [4][K / 32][16][32] */
    uint16_t *kT;    /* [K, 64] bf16: raw k transposed (A of k^T U'') */
    float *KQ;       /* [128, 64]: k k^T (rows 0..63), q k^T (64..127) */
    float *S;        /* [per, K, V]: the states of the key head's value heads */
    uint16_t *Shi, *Slo; /* S packed, contraction over K: [V / 16][K / 32][16][32] each */
    float *YZ;       /* [128, V]: k S (rows 0..63), q S (64..127) */
    float *A, *P;    /* [64, 64] */
    float *U;        /* [64, V]: U', then U'' */
    uint16_t *Uhi, *Ulo; /* U'' packed, contraction over the tokens: [V / 16][2][16][32] */
    float *D;        /* [K, V]: k^T U'' */
    float *vec;      /* 8 x 64: a, b, beta, G, e^G, c, ... */
    size_t bytes;
};

static _Thread_local struct gc_work gc_tls;

static int gc_reserve(struct gc_work *w, int64_t per, int64_t K, int64_t V) {
    size_t sizes[] = {
        2 * 128 * K, 2 * 64 * K, 2 * K * 64, 4 * 128 * 64, 4 * per * K * V, 2 * K * V, 2 * K * V,
        4 * 128 * V, 4 * 64 * 64, 4 * 64 * 64, 4 * 64 * V, 2 * 64 * V, 2 * 64 * V, 4 * K * V,
        4 * 8 * 64,
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += (sizes[i] + 63) / 64 * 64;
    if (total > w->bytes) {
        free(w->X);
        w->X = aligned_alloc(64, total);
        w->bytes = w->X == NULL ? 0 : total;
        if (w->X == NULL) return 0;
    }
    char *at = (char *)w->X;
    void **slots[] = {(void **)&w->X, (void **)&w->kB, (void **)&w->kT, (void **)&w->KQ,
                      (void **)&w->S, (void **)&w->Shi, (void **)&w->Slo, (void **)&w->YZ,
                      (void **)&w->A, (void **)&w->P, (void **)&w->U, (void **)&w->Uhi,
                      (void **)&w->Ulo, (void **)&w->D, (void **)&w->vec};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        *slots[i] = at;
        at += (sizes[i] + 63) / 64 * 64;
    }
    return 1;
}

struct gc_args {
    void *state;
    int64_t page_stride;
    int state_bf16;
    const uint16_t *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    const float *g, *beta;
    float *o;
    int64_t Hk, Hv, K, V;
};

/* The chunk's shared part for key head kh: X (raw k and q rows, zeros past L), a and b (the
 * inverse norms), k as B tiles, k transposed, and k k^T, q k^T. */
static void gc_chunk_keys(const struct gc_args *s, int64_t t0, int64_t L, int64_t kh,
                          struct gc_work *w) {
    const int64_t K = s->K;
    float *a = w->vec, *b = w->vec + 64;
    const float qscale = 1.0f / sqrtf((float)K);
    for (int64_t i = 0; i < GC_L; i++) {
        uint16_t *kr = w->X + i * K, *qr = w->X + (64 + i) * K;
        if (i >= L) {
            memset(kr, 0, 2 * (size_t)K), memset(qr, 0, 2 * (size_t)K);
            a[i] = b[i] = 0.0f;
            continue;
        }
        memcpy(kr, s->k + (t0 + i) * s->k_stride + kh * K, 2 * (size_t)K);
        memcpy(qr, s->q + (t0 + i) * s->q_stride + kh * K, 2 * (size_t)K);
        __m512 ks = _mm512_setzero_ps(), qs = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += 16) {
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(kr + c))), 16));
            const __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(qr + c))), 16));
            ks = _mm512_fmadd_ps(x, x, ks), qs = _mm512_fmadd_ps(y, y, qs);
        }
        const float kk = _mm512_reduce_add_ps(ks), qq = _mm512_reduce_add_ps(qs);
        a[i] = 1.0f / sqrtf(kk + 1e-6f);
        b[i] = 1.0f / sqrtf(qq + 1e-6f) * qscale;
    }
    const int64_t Kb = K / 32;
    const uint32_t *words = (const uint32_t *)w->X; /* pairs of k values */
    uint32_t *kB = (uint32_t *)w->kB;
    for (int64_t nb = 0; nb < 4; nb++) /* B[kp][n] = pair (k[n][2kp], k[n][2kp + 1]) */
        for (int64_t kb = 0; kb < Kb; kb++)
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t n = 0; n < 16; n++)
                    kB[((nb * Kb + kb) * 16 + kp) * 16 + n] =
                        words[((nb * 16 + n) * K) / 2 + kb * 16 + kp];
    for (int64_t i = 0; i < GC_L; i++) /* kT[c][i] = k[i][c] */
        for (int64_t c = 0; c < K; c++) w->kT[c * GC_L + i] = w->X[i * K + c];
    gc_gemm(w->X, K, 128, Kb, w->kB, NULL, GC_L, w->KQ, GC_L);
}

/* The chunk's rows of one value head, NV vectors of 16 values each (a constant where inlined):
 *     U'_i = beta_i (v_i - e^G_i a_i (k S)_i) - sum_{j < i} A_ij U'_j    (forward substitution)
 *     o_i  = e^G_i b_i (q S)_i + sum_{j <= i} P_ij U'_j
 * two rows at a time (each U'_j read once for both), their vectors summed in 2 NV registers. */
GC_INLINE void gc_rhs(const int NV, const struct gc_args *s, int64_t t0, int64_t i, int64_t h,
                      int init, const struct gc_work *w, __m512 *r) {
    const int64_t V = s->V;
    const float *a = w->vec, *beta = w->vec + 128, *eG = w->vec + 256;
    const uint16_t *vr = s->v + (t0 + i) * s->v_stride + h * V;
    const __m512 bi = _mm512_set1_ps(beta[i]), ki = _mm512_set1_ps(eG[i] * a[i]);
    for (int n = 0; n < NV; n++) {
        const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(vr + 16 * n)));
        r[n] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        if (init) r[n] = _mm512_fnmadd_ps(ki, _mm512_loadu_ps(w->YZ + i * V + 16 * n), r[n]);
        r[n] = _mm512_mul_ps(r[n], bi);
    }
}

GC_INLINE void gc_rows(const int NV, const struct gc_args *s, int64_t t0, int64_t L, int64_t h,
                       int init, struct gc_work *w) {
    const int64_t V = s->V, Hv = s->Hv;
    const float *b = w->vec + 64, *eG = w->vec + 256;
    for (int64_t i = 0; i < L; i += 2) {
        const int two = i + 1 < L;
        __m512 r0[NV], r1[NV];
        gc_rhs(NV, s, t0, i, h, init, w, r0);
        if (two) gc_rhs(NV, s, t0, i + 1, h, init, w, r1);
        const float *A0 = w->A + i * GC_L, *A1 = A0 + GC_L;
        for (int64_t j = 0; j < i; j++) {
            const __m512 a0 = _mm512_set1_ps(A0[j]), a1 = _mm512_set1_ps(two ? A1[j] : 0.0f);
            const float *u = w->U + j * V;
            for (int n = 0; n < NV; n++) {
                const __m512 x = _mm512_loadu_ps(u + 16 * n);
                r0[n] = _mm512_fnmadd_ps(a0, x, r0[n]);
                r1[n] = _mm512_fnmadd_ps(a1, x, r1[n]);
            }
        }
        for (int n = 0; n < NV; n++) _mm512_storeu_ps(w->U + i * V + 16 * n, r0[n]);
        if (two) {
            const __m512 a1 = _mm512_set1_ps(A1[i]);
            for (int n = 0; n < NV; n++)
                _mm512_storeu_ps(w->U + (i + 1) * V + 16 * n, _mm512_fnmadd_ps(a1, r0[n], r1[n]));
        }
    }
    for (int64_t i = 0; i < L; i += 2) {
        const int two = i + 1 < L;
        __m512 r0[NV], r1[NV];
        const __m512 q0 = _mm512_set1_ps(eG[i] * b[i]);
        const __m512 q1 = _mm512_set1_ps(two ? eG[i + 1] * b[i + 1] : 0.0f);
        for (int n = 0; n < NV; n++) {
            r0[n] = init ? _mm512_mul_ps(q0, _mm512_loadu_ps(w->YZ + (64 + i) * V + 16 * n))
                         : _mm512_setzero_ps();
            r1[n] = init && two
                        ? _mm512_mul_ps(q1, _mm512_loadu_ps(w->YZ + (65 + i) * V + 16 * n))
                        : _mm512_setzero_ps();
        }
        const float *P0 = w->P + i * GC_L, *P1 = P0 + GC_L;
        for (int64_t j = 0; j <= i; j++) {
            const __m512 p0 = _mm512_set1_ps(P0[j]), p1 = _mm512_set1_ps(two ? P1[j] : 0.0f);
            const float *u = w->U + j * V;
            for (int n = 0; n < NV; n++) {
                const __m512 x = _mm512_loadu_ps(u + 16 * n);
                r0[n] = _mm512_fmadd_ps(p0, x, r0[n]);
                r1[n] = _mm512_fmadd_ps(p1, x, r1[n]);
            }
        }
        float *out0 = s->o + ((t0 + i) * Hv + h) * V;
        for (int n = 0; n < NV; n++) _mm512_storeu_ps(out0 + 16 * n, r0[n]);
        if (two) {
            const __m512 p1 = _mm512_set1_ps(P1[i + 1]);
            const float *u = w->U + (i + 1) * V;
            float *out1 = s->o + ((t0 + i + 1) * Hv + h) * V;
            for (int n = 0; n < NV; n++)
                _mm512_storeu_ps(out1 + 16 * n,
                                 _mm512_fmadd_ps(p1, _mm512_loadu_ps(u + 16 * n), r1[n]));
        }
    }
}

/* One value head h (state S) through the chunk of tokens t0 .. t0 + L - 1. init: S holds a state
 * (else it is zero and k S, q S are skipped). */
static void gc_chunk_value(const struct gc_args *s, int64_t t0, int64_t L, int64_t h, float *S,
                           int init, struct gc_work *w) {
    const int64_t K = s->K, V = s->V, Hv = s->Hv, nv = V / 16;
    const float *a = w->vec, *b = w->vec + 64;
    float *beta = w->vec + 128, *G = w->vec + 192, *eG = w->vec + 256, *c = w->vec + 320;
    float acc = 0.0f;
    for (int64_t i = 0; i < GC_L; i++) {
        if (i < L) {
            const float gi = s->g[(t0 + i) * Hv + h];
            acc += gi < -80.0f ? -80.0f : gi;
            beta[i] = s->beta[(t0 + i) * Hv + h];
        } else {
            beta[i] = 0.0f;
        }
        G[i] = acc;
    }
    const float GL = G[L - 1];
    for (int64_t i = 0; i < GC_L; i += 16) {
        const __m512 Gi = _mm512_loadu_ps(G + i);
        _mm512_storeu_ps(eG + i, gc_exp(Gi));
        _mm512_storeu_ps(c + i, _mm512_mul_ps(_mm512_loadu_ps(a + i),
                                              gc_exp(_mm512_sub_ps(_mm512_set1_ps(GL), Gi))));
    }
    /* A (strictly lower) and P (lower with the diagonal) */
    for (int64_t i = 0; i < L; i++) {
        const __m512 Gi = _mm512_set1_ps(G[i]);
        const __m512 ai = _mm512_set1_ps(beta[i] * a[i]), bi = _mm512_set1_ps(b[i]);
        for (int64_t j = 0; j < GC_L; j += 16) {
            const __m512 d = gc_exp(_mm512_sub_ps(Gi, _mm512_loadu_ps(G + j)));
            const __m512 aj = _mm512_mul_ps(_mm512_loadu_ps(a + j), d);
            const __mmask16 below = (__mmask16)(j >= i ? 0 : j + 16 <= i ? 0xffff
                                                           : (1u << (i - j)) - 1u);
            const __mmask16 upto = (__mmask16)(j > i ? 0 : j + 16 <= i + 1 ? 0xffff
                                                          : (1u << (i + 1 - j)) - 1u);
            _mm512_storeu_ps(w->A + i * GC_L + j,
                             _mm512_maskz_mul_ps(below, _mm512_mul_ps(ai, aj),
                                                 _mm512_loadu_ps(w->KQ + i * GC_L + j)));
            _mm512_storeu_ps(w->P + i * GC_L + j,
                             _mm512_maskz_mul_ps(upto, _mm512_mul_ps(bi, aj),
                                                 _mm512_loadu_ps(w->KQ + (64 + i) * GC_L + j)));
        }
    }
    if (init) { /* k S and q S, S in two bfloat16 parts */
        gc_pack(S, V, K, V, w->Shi, w->Slo);
        gc_gemm(w->X, K, 128, K / 32, w->Shi, w->Slo, V, w->YZ, V);
    }
    switch (nv) { /* U' and o with the row's nv vectors in registers */
#define GC_ROWS_CASE(NV)                                                                       \
    case NV: gc_rows(NV, s, t0, L, h, init, w); break;
    GC_ROWS_CASE(2) GC_ROWS_CASE(4) GC_ROWS_CASE(6) GC_ROWS_CASE(8)
    GC_ROWS_CASE(10) GC_ROWS_CASE(12) GC_ROWS_CASE(14) default: gc_rows(16, s, t0, L, h, init, w);
#undef GC_ROWS_CASE
    }
    /* S = e^G_L S + k^T diag(c) U' */
    for (int64_t i = 0; i < GC_L; i++) {
        const __m512 ci = _mm512_set1_ps(i < L ? c[i] : 0.0f);
        for (int64_t n = 0; n < nv; n++) {
            float *u = w->U + i * V + 16 * n;
            _mm512_storeu_ps(u, i < L ? _mm512_mul_ps(ci, _mm512_loadu_ps(u))
                                      : _mm512_setzero_ps());
        }
    }
    gc_pack(w->U, V, GC_L, V, w->Uhi, w->Ulo);
    gc_gemm(w->kT, GC_L, K, GC_L / 32, w->Uhi, w->Ulo, V, w->D, V);
    const __m512 dL = gc_exp(_mm512_set1_ps(GL));
    for (int64_t x = 0; x < K * V; x += 16) {
        const __m512 d = _mm512_loadu_ps(w->D + x);
        _mm512_storeu_ps(S + x, init ? _mm512_fmadd_ps(dL, _mm512_loadu_ps(S + x), d) : d);
    }
}

/* One task: request r (tokens starts .. starts + len - 1), key head kh and its value heads. */
static void gc_task(const struct gc_args *s, char *pages_base, int init, int64_t t0, int64_t len,
                    int64_t kh, struct gc_work *w) {
    const int64_t K = s->K, V = s->V, per = s->Hv / s->Hk, elem = s->state_bf16 ? 2 : 4;
    for (int64_t j = 0; j < per; j++) { /* the states, float32 */
        float *S = w->S + j * K * V;
        const char *page = pages_base + (kh * per + j) * K * V * elem;
        if (!init) {
            memset(S, 0, sizeof(float) * (size_t)(K * V));
        } else if (s->state_bf16) {
            for (int64_t x = 0; x < K * V; x += 16) {
                const __m512i raw =
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(page + 2 * x)));
                _mm512_storeu_ps(S + x, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
            }
        } else {
            memcpy(S, page, sizeof(float) * (size_t)(K * V));
        }
    }
    int have = init;
    for (int64_t c0 = 0; c0 < len; c0 += GC_L) {
        const int64_t L = len - c0 < GC_L ? len - c0 : GC_L;
        gc_chunk_keys(s, t0 + c0, L, kh, w);
        for (int64_t j = 0; j < per; j++)
            gc_chunk_value(s, t0 + c0, L, kh * per + j, w->S + j * K * V, have, w);
        have = 1;
    }
    for (int64_t j = 0; j < per; j++) {
        const float *S = w->S + j * K * V;
        char *page = pages_base + (kh * per + j) * K * V * elem;
        if (s->state_bf16) {
            for (int64_t x = 0; x < K * V; x += 16) {
                const __m256i h = hkv_f32x16_to_bf16(_mm512_loadu_ps(S + x));
                _mm256_storeu_si256((void *)(page + 2 * x), h);
            }
        } else
            memcpy(page, S, sizeof(float) * (size_t)(K * V));
    }
}

int hkv_gdn_chunk(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                  const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                  int64_t R, int64_t Hk, int64_t Hv, int64_t K, int64_t V, const void *q,
                  int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                  int64_t v_stride, int in_bf16, const float *g, const float *beta, float *o) {
    if (!in_bf16 || K % 32 || V % 32 || K > GC_MAX_DIM || V > GC_MAX_DIM || Hv % Hk) return 2;
    const struct gc_args s = {state, page_stride, state_bf16, q, k, v, q_stride, k_stride,
                              v_stride, g, beta, o, Hk, Hv, K, V};
    const int64_t elem = state_bf16 ? 2 : 4;
    int bad = 0;
#pragma omp parallel
    {
        /* denormals flushed to zero, read as zero: decays of e^-80 and below times small
         * values reach them, and each costs a microcode assist (measured 6x slower in a model's
         * prefill); their contributions are below 1e-38 */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        struct gc_work *w = &gc_tls;
        const int ok = gc_reserve(w, Hv / Hk, K, V);
        if (!ok) {
#pragma omp atomic write
            bad = 1;
        } else {
            hkv_tiles_16x64();
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++)
            for (int64_t kh = 0; kh < Hk; kh++) {
                if (!ok || lens[r] < 2) continue;
                char *base = (char *)state + pages[r] * page_stride * elem;
                gc_task(&s, base, has_initial[r], starts[r], lens[r], kh, w);
            }
        if (ok) _tile_release();
        _mm_setcsr(csr);
    }
    return bad;
}

#else /* no AMX */

int hkv_gdn_chunk(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                  const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                  int64_t R, int64_t Hk, int64_t Hv, int64_t K, int64_t V, const void *q,
                  int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                  int64_t v_stride, int in_bf16, const float *g, const float *beta, float *o) {
    (void)state, (void)page_stride, (void)state_bf16, (void)pages, (void)has_initial;
    (void)starts, (void)lens, (void)R, (void)Hk, (void)Hv, (void)K, (void)V, (void)q;
    (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)in_bf16, (void)g;
    (void)beta, (void)o;
    return 2;
}

#endif
