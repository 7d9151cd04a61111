/* Kimi delta attention (KDA, Kimi-Linear) on the CPU: the delta rule with a per-key-channel
 * decay over packed requests, each request's state read from its page and written back once.
 * hybridkv/ops/kda.py is the reference (and says why KDA is a state kind of its own); this
 * file is compiled into the one native library with kernels.c and declared by
 * hybridkv/ops/native/kda.py.
 *
 * Per request r and head h (one OpenMP task each), token by token, with the head's state S
 * [K, V] in float32:
 *     qn = q / sqrt(|q|^2 + eps) / sqrt(K),  kn = k / sqrt(|k|^2 + eps)
 *     S[c, :] *= exp(g[c])         pred = S^T kn        (one pass over the rows)
 *     d = beta * (v - pred)
 *     S[c, :] += kn[c] * d         o = S^T qn           (a second pass)
 * A float32 state is updated in its page; a bfloat16 one is widened into a work copy, run,
 * and rounded back once at the end of the request. Speculative decoding keeps the state after
 * every position (pos_state non-NULL): a request with pos_rows[r] >= 0 also writes its head's
 * state, in the state's dtype, after each of its tokens i = 0 .. lens[r] - 2, to
 *     pos_state + pos_rows[r] * pos_row_stride + i * pos_stride + h * K * V      (elements)
 * Inputs q, k, v are float32 or bfloat16
 * rows at a token stride (each token's [H, D] contiguous); g [T, H, K] and beta [T, H] are
 * float32 and contiguous; o [T, H, V] float32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#define KDA_EPS 1e-6f
#define KDA_MIN_LOG_DECAY -80.0f /* as the reference: exp below this is far below float32 */

/* n floats of a float32 or bfloat16 array from element i, widened into out. */
static inline void kda_load(const void *x, int bf16, int64_t i, int64_t n, float *out) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)x + i;
        for (int64_t l = 0; l < n; l++) out[l] = hkv_bf16_to_f32(src[l]);
    } else {
        memcpy(out, (const float *)x + i, sizeof(float) * (size_t)n);
    }
}

struct kda_inputs {
    const void *q, *k, *v;
    int64_t q_stride, k_stride, v_stride; /* elements between tokens */
    int in_bf16;
    const float *g, *beta;
    float *o;
    int64_t H, K, V;
};

/* x <- x / sqrt(|x|^2 + eps) * scale, n elements. */
static void kda_normalise(float *x, int64_t n, float scale) {
    float sq = 0.0f;
    for (int64_t c = 0; c < n; c++) sq += x[c] * x[c];
    const float inv = scale / sqrtf(sq + KDA_EPS);
    for (int64_t c = 0; c < n; c++) x[c] *= inv;
}

/* One token of one head: S [K, V] float32 updated, o [V] written. work: 2K + V floats. */
static void kda_token(float *S, const struct kda_inputs *in, int64_t t, int64_t h, float *work) {
    const int64_t K = in->K, V = in->V;
    float *qn = work, *kn = work + K, *d = work + 2 * K;
    kda_load(in->q, in->in_bf16, t * in->q_stride + h * K, K, qn);
    kda_load(in->k, in->in_bf16, t * in->k_stride + h * K, K, kn);
    kda_normalise(qn, K, 1.0f / sqrtf((float)K));
    kda_normalise(kn, K, 1.0f);
    kda_load(in->v, in->in_bf16, t * in->v_stride + h * V, V, d); /* d holds v, then the delta */
    const float *g = in->g + (t * in->H + h) * K;
    const float beta = in->beta[t * in->H + h];
    float *o = in->o + (t * in->H + h) * V;
    for (int64_t c = 0; c < K; c++) { /* decay row c, subtract its prediction from v */
        const float e = expf(fmaxf(g[c], KDA_MIN_LOG_DECAY)), kc = kn[c];
        float *row = S + c * V;
        for (int64_t j = 0; j < V; j++) {
            row[j] *= e;
            d[j] -= row[j] * kc;
        }
    }
    for (int64_t j = 0; j < V; j++) {
        d[j] *= beta;
        o[j] = 0.0f;
    }
    for (int64_t c = 0; c < K; c++) { /* write the correction, read out */
        const float kc = kn[c], qc = qn[c];
        float *row = S + c * V;
        for (int64_t j = 0; j < V; j++) {
            row[j] += kc * d[j];
            o[j] += row[j] * qc;
        }
    }
}

/* n floats into a float32 or (bf16) bfloat16 array at dst. */
static void kda_store(char *dst, int bf16, const float *S, int64_t n) {
    if (!bf16) {
        memcpy(dst, S, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = hkv_f32_to_bf16(S[i]);
}

/* One request's head: its state in the page (float32) or widened into `copy` (bfloat16);
 * kept (NULL: none): where the state after each token but the last goes, kept_stride bytes
 * apart. */
static void kda_head(char *page_head, int state_bf16, int has_initial, int64_t start,
                     int64_t len, int64_t h, const struct kda_inputs *in, float *copy,
                     float *work, char *kept, int64_t kept_stride) {
    const int64_t n = in->K * in->V;
    float *S = state_bf16 ? copy : (float *)page_head;
    if (!has_initial) {
        memset(S, 0, sizeof(float) * (size_t)n); /* the page may hold NaN bit patterns */
    } else if (state_bf16) {
        kda_load(page_head, 1, 0, n, S);
    }
    for (int64_t i = 0; i < len; i++) {
        kda_token(S, in, start + i, h, work);
        if (kept != NULL && i + 1 < len) kda_store(kept + i * kept_stride, state_bf16, S, n);
    }
    if (state_bf16) kda_store(page_head, 1, S, n);
}

/* state: [pages][H][K][V] at page_stride elements between pages; pages, has_initial, starts,
 * lens: [R]. Returns non-zero when a thread cannot allocate its work space (a status that a
 * captured step's replay checks). */
int hkv_kda_rule(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                 const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                 int64_t R, int64_t H, int64_t K, int64_t V, const void *q, int64_t q_stride,
                 const void *k, int64_t k_stride, const void *v, int64_t v_stride, int in_bf16,
                 const float *g, const float *beta, float *o, void *pos_state,
                 const int64_t *pos_rows, int64_t pos_row_stride, int64_t pos_stride) {
    const struct kda_inputs in = {q, k, v, q_stride, k_stride, v_stride, in_bf16, g, beta, o,
                                  H, K, V};
    const size_t elem = state_bf16 ? 2 : 4;
    size_t bytes = sizeof(float) * (size_t)(K * V + 2 * K + V);
    bytes = (bytes + 63) / 64 * 64; /* aligned_alloc: a multiple of the alignment */
    int failed = 0;
#pragma omp parallel
    {
        float *copy = aligned_alloc(64, bytes);
        if (copy == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            for (int64_t h = 0; h < H; h++) {
                if (lens[r] == 0 || copy == NULL) continue;
                char *head = (char *)state + (pages[r] * page_stride + h * K * V) * elem;
                const int64_t row = pos_state != NULL ? pos_rows[r] : -1;
                char *kept = row < 0 ? NULL
                                     : (char *)pos_state
                                           + (row * pos_row_stride + h * K * V) * (int64_t)elem;
                kda_head(head, state_bf16, has_initial[r], starts[r], lens[r], h, &in, copy,
                         copy + K * V, kept, pos_stride * (int64_t)elem);
            }
        }
        free(copy);
    }
    return failed;
}

/* ---- Kimi delta attention's glue around the rule (hybridkv/layers/kda.py), one native call
 * each where PyTorch makes several ops, so that a decode step stays capturable ----
 *
 * hkv_kda_gates: the rule's gates from their projections
 *     f     [T, H * K] rows at f + t * f_stride (f_b_proj(f_a_proj(x)))
 *     b     [T, H] rows at b + t * b_stride (b_proj(x))
 *  -> g     [T, H, K] float32 = decay[h] * softplus(float(f) + dt_bias[h K + k])
 *     beta  [T, H] float32 = sigmoid(b), rounded to bfloat16 first for bfloat16 b (PyTorch's
 *           sigmoid of the model-dtype projection, then .float())
 * f and b float32 or bfloat16 alike (bf16); decay = -exp(A_log) [H] and dt_bias [H * K] float32.
 * softplus is PyTorch's (x above 20 is x itself, else log1p(exp(x))). */
static inline float kda_value(const void *x, int bf16, int64_t i) {
    return bf16 ? hkv_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

void hkv_kda_gates(const void *f, int64_t f_stride, const void *b, int64_t b_stride, int bf16,
                   int64_t T, int64_t H, int64_t K, const float *decay, const float *dt_bias,
                   float *g, float *beta) {
#pragma omp parallel for schedule(static) if (T * H * K >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            for (int64_t k = 0; k < K; k++) {
                const float x = kda_value(f, bf16, t * f_stride + h * K + k) + dt_bias[h * K + k];
                g[(t * H + h) * K + k] = decay[h] * (x > 20.0f ? x : log1pf(expf(x)));
            }
            const float s = 1.0f / (1.0f + expf(-kda_value(b, bf16, t * b_stride + h)));
            beta[t * H + h] = bf16 ? hkv_bf16_to_f32(hkv_f32_to_bf16(s)) : s;
        }
}

/* hkv_kda_out_norm: the rule's output through o_norm, gated (transformers'
 * KimiLinearRMSNormGated with sigmoid), per row of D channels (a token's head):
 *     x    = o rounded to the model dtype (bfloat16 when bf16), as float32
 *     out  = (w * (x / sqrt(mean(x^2) + eps))) * sigmoid(float(gate))   rounded once
 * o: [rows, D] float32 contiguous (the rule's output); gate rows at gate + r * gate_stride
 * (model dtype); w: [D] float32; out: [rows, D] of the model dtype. */
void hkv_kda_out_norm(const float *o, const void *gate, int64_t gate_stride, const float *w,
                      void *out, int bf16, int64_t rows, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (rows * D >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *x = o + r * D;
        float sq = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float v = bf16 ? hkv_bf16_to_f32(hkv_f32_to_bf16(x[d])) : x[d];
            sq += v * v;
        }
        const float inv = 1.0f / sqrtf(sq / (float)D + eps);
        for (int64_t d = 0; d < D; d++) {
            const float v = bf16 ? hkv_bf16_to_f32(hkv_f32_to_bf16(x[d])) : x[d];
            const float s = 1.0f / (1.0f + expf(-kda_value(gate, bf16, r * gate_stride + d)));
            const float y = (w[d] * (v * inv)) * s;
            if (bf16)
                ((uint16_t *)out)[r * D + d] = hkv_f32_to_bf16(y);
            else
                ((float *)out)[r * D + d] = y;
        }
    }
}
