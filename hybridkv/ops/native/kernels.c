/* CPU kernels for the two memory-bound decode operations of a hybrid model.
 *
 * Plain C with OpenMP, built at first use by hybridkv/ops/native/__init__.py (gcc -O3
 * -march=native -fopenmp) and called through ctypes. Each reads the paged cache in place, so
 * nothing is gathered into a temporary: the state of a Mamba2 layer is read and written once,
 * a request's K and V are read once. All tensors are float32 and contiguous unless a stride is
 * passed. OpenMP here is the libgomp that torch already loaded (same soname), so
 * torch.set_num_threads() sets the number of threads for these loops too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One Mamba2 decode step of R requests, in place in their state pages.
 *
 *   state page p: state + p * page_stride, holding h[H][P][N]
 *   h = exp(dt * A) * h + (dt * x) outer B        y = h . C + D * x
 *
 * x: [R, H, P]; dt: [R, H] (softplus'd and clamped); A, D: [H]; B, C: [R, G, N]; y: [R, H, P].
 * Heads h of group h / (H / G) share B and C.
 */
void hkv_mamba2_decode_f32(float *state, int64_t page_stride, const int64_t *pages, int64_t R,
                           int64_t H, int64_t P, int64_t N, int64_t G, const float *x,
                           const float *dt, const float *A, const float *B, const float *C,
                           const float *D, float *y) {
    const int64_t heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            const float step = dt[r * H + h];
            const float decay = expf(step * A[h]);
            const int64_t group = r * G + h / heads_per_group;
            const float *b = B + group * N;
            const float *c = C + group * N;
            const float *xh = x + (r * H + h) * P;
            float *yh = y + (r * H + h) * P;
            float *s = state + pages[r] * page_stride + h * P * N;
            for (int64_t p = 0; p < P; p++) {
                const float xdt = xh[p] * step;
                float *row = s + p * N;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < N; n++) {
                    const float v = row[n] * decay + xdt * b[n];
                    row[n] = v;
                    acc += v * c[n];
                }
                yh[p] = acc + D[h] * xh[p];
            }
        }
    }
}

/* Decode attention of S requests (one query each) straight from the paged cache.
 *
 *   cache: [num_kernel_blocks, 2, kbs, KVH, Dh] (K at 0, V at 1)
 *   position t of request s -> block block_table[s * table_stride + t / kbs], offset t % kbs
 *
 * Request s attends to positions first[s] .. seq_lens[s] - 1 (first > 0 under a sliding
 * window); no other slot is read, so whatever other slots hold (NaN included) cannot leak.
 * q, out: [S, H, Dh]; the H / KVH query heads of a KV head share its keys and values.
 * One task per request, two passes over its positions: scores of every head, then the
 * softmax-weighted sum of V (exact softmax, no running rescale). Each pass reads a token's whole
 * row (all KV heads, contiguous): 3x faster than one task per (request, KV head), whose reads
 * stride over the other heads' bytes.
 */
void hkv_paged_decode_f32(const float *q, const float *cache, int64_t kbs, int64_t KVH,
                          int64_t Dh, int64_t H, const int32_t *block_table,
                          int64_t table_stride, const int64_t *first, const int64_t *seq_lens,
                          int64_t S, float scale, float *out) {
    const int64_t group = H / KVH;
    const int64_t row = KVH * Dh;   /* floats per cached token (all KV heads) */
    const int64_t half = kbs * row; /* K part of a block -> its V part */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < S; s++) {
        const int64_t t0 = first[s], len = seq_lens[s] - first[s];
        const int32_t *table = block_table + s * table_stride;
        const float *qs = q + s * H * Dh;
        float *os = out + s * H * Dh;
        for (int64_t i = 0; i < H * Dh; i++) os[i] = 0.0f;
        if (len <= 0) continue;
        float *scores = malloc(sizeof(float) * (size_t)(H * len));
        if (scores == NULL) continue;
        /* pass 1: scores[h][t] = q_h . k_t * scale (a token's row holds every KV head) */
        for (int64_t t = 0; t < len; t++) {
            const int64_t pos = t0 + t;
            const float *k = cache + ((int64_t)table[pos / kbs] * 2 * kbs + pos % kbs) * row;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qs + h * Dh, *kh = k + (h / group) * Dh;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < Dh; d++) dot += qh[d] * kh[d];
                scores[h * len + t] = dot * scale;
            }
        }
        /* softmax per query head */
        for (int64_t h = 0; h < H; h++) {
            float *sh = scores + h * len;
            float m = sh[0];
            for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
            float total = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = expf(sh[t] - m);
                total += sh[t];
            }
            const float inv = 1.0f / total;
            for (int64_t t = 0; t < len; t++) sh[t] *= inv;
        }
        /* pass 2: out_h = sum_t p_h[t] * v_t */
        for (int64_t t = 0; t < len; t++) {
            const int64_t pos = t0 + t;
            const float *v =
                cache + ((int64_t)table[pos / kbs] * 2 * kbs + pos % kbs) * row + half;
            for (int64_t h = 0; h < H; h++) {
                const float p = scores[h * len + t];
                const float *vh = v + (h / group) * Dh;
                float *oh = os + h * Dh;
#pragma omp simd
                for (int64_t d = 0; d < Dh; d++) oh[d] += p * vh[d];
            }
        }
        free(scores);
    }
}
