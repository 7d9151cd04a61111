/* Native MLA decode (multi-head latent attention, DeepSeek-V2/V3, Kimi-Linear), compiled into the
 * one native library with kernels.c; `mla.py` declares its ctypes signature. The PyTorch reference
 * is hybridkv/ops/mla.py (mla_decode).
 *
 * One absorbed query per request and head, q[s, h] = [W_UK^T q_nope | q_rope] (W = rank + rope
 * values), attends over the request's latent rows read in place from the paged cache:
 *
 *     cache viewed as [num_kernel_blocks * kbs, W]; position t of request s is row
 *     table[s, t / kbs] * kbs + t % kbs
 *     p[h, t] = softmax_t(scale * q[s, h] . row_t)
 *     out[s, h, :] = sum_t p[h, t] * row_t[0 : rank]          (float32)
 *
 * All heads share the rows (one latent "KV head"), so each row is read once per pass for all
 * heads. q and the cache are float32 (bf16 == 0) or both bfloat16 (widened as read); the math
 * and out are float32. Requests run in parallel (OpenMP).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

/* n values from element i of a float32 or bfloat16 array, as float32 into out */
static void mla_load(const void *x, int bf16, int64_t i, int64_t n, float *out) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)x + i;
        for (int64_t l = 0; l < n; l++) out[l] = hkv_bf16_to_f32(src[l]);
    } else {
        memcpy(out, (const float *)x + i, sizeof(float) * (size_t)n);
    }
}

/* a . b over n floats: 16 independent partial sums (vectorised without reassociating a
 * single float reduction, which the compiler may not do) */
static inline float mla_dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[d + l] * b[d + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One request's heads over its context: qf [H, W] float32 -> o [H, rank] float32. */
static void mla_attend(const float *qf, const void *cache, int bf16, int64_t kbs, int64_t rank,
                       int64_t W, int64_t H, const int32_t *table, int64_t len, float scale,
                       float *o) {
    float *row = malloc(sizeof(float) * (size_t)(W + H * (len > 0 ? len : 1)));
    if (row == NULL) return;
    float *scores = row + W; /* [H, len] */
    for (int64_t t = 0; t < len; t++) {
        int64_t r = (int64_t)table[t / kbs] * kbs + t % kbs;
        mla_load(cache, bf16, r * W, W, row);
        for (int64_t h = 0; h < H; h++) scores[h * len + t] = mla_dot(qf + h * W, row, W) * scale;
    }
    for (int64_t h = 0; h < H; h++) {
        float *sc = scores + h * len;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
        for (int64_t t = 0; t < len; t++) {
            sc[t] = expf(sc[t] - m);
            sum += sc[t];
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t t = 0; t < len; t++) sc[t] *= inv;
    }
    memset(o, 0, sizeof(float) * (size_t)(H * rank));
    for (int64_t t = 0; t < len; t++) {
        int64_t r = (int64_t)table[t / kbs] * kbs + t % kbs;
        mla_load(cache, bf16, r * W, rank, row);
        for (int64_t h = 0; h < H; h++) {
            float p = scores[h * len + t];
            float *oh = o + h * rank;
            for (int64_t d = 0; d < rank; d++) oh[d] += p * row[d];
        }
    }
    free(row);
}

/* ---- A decode step's whole MLA in three calls, none in PyTorch (a step stays capturable) ----
 *
 * hkv_mla_rope_pairs: DeepSeek's interleaved RoPE (hybridkv/layers/rotary.py, torch_rope_pairs):
 * pairs (x[2i], x[2i+1]) rotated by angle i, laid out de-interleaved:
 *     out[i]         = x[2i] c[i] - x[2i+1] s[i]
 *     out[R / 2 + i] = x[2i+1] c[i] + x[2i] s[i]          (i < R / 2)
 * x: [T, H, R] at x + t * tok_stride + h * head_stride (pairs contiguous); cos, sin: [T, R]
 * (the first half used); out: [T, H, R] contiguous; all float32 or all bfloat16 (bf16: each
 * product and the sum rounded, as PyTorch computes it in bfloat16). */
void hkv_mla_rope_pairs(const void *x, int64_t tok_stride, int64_t head_stride, const void *cos,
                        const void *sin, void *out, int bf16, int64_t T, int64_t H, int64_t R) {
    const int64_t half = R / 2;
#pragma omp parallel for schedule(static) if (T * H * R >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t src = t * tok_stride + h * head_stride, dst = (t * H + h) * R;
            for (int64_t i = 0; i < half; i++) {
                if (!bf16) {
                    const float *xs = (const float *)x + src;
                    const float c = ((const float *)cos)[t * R + i];
                    const float sn = ((const float *)sin)[t * R + i];
                    const float a = xs[2 * i] * c, b = xs[2 * i + 1] * sn;
                    const float e = xs[2 * i + 1] * c, f = xs[2 * i] * sn;
                    ((float *)out)[dst + i] = a - b;
                    ((float *)out)[dst + half + i] = e + f;
                    continue;
                }
                const uint16_t *xs = (const uint16_t *)x + src;
                const float x1 = hkv_bf16_to_f32(xs[2 * i]), x2 = hkv_bf16_to_f32(xs[2 * i + 1]);
                const float c = hkv_bf16_to_f32(((const uint16_t *)cos)[t * R + i]);
                const float sn = hkv_bf16_to_f32(((const uint16_t *)sin)[t * R + i]);
#define MLA_R(v) hkv_bf16_to_f32(hkv_f32_to_bf16(v))
                const float a = MLA_R(x1 * c), b = MLA_R(x2 * sn);
                const float e = MLA_R(x2 * c), f = MLA_R(x1 * sn);
#undef MLA_R
                ((uint16_t *)out)[dst + i] = hkv_f32_to_bf16(a - b);
                ((uint16_t *)out)[dst + half + i] = hkv_f32_to_bf16(e + f);
            }
        }
}

/* hkv_mla_write: the step's latent rows [c | k_rope] written into their cache slots (the
 * PyTorch form: a cat, then write_mla_cache's scatter):
 *     cache viewed as [rows_total, rank + rope] (slot s = row s); for every token t with
 *     0 <= slots[t] < rows_total: row = [c[t, :rank] | kr[t, :rope]]
 * c rows at c + t * c_stride, kr rows at kr + t * kr_stride (elements); elem: 4 or 2 bytes
 * (c, kr and the cache share the dtype: values copied as they are). */
void hkv_mla_write(const void *c, int64_t c_stride, const void *kr, int64_t kr_stride,
                   void *cache, const int64_t *slots, int64_t T, int64_t rank, int64_t rope,
                   int64_t elem, int64_t rows_total) {
    const int64_t W = rank + rope;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= rows_total) continue;
        char *dst = (char *)cache + slot * W * elem;
        memcpy(dst, (const char *)c + t * c_stride * elem, (size_t)(rank * elem));
        memcpy(dst + rank * elem, (const char *)kr + t * kr_stride * elem, (size_t)(rope * elem));
    }
}

/* n float32 or bfloat16 values of a weight row, as float32 */
static inline void mla_row(const void *w, int bf16, int64_t i, int64_t n, float *out) {
    mla_load(w, bf16, i, n, out);
}

/* hkv_mla_decode_absorbed: decode rows of MLA from the query projections to the values, in
 * three parallel phases (hybridkv/ops/mla.py, torch_mla_decode, is the reference):
 *     absorb   qa[s, h] = [W_UK[h]^T q_nope[s, h] | q_rope[s, h]]          [S, H, rank + rope]
 *     attend   lat[s, h] = softmax(scale qa[s, h] . rows) rows[:, :rank]   (mla_attend)
 *     expand   out[s, h, j] = W_UV[h, j] . lat[s, h]                       [S, H, v]
 * W = w_kv_b [H * (nope + v), rank] (kv_b_proj.weight: per head nope rows of W_UK, then v rows
 * of W_UV). q_nope at q_nope + s * qn_tok + h * qn_head, q_rope at q_rope + s * qr_tok +
 * h * qr_head (channels contiguous); q_nope, q_rope, w and out float32 (bf16 == 0) or
 * bfloat16; the cache float32 or bfloat16 (cache_bf16); every sum in float32 (out rounded once
 * in bfloat16). work: float32 [S, H, 2 rank + rope]. lens: int32 [S]; table: [S, table_stride]
 * int32 kernel-block ids (the caller's: trusted, as hkv_paged_decode trusts them). */
void hkv_mla_decode_absorbed(const void *q_nope, int64_t qn_tok, int64_t qn_head,
                             const void *q_rope, int64_t qr_tok, int64_t qr_head, const void *w,
                             int bf16, const void *cache, int cache_bf16, int64_t kbs,
                             int64_t rank, int64_t rope, int64_t nope, int64_t vdim, int64_t H,
                             const int32_t *table, int64_t table_stride, const int32_t *lens,
                             int64_t S, float scale, float *work, void *out) {
    const int64_t W = rank + rope, per = 2 * rank + rope, head_rows = nope + vdim;
#pragma omp parallel for schedule(static)
    for (int64_t sh = 0; sh < S * H; sh++) {
        const int64_t s = sh / H, h = sh % H;
        float *qa = work + sh * per;
        float *wrow = malloc(sizeof(float) * (size_t)(rank + nope));
        if (wrow == NULL) continue;
        float *qn = wrow + rank;
        mla_load(q_nope, bf16, s * qn_tok + h * qn_head, nope, qn);
        memset(qa, 0, sizeof(float) * (size_t)rank);
        for (int64_t d = 0; d < nope; d++) {
            mla_row(w, bf16, (h * head_rows + d) * rank, rank, wrow);
            const float a = qn[d];
            for (int64_t r = 0; r < rank; r++) qa[r] += a * wrow[r];
        }
        mla_load(q_rope, bf16, s * qr_tok + h * qr_head, rope, qa + rank);
        free(wrow);
    }
#pragma omp parallel for schedule(dynamic)
    for (int64_t s = 0; s < S; s++) {
        float *qf = malloc(sizeof(float) * (size_t)(H * W));
        float *lat = malloc(sizeof(float) * (size_t)(H * rank));
        if (qf != NULL && lat != NULL) {
            for (int64_t h = 0; h < H; h++)
                memcpy(qf + h * W, work + (s * H + h) * per, sizeof(float) * (size_t)W);
            mla_attend(qf, cache, cache_bf16, kbs, rank, W, H, table + s * table_stride, lens[s],
                       scale, lat);
            for (int64_t h = 0; h < H; h++)
                memcpy(work + (s * H + h) * per + W, lat + h * rank, sizeof(float) * (size_t)rank);
        }
        free(qf);
        free(lat);
    }
#pragma omp parallel for schedule(static)
    for (int64_t sh = 0; sh < S * H; sh++) {
        const int64_t h = sh % H;
        const float *lat = work + sh * per + W;
        float *wrow = malloc(sizeof(float) * (size_t)rank);
        if (wrow == NULL) continue;
        for (int64_t j = 0; j < vdim; j++) {
            mla_row(w, bf16, (h * head_rows + nope + j) * rank, rank, wrow);
            const float v = mla_dot(lat, wrow, rank);
            if (bf16)
                ((uint16_t *)out)[sh * vdim + j] = hkv_f32_to_bf16(v);
            else
                ((float *)out)[sh * vdim + j] = v;
        }
        free(wrow);
    }
}
