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

static void mla_decode_one(const void *q, const void *cache, int bf16, int64_t kbs, int64_t rank,
                           int64_t W, int64_t H, const int32_t *table, int64_t len, int64_t s,
                           float scale, float *out) {
    float *qf = malloc(sizeof(float) * (size_t)(H * W + W + H * (len > 0 ? len : 1)));
    float *row = qf + H * W;
    float *scores = row + W;  /* [H, len] */
    mla_load(q, bf16, s * H * W, H * W, qf);
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
    float *o = out + s * H * rank;
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
    free(qf);
}

/* q: [S, H, rank + rope]; cache: [num_kernel_blocks * kbs, rank + rope]; table: [S, table_stride]
 * int32 kernel-block ids; lens: [S] context lengths; out: [S, H, rank] float32 */
void hkv_mla_decode(const void *q, const void *cache, int bf16, int64_t kbs, int64_t rank,
                    int64_t rope, int64_t H, const int32_t *table, int64_t table_stride,
                    const int64_t *lens, int64_t S, float scale, float *out) {
    int64_t W = rank + rope;
#pragma omp parallel for schedule(dynamic)
    for (int64_t s = 0; s < S; s++) {
        mla_decode_one(q, cache, bf16, kbs, rank, W, H, table + s * table_stride, lens[s], s,
                       scale, out);
    }
}
