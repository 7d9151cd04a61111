/* Qwen3-Next's glue between GEMMs, natively: hkv_gdn_prep (below), hkv_gdn_gates (the gates
 * alone, for Qwen3.5's layout) and hkv_sigmoid_gate (the gated attention's output gate, at the
 * end of this file).
 *
 * hkv_gdn_prep: the gated delta net between its projections and its conv1d, in one pass per token:
 * the key-head-grouped outputs of in_proj_qkvz and in_proj_ba split into the [q | k | v] rows
 * the conv1d takes, the z rows of the gated norm, and the rule's gates. PyTorch makes ten
 * copies and conversions of it (four strided reshapes, a cat, two casts, the gate ops).
 * hybridkv/ops/native/gdn_prep.py declares it; hybridkv/layers/gated_delta_net.py calls it.
 * Compiled into the one native library with the other C files of this folder.
 *
 *     qkvz  [T, Hk, 2K + 2 per V] rows at a stride: per key head [q | k | v (per heads) |
 *           z (per heads)], per = Hv / Hk
 *     ba    [T, Hk, 2 per] rows at a stride: per key head [b (per heads) | a (per heads)]
 *  -> qkv   [T, 2 Hk K + Hv V]: [q of every key head | k of every key head | v of every
 *           value head]
 *     z     [T, Hv V]
 *     g     [T, Hv] float32 = decay[h] * softplus(float(a) + dt_bias[h])  (decay = -exp(A_log))
 *     beta  [T, Hv] float32 = sigmoid(float(b))
 *
 * qkvz, ba, qkv and z are all float32 or all bfloat16 (bf16); values are copied as they are.
 * softplus is PyTorch's (x above 20 is x itself, else log1p(exp(x))).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "hkv_common.h"

static inline float prep_round(float f) {
    const uint32_t bits = (uint32_t)hkv_f32_to_bf16(f) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

static inline float prep_load(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The rule's gates of one token and value head: g = decay * softplus(a + dt_bias), beta =
 * sigmoid(b) (a already plus dt_bias). */
static inline void prep_gates(float a, float b, float decay, float *g, float *beta) {
    *g = decay * (a > 20.0f ? a : log1pf(expf(a)));
    *beta = 1.0f / (1.0f + expf(-b));
}

void hkv_gdn_prep(const void *qkvz, int64_t qkvz_stride, const void *ba, int64_t ba_stride,
                  int bf16, int64_t T, int64_t Hk, int64_t per, int64_t K, int64_t V,
                  const float *decay, const float *dt_bias, void *qkv, void *z, float *g,
                  float *beta) {
    const int64_t elem = bf16 ? 2 : 4, Hv = Hk * per, pv = per * V;
    const int64_t group = 2 * K + 2 * pv, conv = 2 * Hk * K + Hv * V;
#pragma omp parallel for schedule(static) if (T * (conv + Hv * V) >= (1 << 18))
    for (int64_t t = 0; t < T; t++) {
        const char *src = (const char *)qkvz + t * qkvz_stride * elem;
        char *dst = (char *)qkv + t * conv * elem, *zt = (char *)z + t * Hv * V * elem;
        for (int64_t h = 0; h < Hk; h++) {
            const char *grp = src + h * group * elem;
            memcpy(dst + h * K * elem, grp, (size_t)(K * elem));                        /* q */
            memcpy(dst + (Hk + h) * K * elem, grp + K * elem, (size_t)(K * elem));      /* k */
            memcpy(dst + (2 * Hk * K + h * pv) * elem, grp + 2 * K * elem,
                   (size_t)(pv * elem));                                                /* v */
            memcpy(zt + h * pv * elem, grp + (2 * K + pv) * elem, (size_t)(pv * elem)); /* z */
        }
        const int64_t row = t * ba_stride;
        for (int64_t h = 0; h < Hk; h++)
            for (int64_t j = 0; j < per; j++) {
                const int64_t v = h * per + j;
                const float b = prep_load(ba, bf16, row + h * 2 * per + j);
                const float a = prep_load(ba, bf16, row + h * 2 * per + per + j) + dt_bias[v];
                prep_gates(a, b, decay[v], &g[t * Hv + v], &beta[t * Hv + v]);
            }
    }
}

/* The gates alone, for the layouts whose b and a come from their own projections (Qwen3.5's
 * in_proj_b / in_proj_a, OLMo Hybrid's b_proj / a_proj):
 *
 *     a, b  [T, Hv] rows at a stride (float32 or bfloat16 alike: bf16)
 *  -> g     [T, Hv] float32 = decay[h] * softplus(float(a) + dt_bias[h])
 *     beta  [T, Hv] float32 = sigmoid(float(b))
 *
 * One native call where PyTorch makes five ops (add, softplus, mul, sigmoid, two casts): a
 * decode step of these layouts stays capturable. */
void hkv_gdn_gates(const void *a, int64_t a_stride, const void *b, int64_t b_stride, int bf16,
                   int64_t T, int64_t Hv, const float *decay, const float *dt_bias, float *g,
                   float *beta) {
#pragma omp parallel for schedule(static) if (T * Hv >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        for (int64_t v = 0; v < Hv; v++) {
            const float av = prep_load(a, bf16, t * a_stride + v) + dt_bias[v];
            prep_gates(av, prep_load(b, bf16, t * b_stride + v), decay[v], &g[t * Hv + v],
                       &beta[t * Hv + v]);
        }
}

/* The gated attention's output gate: out = x * sigmoid(gate) over [T, H, D], x rows contiguous
 * ([T, H * D]), gate at gate + t * tok_stride + h * head_stride (the second half of each head's
 * q_proj output); float32 or bfloat16 alike (bf16). In bfloat16 the sigmoid is rounded before
 * the product and the product rounded, as PyTorch's `x * torch.sigmoid(gate)` rounds. */
void hkv_sigmoid_gate(const void *x, const void *gate, int64_t tok_stride, int64_t head_stride,
                      int64_t T, int64_t H, int64_t D, int bf16, void *out) {
#pragma omp parallel for schedule(static) if (T * H * D >= (1 << 18))
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t g0 = t * tok_stride + h * head_stride, x0 = (t * H + h) * D;
            for (int64_t d = 0; d < D; d++) {
                const float s = 1.0f / (1.0f + expf(-prep_load(gate, bf16, g0 + d)));
                const float v = prep_load(x, bf16, x0 + d);
                if (bf16)
                    ((uint16_t *)out)[x0 + d] = hkv_f32_to_bf16(v * prep_round(s));
                else
                    ((float *)out)[x0 + d] = v * s;
            }
        }
}
