/* CPU kernels for a hybrid model's Mamba2 and Mamba1 scans, gated delta rule (Qwen3-Next,
 * Qwen3.5) and causal conv1d (prefill and decode), and the row-wise norms and activations
 * between the GEMMs (decode attention: decode_attention.c).
 *
 * Plain C with OpenMP, built at first use by hybridkv/ops/native/__init__.py (gcc -O3
 * -march=native -fopenmp) and called through ctypes. Each reads the paged cache in place, so
 * nothing is gathered into a temporary: a Mamba2 state is read and written once per step, a
 * request's K and V are read once; a norm or activation reads its rows once where PyTorch's
 * element-wise ops pass over them four to six times. All tensors are float32 and contiguous
 * unless a stride is passed or a kernel says it also takes bfloat16 (the gated delta rule and
 * the Mamba1 scan: inputs and states; the Mamba2 scan and conv1d: states; the row kernels
 * have bfloat16 twins). The math is float32 throughout.
 * OpenMP here is the libgomp that torch already loaded (same soname), so
 * torch.set_num_threads() sets the number of threads for these loops too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

/* Work (elements touched) below which a row kernel runs on the calling thread: waking the
 * OpenMP team costs microseconds, more than a decode step's few rows take, and on a shared
 * machine a team waits for the thread that lost its core. */
#define HKV_PARALLEL_MIN 32768

/* n elements from element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, as
 * float32, to out. */
static inline void load_floats(const void *x, int bf16, int64_t i, int64_t n, float *out) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)x + i;
        for (int64_t l = 0; l < n; l++) out[l] = hkv_bf16_to_f32(src[l]);
    } else {
        memcpy(out, (const float *)x + i, sizeof(float) * (size_t)n);
    }
}

/* Vectors of HKV_LANES floats (GCC/Clang vector extension): one zmm register with AVX-512, one
 * ymm otherwise (wider than the hardware's vectors, GCC would lower them element by element).
 * hkv_vfu may sit at any 4-byte boundary (unaligned loads and stores). HKV_SCAN_ROWS state rows
 * per register block of the long scan: with 2 sums and 2 temporaries, 20 of AVX-512's 32
 * registers, 12 of AVX2's 16. */
#if HKV_AVX512
#define HKV_LANES 16
#define HKV_SCAN_ROWS 16
#else
#define HKV_LANES 8
#define HKV_SCAN_ROWS 8
#endif
typedef float hkv_vf __attribute__((vector_size(HKV_LANES * 4)));
typedef float hkv_vfu __attribute__((vector_size(HKV_LANES * 4), aligned(4)));

#define HKV_INLINE static inline __attribute__((always_inline))

static inline hkv_vf loadv(const float *p) { return *(const hkv_vfu *)p; }
static inline void storev(float *p, hkv_vf v) { *(hkv_vfu *)p = v; }
typedef uint16_t hkv_vh __attribute__((vector_size(HKV_LANES * 2), aligned(2)));
typedef uint32_t hkv_vu __attribute__((vector_size(HKV_LANES * 4)));

/* HKV_LANES bfloat16 numbers at p as float32. */
static inline hkv_vf m1_load_bf16(const uint16_t *p) {
    const hkv_vu bits = __builtin_convertvector(*(const hkv_vh *)p, hkv_vu) << 16;
    return (hkv_vf)bits;
}

/* The sum of v's lanes (a tree of shuffles). */
static inline float hsum(hkv_vf v) {
#if HKV_LANES == 16
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return v[0];
}

/* AVX2 without AVX-512: GCC leaves the loops that call hkv_silu or hkv_exp_nonpositive scalar
 * ("control flow in loop": it if-converts their conditionals, the division under one
 * included, only with AVX-512's masks), so those loops take hkv_common.h's 8-lane twins here,
 * which give the same bits. AVX-512 builds keep the loops GCC vectorises. */
#define HKV_AVX2_ONLY (HKV_AVX2 && !HKV_AVX512)

/* y[i] = hkv_silu(x[i]) over n floats (y may be x). */
static inline void silu_row(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if HKV_AVX2_ONLY
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, hkv_silu8(_mm256_loadu_ps(x + i)));
#endif
#pragma omp simd
    for (int64_t j = i; j < n; j++) y[j] = hkv_silu(x[j]);
}


/* The Mamba2 scan and the causal conv1d below let GCC contract a * b + c into FMAs, as the
 * gated delta rule's and the Mamba1 scan's sections do (-std=c11 turns that off for the file;
 * the row kernels keep PyTorch's rounding and stay outside): the scan's inner loops are
 * multiply-adds, 1.2-1.25x on a prefill chunk. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#define HKV_SCAN_SEGMENT 256      /* tokens whose decays are computed at once */
#define HKV_SCAN_MAX_STATE 16384  /* P * N floats of the transposed copy (64 KB) */
#define HKV_SCAN_LONG 8           /* requests with this many tokens take the blocked path */

/* One (request, head) of a prefill chunk: the state lives in registers while the tokens stream.
 *
 *   page state s[p][n]  --transpose-->  st[n][p]  (n rows, p along a vector's lanes)
 *
 *           p0 .. p0+15         (HKV_LANES = 16, HKV_SCAN_ROWS = 16 with AVX-512)
 *   n0    [ v0  ]      for each token t:  v_j = v_j * decay_t + B_t[n0 + j] * (dt_t x_t[p0..])
 *   ...   [ ... ]                          y_t[p0..] += sum_j C_t[n0 + j] * v_j
 *   n0+15 [ v15 ]
 *
 * No horizontal sum: y's lanes are rows p, accumulated over the block's n. Each (p0, n0) block
 * reads the segment's x, B and C again, from L2 (B and C of 256 tokens are 128 KB for N = 64).
 */
static void scan_blocked(float *s, int init, int64_t tok0, int64_t len, int64_t h, int64_t H,
                         int64_t P, int64_t N, int64_t G, const float *x, int64_t x_ts,
                         const float *dt, float A, const float *B, const float *C,
                         int64_t bc_ts, float D, float *y) {
    float st[HKV_SCAN_MAX_STATE] __attribute__((aligned(64)));
    float decay[HKV_SCAN_SEGMENT], step[HKV_SCAN_SEGMENT];
    const int64_t group = h / (H / G);
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++) st[n * P + p] = init ? s[p * N + n] : 0.0f;
    for (int64_t seg = tok0; seg < tok0 + len; seg += HKV_SCAN_SEGMENT) {
        const int64_t count = tok0 + len - seg < HKV_SCAN_SEGMENT ? tok0 + len - seg
                                                                  : HKV_SCAN_SEGMENT;
        for (int64_t i = 0; i < count; i++) {
            step[i] = dt[(seg + i) * H + h];
            decay[i] = expf(step[i] * A);
        }
        for (int64_t p0 = 0; p0 < P; p0 += HKV_LANES) {
            for (int64_t n0 = 0; n0 < N; n0 += HKV_SCAN_ROWS) {
                hkv_vf v[HKV_SCAN_ROWS];
                for (int j = 0; j < HKV_SCAN_ROWS; j++) v[j] = loadv(st + (n0 + j) * P + p0);
                for (int64_t i = 0; i < count; i++) {
                    const int64_t tok = seg + i;
                    const float *b = B + tok * bc_ts + group * N + n0;
                    const float *c = C + tok * bc_ts + group * N + n0;
                    const hkv_vf xv = loadv(x + tok * x_ts + h * P + p0);
                    const hkv_vf xdt = xv * step[i];
                    float *yt = y + (tok * H + h) * P + p0;
                    /* two sums: halves the chain of dependent adds */
                    hkv_vf acc0 = n0 == 0 ? xv * D : loadv(yt), acc1 = {0.0f};
#pragma GCC unroll 16
                    for (int j = 0; j < HKV_SCAN_ROWS; j += 2) {
                        v[j] = v[j] * decay[i] + b[j] * xdt;
                        v[j + 1] = v[j + 1] * decay[i] + b[j + 1] * xdt;
                        acc0 += c[j] * v[j];
                        acc1 += c[j + 1] * v[j + 1];
                    }
                    storev(yt, acc0 + acc1);
                }
                for (int j = 0; j < HKV_SCAN_ROWS; j++) storev(st + (n0 + j) * P + p0, v[j]);
            }
        }
    }
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++) s[p * N + n] = st[n * P + p];
}

/* The token-by-token loop for short spans (decode steps) and shapes the blocked path does
 * not take: the state stays in its page (in L1 for the span), four rows at a time. */
static void scan_rows(float *s, int init, int64_t tok0, int64_t len, int64_t h, int64_t H,
                      int64_t P, int64_t N, int64_t G, const float *x, int64_t x_ts,
                      const float *dt, float A, const float *B, const float *C, int64_t bc_ts,
                      float D, float *y) {
    const int64_t group = h / (H / G);
    if (!init)
        for (int64_t i = 0; i < P * N; i++) s[i] = 0.0f;
    for (int64_t tok = tok0; tok < tok0 + len; tok++) {
        const float step = dt[tok * H + h];
        const float decay = expf(step * A);
        const float *b = B + tok * bc_ts + group * N;
        const float *c = C + tok * bc_ts + group * N;
        const float *xh = x + tok * x_ts + h * P;
        float *yh = y + (tok * H + h) * P;
        int64_t p = 0;
        /* four rows at a time: four independent reductions keep the FMA units busy
           (one row's reduction is a chain of dependent adds) */
        for (; p + 4 <= P; p += 4) {
            const float x0 = xh[p] * step, x1 = xh[p + 1] * step;
            const float x2 = xh[p + 2] * step, x3 = xh[p + 3] * step;
            float *r0 = s + p * N, *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t n = 0; n < N; n++) {
                const float v0 = r0[n] * decay + x0 * b[n];
                const float v1 = r1[n] * decay + x1 * b[n];
                const float v2 = r2[n] * decay + x2 * b[n];
                const float v3 = r3[n] * decay + x3 * b[n];
                r0[n] = v0;
                r1[n] = v1;
                r2[n] = v2;
                r3[n] = v3;
                a0 += v0 * c[n];
                a1 += v1 * c[n];
                a2 += v2 * c[n];
                a3 += v3 * c[n];
            }
            yh[p] = a0 + D * xh[p];
            yh[p + 1] = a1 + D * xh[p + 1];
            yh[p + 2] = a2 + D * xh[p + 2];
            yh[p + 3] = a3 + D * xh[p + 3];
        }
        for (; p < P; p++) {
            const float xdt = xh[p] * step;
            float *row = s + p * N;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < N; n++) {
                const float v = row[n] * decay + xdt * b[n];
                row[n] = v;
                acc += v * c[n];
            }
            yh[p] = acc + D * xh[p];
        }
    }
}

/* Mamba2 selective scan of R packed requests, token by token, in place in their state pages.
 *
 *   state page p: state + p * page_stride, holding h[H][P][N]
 *   for each token t of a request:
 *       h = exp(dt_t * A) * h + (dt_t * x_t) outer B_t        y_t = h . C_t + D * x_t
 *
 * Request r owns tokens starts[r] .. starts[r] + lens[r] - 1 of x: [T, H, P] (token t at
 * x + t * x_ts), dt: [T, H] (softplus'd and clamped), B, C: [T, G, N] (token t at + t * bc_ts:
 * all three may be column slices of one conv output); y: [T, H, P]; A, D: [H]. Heads h of group
 * h / (H / G) share B and C. A request without an initial state (has_initial[r] == 0) starts
 * from zeros: its page is overwritten, never read (it may hold NaN bit patterns). lens[r] == 0
 * leaves the page untouched. One task per (request, head). Spans of HKV_SCAN_LONG tokens or
 * more keep the state in registers (scan_blocked; 2-4x faster on a prefill chunk with AVX-512,
 * up to 1.7x with AVX2) when P and N are multiples of 16 (8 without AVX-512); shorter ones
 * (decode) keep it in L1 (scan_rows): there the state's trip from and to memory is the cost,
 * not the arithmetic. The state is float32 or (state_bf16) bfloat16, widened per (request,
 * head) into a float32 copy and rounded back after the span; inputs and math are float32.
 *
 * Speculative decoding keeps the state after every position (pos_state non-NULL): a request
 * with pos_rows[r] >= 0 runs its span token by token (scan_rows, the decode step's numbers)
 * and, after each of its tokens i = 0 .. lens[r] - 2, writes its head's state, in the state's
 * dtype, to
 *     pos_state + pos_rows[r] * pos_row_stride + i * pos_stride + h * P * N      (elements)
 * (the state after its last token is in its page, as always).
 */
static void put_state(void *dst, int bf16, const float *s, int64_t size) {
    if (bf16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < size; i++) d[i] = hkv_f32_to_bf16(s[i]);
    } else {
        memcpy(dst, s, sizeof(float) * (size_t)size);
    }
}

void hkv_mamba2_scan(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                     const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                     int64_t R, int64_t H, int64_t P, int64_t N, int64_t G, const float *x,
                     int64_t x_ts, const float *dt, const float *A, const float *B,
                     const float *C, int64_t bc_ts, const float *D, float *y, void *pos_state,
                     const int64_t *pos_rows, int64_t pos_row_stride, int64_t pos_stride) {
    const int blockable =
        P % HKV_LANES == 0 && N % HKV_SCAN_ROWS == 0 && P * N <= HKV_SCAN_MAX_STATE;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            if (lens[r] == 0) continue;
            const int64_t at = pages[r] * page_stride + h * P * N, size = P * N;
            /* a bfloat16 state is widened into a float32 copy, scanned, rounded back */
            float local[HKV_SCAN_MAX_STATE] __attribute__((aligned(64)));
            float *s = (float *)state + at;
            if (state_bf16) {
                s = size <= HKV_SCAN_MAX_STATE ? local : malloc(sizeof(float) * (size_t)size);
                if (s == NULL) continue;
                if (has_initial[r]) load_floats(state, 1, at, size, s);
            }
            const int64_t row = pos_state != NULL ? pos_rows[r] : -1;
            if (row >= 0) {
                const size_t elem = state_bf16 ? 2 : 4;
                char *dst = (char *)pos_state + elem * (size_t)(row * pos_row_stride + h * size);
                for (int64_t i = 0; i < lens[r]; i++) {
                    scan_rows(s, i > 0 || has_initial[r], starts[r] + i, 1, h, H, P, N, G, x,
                              x_ts, dt, A[h], B, C, bc_ts, D[h], y);
                    if (i + 1 < lens[r])
                        put_state(dst + elem * (size_t)(i * pos_stride), state_bf16, s, size);
                }
            } else if (blockable && lens[r] >= HKV_SCAN_LONG)
                scan_blocked(s, has_initial[r], starts[r], lens[r], h, H, P, N, G, x, x_ts, dt,
                             A[h], B, C, bc_ts, D[h], y);
            else
                scan_rows(s, has_initial[r], starts[r], lens[r], h, H, P, N, G, x, x_ts, dt,
                          A[h], B, C, bc_ts, D[h], y);
            if (state_bf16) {
                uint16_t *page = (uint16_t *)state + at;
                for (int64_t i = 0; i < size; i++) page[i] = hkv_f32_to_bf16(s[i]);
                if (s != local) free(s);
            }
        }
    }
}

#pragma GCC pop_options

/* New keys and values into their cache slots (slot -1: padding, skipped):
 *   cache: [num_kernel_blocks, 2, kbs, row] (K at 0, V at 1), row = kv_heads * head_dim
 *   slot s -> kernel block s / kbs, offset s % kbs
 * k, v: token t's row at + t * k_stride / v_stride (elements; the row contiguous), of the
 * cache's element size (elem: 2 or 4 bytes); slots beyond num_slots are skipped too. */
void hkv_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *cache,
                  const int64_t *slots, int64_t T, int64_t kbs, int64_t row, int64_t elem,
                  int64_t num_slots) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) continue;
        const int64_t at = ((s / kbs) * 2 * kbs + s % kbs) * row;
        char *base = (char *)cache;
        memcpy(base + at * elem, (const char *)k + t * k_stride * elem, (size_t)(row * elem));
        memcpy(base + (at + kbs * row) * elem, (const char *)v + t * v_stride * elem,
               (size_t)(row * elem));
    }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#define HKV_CONV_MAX_HISTORY 8 /* K - 1 columns kept per channel; d_conv is 4 in practice */
#define HKV_CONV_TOKENS 16      /* tokens per task: whole rows, read and written in order */

/* The conv's input row i of a request (i < 0: from its history), float32 or bfloat16. */
struct conv_src {
    const void *x;
    int64_t x_stride;
    int x_bf16;
    const float *hist; /* [hist_len][C] float32: the inputs before the request's first token */
    int64_t hist_len, C, first;
};

static inline const void *conv_row(const struct conv_src *s, int64_t i, int *bf16) {
    if (i < 0) {
        *bf16 = 0;
        return s->hist + (s->hist_len + i) * s->C;
    }
    *bf16 = s->x_bf16;
    const int64_t at = (s->first + i) * s->x_stride;
    return s->x_bf16 ? (const void *)((const uint16_t *)s->x + at)
                     : (const void *)((const float *)s->x + at);
}

/* y[c] += w[c] * in[c] over a row, in float32 or bfloat16 */
static inline void conv_tap(float *restrict y, const float *restrict w, const void *in,
                            int in_bf16, int64_t C) {
    if (in_bf16) {
        const uint16_t *v = in;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) y[c] += w[c] * hkv_bf16_to_f32(v[c]);
    } else {
        const float *v = in;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) y[c] += w[c] * v[c];
    }
}

/* Output row i of a request with d_conv 4 and every input in x (i >= 3): the four taps summed
 * in registers, one pass over the row (the common case: every prefill token but a request's
 * first three). */
static inline void conv_row4(float *restrict y, const float *restrict wt, const float *bias,
                             const struct conv_src *s, int64_t i) {
    const int64_t C = s->C, st = s->x_stride;
    if (s->x_bf16) {
        const uint16_t *x3 = (const uint16_t *)s->x + (s->first + i) * st;
        const uint16_t *x0 = x3 - 3 * st, *x1 = x3 - 2 * st, *x2 = x3 - st;
#pragma omp simd
        for (int64_t c = 0; c < C; c++)
            y[c] = (bias != NULL ? bias[c] : 0.0f) + wt[c] * hkv_bf16_to_f32(x0[c])
                   + wt[C + c] * hkv_bf16_to_f32(x1[c]) + wt[2 * C + c] * hkv_bf16_to_f32(x2[c])
                   + wt[3 * C + c] * hkv_bf16_to_f32(x3[c]);
    } else {
        const float *x3 = (const float *)s->x + (s->first + i) * st;
        const float *x0 = x3 - 3 * st, *x1 = x3 - 2 * st, *x2 = x3 - st;
#pragma omp simd
        for (int64_t c = 0; c < C; c++)
            y[c] = (bias != NULL ? bias[c] : 0.0f) + wt[c] * x0[c] + wt[C + c] * x1[c]
                   + wt[2 * C + c] * x2[c] + wt[3 * C + c] * x3[c];
    }
}

#define HKV_CONV_DECODE_BLOCK 512 /* channels of a bfloat16 page widened at a time */
#define HKV_CONV_DECODE_MAX 5      /* d_conv up to which a decode step takes conv_decode */

/* conv_decode on float32 columns st [n][hl] of channels c0 .. c0 + n - 1; hl = d_conv - 1 is a
 * constant where this is inlined (its loops unrolled, so the channel loop vectorises). */
HKV_INLINE void conv_decode_cols(const int64_t hl, float *restrict st, int has,
                                 const struct conv_src *s, int64_t c0, int64_t n,
                                 const float *wt, const float *bias, float *restrict y) {
    const int64_t C = s->C;
    int bf16;
    const void *in = conv_row(s, 0, &bf16);
    const float *b = bias != NULL ? bias + c0 : NULL;
    const uint16_t *x16 = (const uint16_t *)in + c0;
    const float *x32 = (const float *)in + c0;
    /* tap j's weights for these channels (w[hl]: the new input's) */
    const float *w0 = wt + c0, *w1 = w0 + C, *w2 = w1 + C, *w3 = w2 + C, *wx = w0 + hl * C;
    if (!has)
        for (int64_t i = 0; i < hl * n; i++) st[i] = 0.0f;
#pragma omp simd
    for (int64_t c = 0; c < n; c++) {
        const float xv = bf16 ? hkv_bf16_to_f32(x16[c]) : x32[c];
        /* the columns as named scalars, all read before any is written (an array, or reads
           between the writes, vectorised 2-4x slower); the hl tests fold away */
        const float s0 = st[hl * c], s1 = hl > 1 ? st[hl * c + 1] : 0.0f;
        const float s2 = hl > 2 ? st[hl * c + 2] : 0.0f, s3 = hl > 3 ? st[hl * c + 3] : 0.0f;
        float acc = (b != NULL ? b[c] : 0.0f) + w0[c] * s0 + wx[c] * xv;
        if (hl > 1) acc += w1[c] * s1;
        if (hl > 2) acc += w2[c] * s2;
        if (hl > 3) acc += w3[c] * s3;
        y[c0 + c] = acc;
        if (hl > 1) st[hl * c] = s1;
        if (hl > 2) st[hl * c + 1] = s2;
        if (hl > 3) st[hl * c + 2] = s3;
        st[hl * c + hl - 1] = xv;
    }
}

/* conv_decode_cols for d_conv 4 (three columns), written out: GCC vectorised the generic form
 * 4-5x slower at three columns (64 decodes of 2048 channels: 54-67 vs 250-340 us). */
static inline void conv_decode3_cols(float *restrict st, int has, const struct conv_src *s,
                                    int64_t c0, int64_t n, const float *wt, const float *bias,
                                    float *restrict y) {
    const int64_t C = s->C;
    int bf16;
    const void *in = conv_row(s, 0, &bf16);
    const float *w0 = wt + c0, *w1 = w0 + C, *w2 = w1 + C, *w3 = w2 + C;
    const float *b = bias != NULL ? bias + c0 : NULL;
    const uint16_t *x16 = (const uint16_t *)in + c0;
    const float *x32 = (const float *)in + c0;
    if (!has)
        for (int64_t i = 0; i < 3 * n; i++) st[i] = 0.0f;
#pragma omp simd
    for (int64_t c = 0; c < n; c++) {
        const float xv = bf16 ? hkv_bf16_to_f32(x16[c]) : x32[c];
        const float s0 = st[3 * c], s1 = st[3 * c + 1], s2 = st[3 * c + 2];
        y[c0 + c] = (b != NULL ? b[c] : 0.0f) + w0[c] * s0 + w1[c] * s1 + w2[c] * s2
                    + w3[c] * xv;
        st[3 * c] = s1;
        st[3 * c + 1] = s2;
        st[3 * c + 2] = xv;
    }
}


/* conv_decode_cols with d_conv - 1 as a constant */
static void conv_decode_block(int64_t hl, float *st, int has, const struct conv_src *s,
                              int64_t c0, int64_t n, const float *wt, const float *bias,
                              float *y) {
    switch (hl) {
    case 1: conv_decode_cols(1, st, has, s, c0, n, wt, bias, y); break;
    case 2: conv_decode_cols(2, st, has, s, c0, n, wt, bias, y); break;
    case 3: conv_decode3_cols(st, has, s, c0, n, wt, bias, y); break;
    default: conv_decode_cols(4, st, has, s, c0, n, wt, bias, y); break;
    }
}

/* A decode step (one token, d_conv 2 .. HKV_CONV_DECODE_MAX; the page read and written once):
 * per channel c the page holds the last hl = d_conv - 1 inputs s_0 .. s_{hl-1} (oldest first);
 * y = b + sum_j w_j s_j + w_hl x, and the page becomes s_1 .. s_{hl-1} x. Without an initial
 * state the s are zeros (page not read). A bfloat16 page is widened a block of channels at a
 * time (contiguous, so both conversions vectorise), updated as float32 and rounded back. */
static void conv_decode(void *state, int state_bf16, int64_t page, int has,
                        const struct conv_src *s, const float *wt, const float *bias,
                        float *restrict y) {
    const int64_t C = s->C, hl = s->hist_len;
    if (!state_bf16) {
        conv_decode_block(hl, (float *)state + page, has, s, 0, C, wt, bias, y);
        return;
    }
    float buf[(HKV_CONV_DECODE_MAX - 1) * HKV_CONV_DECODE_BLOCK];
    for (int64_t c0 = 0; c0 < C; c0 += HKV_CONV_DECODE_BLOCK) {
        const int64_t n = C - c0 < HKV_CONV_DECODE_BLOCK ? C - c0 : HKV_CONV_DECODE_BLOCK;
        uint16_t *st = (uint16_t *)state + page + hl * c0;
        if (has) load_floats(st, 1, 0, hl * n, buf);
        conv_decode_block(hl, buf, has, s, c0, n, wt, bias, y);
#pragma omp simd
        for (int64_t i = 0; i < hl * n; i++) st[i] = hkv_f32_to_bf16(buf[i]);
    }
}

/* A request's K - 1 inputs before its first token as rows [hist_len][C] (zeros without an
 * initial state: the page is not read), from its channel-major page [C][hist_len]. */
static void conv_history(const void *state, int state_bf16, int64_t page, int has,
                         int64_t C, int64_t hist_len, float *hist) {
    if (!has) {
        memset(hist, 0, sizeof(float) * (size_t)(hist_len * C));
        return;
    }
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < hist_len; j++) {
            const int64_t at = page + c * hist_len + j;
            hist[j * C + c] = state_bf16 ? hkv_bf16_to_f32(((const uint16_t *)state)[at])
                                         : ((const float *)state)[at];
        }
}

/* An output row through silu (act_silu) and rounded to bfloat16 values (round_bf16: the
 * bfloat16 model's value, kept as float32 for the scan). */
static inline void conv_finish(float *yt, int64_t C, int act_silu, int round_bf16) {
    if (act_silu) silu_row(yt, yt, C);
    if (round_bf16)
#pragma omp simd
        for (int64_t c = 0; c < C; c++) yt[c] = hkv_bf16_to_f32(hkv_f32_to_bf16(yt[c]));
}

/* Rows a .. b - 1 of one request's output (one task). */
static void conv_task(const struct conv_src *s, int64_t K, int64_t a, int64_t b,
                      const float *wt, const float *bias, int act_silu, int round_bf16,
                      float *y) {
    const int64_t C = s->C;
    for (int64_t i = a; i < b; i++) {
        float *yt = y + (s->first + i) * C;
        if (K == 4 && i >= 3) {
            conv_row4(yt, wt, bias, s, i);
        } else {
            for (int64_t c = 0; c < C; c++) yt[c] = bias != NULL ? bias[c] : 0.0f;
            for (int64_t j = 0; j < K; j++) { /* tap j reads input i - (K - 1) + j */
                int bf16;
                const void *in = conv_row(s, i - (K - 1) + j, &bf16);
                conv_tap(yt, wt + j * C, in, bf16, C);
            }
        }
        conv_finish(yt, C, act_silu, round_bf16);
    }
}

/* The request's page after its len tokens: its last K - 1 inputs, channel-major (old columns
 * shifted in when len < K - 1: column j takes old column j + len, read before it is
 * overwritten as j ascends). */
static void conv_new_state(void *state, int state_bf16, int64_t page, const struct conv_src *s,
                           int64_t len) {
    const int64_t C = s->C, hist_len = s->hist_len;
    for (int64_t j = 0; j < hist_len; j++) {
        int bf16;
        const void *in = conv_row(s, len - hist_len + j, &bf16);
        for (int64_t c = 0; c < C; c++) {
            const float v =
                bf16 ? hkv_bf16_to_f32(((const uint16_t *)in)[c]) : ((const float *)in)[c];
            const int64_t at = page + c * hist_len + j;
            if (state_bf16)
                ((uint16_t *)state)[at] = hkv_f32_to_bf16(v);
            else
                ((float *)state)[at] = v;
        }
    }
}

/* Causal conv1d of R packed requests (any number of tokens each: prefill chunks and
 * decode steps alike), state in place.
 *
 * Request r owns tokens starts[r] .. starts[r] + lens[r] - 1; x row t at x + t * x_stride,
 * float32 or (x_bf16) bfloat16; wt: the weight transposed, [K, C]; bias: [C] or NULL; y: [T, C]
 * float32, through silu when act_silu (else no activation), rounded to bfloat16 values when
 * round_bf16 (what a bf16 model's conv gives, without a bf16 tensor to widen again).
 * A request without an initial state (has_initial[r] == 0) starts from zero columns (its page is
 * never read: it may hold NaN bit patterns). After its tokens, its page holds its last K - 1
 * inputs (old columns shifted in when it had fewer than K - 1 tokens); lens[r] == 0 leaves the
 * page untouched. The state is float32 or (state_bf16) bfloat16; the math is float32.
 *
 * Tasks are (request, run of HKV_CONV_TOKENS tokens) over whole rows: x and y are read and
 * written in order. (Tasks of 64 channels walking all of a request's tokens read 256 bytes per
 * row at the row stride: every access a new page and the same few L1 sets, 5-8x slower on a
 * 2048-token chunk.) The histories are gathered from the pages first, the outputs computed in
 * parallel, then the pages written, so no task reads a page another has written.
 * Speculative decoding keeps the state after every position (pos_state non-NULL): a request
 * with pos_rows[r] >= 0 and its tokens i = 0 .. lens[r] - 2 get the page the state would be
 * after token i (its last K - 1 inputs up to i) written, in the state's dtype, at
 *     pos_state + pos_rows[r] * pos_row_stride + i * pos_stride                 (elements)
 * Returns 0, or -1 when the history buffer could not be allocated (nothing written then).
 */
int hkv_conv1d(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                   const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                   int64_t R, int64_t C, int64_t K, const void *x, int64_t x_stride, int x_bf16,
                   const float *wt, const float *bias, int act_silu, int round_bf16, float *y,
                   void *pos_state, const int64_t *pos_rows, int64_t pos_row_stride,
                   int64_t pos_stride) {
    const int64_t hist_len = K - 1;
    int64_t tokens = 0, tasks = 0;
    for (int64_t r = 0; r < R; r++) {
        tokens += lens[r];
        tasks += (lens[r] + HKV_CONV_TOKENS - 1) / HKV_CONV_TOKENS;
    }
    float *hist = malloc(sizeof(float) * (size_t)(R * hist_len * C + 1));
    int64_t *task_at = malloc(sizeof(int64_t) * (size_t)(2 * tasks + 1));
    if (hist == NULL || task_at == NULL) {
        free(hist);
        free(task_at);
        return -1;
    }
    for (int64_t r = 0, n = 0; r < R; r++) /* task n: request task_at[2n], first row [2n+1] */
        for (int64_t a = 0; a < lens[r]; a += HKV_CONV_TOKENS, n++) {
            task_at[2 * n] = r;
            task_at[2 * n + 1] = a;
        }
    const int parallel = tokens * C * K >= HKV_PARALLEL_MIN;
    /* one-token requests take conv_decode (output and page in one pass) */
    const int decode = K >= 2 && K <= HKV_CONV_DECODE_MAX;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            if (lens[r] > 0 && !(decode && lens[r] == 1))
                conv_history(state, state_bf16, pages[r] * page_stride, has_initial[r], C,
                             hist_len, hist + r * hist_len * C);
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < tasks; n++) {
            const int64_t r = task_at[2 * n], a = task_at[2 * n + 1];
            const int64_t b = a + HKV_CONV_TOKENS < lens[r] ? a + HKV_CONV_TOKENS : lens[r];
            const struct conv_src s = {x, x_stride, x_bf16, hist + r * hist_len * C,
                                       hist_len, C, starts[r]};
            if (decode && lens[r] == 1) { /* the output, then the page, in one pass */
                conv_decode(state, state_bf16, pages[r] * page_stride, has_initial[r], &s, wt,
                            bias, y + starts[r] * C);
                conv_finish(y + starts[r] * C, C, act_silu, round_bf16);
            } else {
                conv_task(&s, K, a, b, wt, bias, act_silu, round_bf16, y);
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (lens[r] == 0 || (decode && lens[r] == 1)) continue; /* written above */
            const struct conv_src s = {x, x_stride, x_bf16, hist + r * hist_len * C,
                                       hist_len, C, starts[r]};
            conv_new_state(state, state_bf16, pages[r] * page_stride, &s, lens[r]);
            const int64_t row = pos_state != NULL ? pos_rows[r] : -1;
            for (int64_t i = 0; row >= 0 && i + 1 < lens[r]; i++)
                conv_new_state(pos_state, state_bf16, row * pos_row_stride + i * pos_stride, &s,
                               i + 1);
        }
    }
    free(hist);
    free(task_at);
    return 0;
}

#pragma GCC pop_options

/* ---- The gated delta rule (Qwen3-Next, Qwen3.5 linear attention), state in place.
 *
 * Per request and value head h, with S: [K, V] the head's state in its page, q_t and k_t
 * L2-normalised (q_t also times 1/sqrt(K)) and decay_t = exp(g_t):
 *
 *     pred_t = decay_t * S_{t-1}^T k_t                         [V]  what S predicts for k_t
 *     S_t    = decay_t * S_{t-1} + k_t (outer) beta_t * (v_t - pred_t)
 *     o_t    = S_t^T q_t                                       [V]
 *
 * Column j of S only ever reads column j (and the token's q, k, v_t[j], g, beta), so the kernel
 * runs a block of columns (HKV_GDN_VECS vectors of HKV_LANES) through all of a request's tokens
 * while the block, [K, 64] floats with AVX-512, stays in L1. One sweep over the block's K rows
 * per token updates each row (a multiply and an FMA), accumulates o_t from it and already the
 * next token's prediction S_t^T k_{t+1} (an FMA each; a separate prediction pass would read the
 * block twice); a request's first token needs one more, read-only sweep for its prediction (none
 * without an initial state: S starts at zero). Keeping the decays out of the sweep (the block
 * holding S / c, rescaled now and then: three FMAs instead of a multiply and three) measured
 * slower, 9.2 against 8.3 ms on a prefill chunk, and was dropped.
 *
 * q, k: [T, Hk, K] and v: [T, Hv, V], float32 or bfloat16 (all three alike), token rows at a
 * stride (the heads of a token contiguous); g, beta: [T, Hv] float32; o: [T, Hv, V] float32.
 * Value head h reads key head h / (Hv / Hk). The state is float32 or bfloat16; the math is
 * float32 throughout. This section lets GCC contract a * b + c into FMAs (-std=c11 turns that
 * off for the file): 1.13x on a prefill chunk (9.4 -> 8.3 ms).
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#if HKV_AVX512
#define HKV_GDN_VECS 4 /* vectors per column block: 4 rows, 4 + 4 sums, 4 deltas in registers */
#else
#define HKV_GDN_VECS 2 /* the same in 10 of AVX2's 16 registers */
#endif
#define HKV_GDN_EPS 1e-6f            /* of the L2 norm, as transformers' l2norm */
#define HKV_GDN_MIN_LOG_DECAY -80.0f /* as ops.mamba2._MIN_LOG_DECAY: no denormal decays */
#define HKV_GDN_AHEAD 4 /* tokens ahead whose rows are prefetched */

/* Elements i .. i + n - 1 (1 <= n <= HKV_LANES) of such an array in a vector, zeros after. */
static inline hkv_vf load_lanes(const void *x, int bf16, int64_t i, int64_t n) {
    if (!bf16 && n == HKV_LANES) return loadv((const float *)x + i);
    float tmp[HKV_LANES] = {0.0f};
    load_floats(x, bf16, i, n, tmp);
    return loadv(tmp);
}

/* The first n lanes of v to y. */
static inline void store_lanes(float *y, hkv_vf v, int64_t n) {
    if (n == HKV_LANES) {
        storev(y, v);
        return;
    }
    float tmp[HKV_LANES];
    storev(tmp, v);
    memcpy(y, tmp, sizeof(float) * (size_t)n);
}

/* What every (request, head) task reads, in one place. */
struct gdn_inputs {
    const void *q, *k, *v;                /* q, k: [T, Hk, K]; v: [T, Hv, V] */
    int64_t q_stride, k_stride, v_stride; /* elements between consecutive tokens */
    int bf16;                             /* q, k, v in bfloat16 (else float32) */
    const float *g, *beta;                /* [T, Hv] */
    float *o;                             /* [T, Hv, V] */
    int64_t Hk, Hv, K, V;
};

/* x / sqrt(|x|^2 + eps) * scale of one [n] row (float32 or bfloat16) into out. */
static inline void l2_normalise(const void *x, int bf16, int64_t i, int64_t n, float scale,
                                float *out) {
    if (bf16)
        load_floats(x, bf16, i, n, out);
    const float *src = bf16 ? out : (const float *)x + i; /* float32 rows: read in place */
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t l = 0; l < n; l++) sq += src[l] * src[l];
    const float inv = 1.0f / sqrtf(sq + HKV_GDN_EPS) * scale;
#pragma omp simd
    for (int64_t l = 0; l < n; l++) out[l] = src[l] * inv;
}

/* n elements from element i of x into the cache, for reading (o: for writing) soon. */
static inline void prefetch_row(const void *x, int64_t elem, int64_t i, int64_t n, int write) {
    const char *first = (const char *)x + i * elem, *end = first + n * elem;
    for (const char *line = first; line < end; line += 64) {
        if (write)
            __builtin_prefetch(line, 1);
        else
            __builtin_prefetch(line, 0);
    }
}

/* Prefetch token t's rows of value head h (and its key head kh): a token's rows of one head
 * are a whole token apart (kilobytes, often another page), beyond what the hardware prefetcher
 * follows, and the sweep between two tokens is too long for the core to run ahead to the next
 * load by itself: without this, waiting for v took a third of a prefill's time. */
static inline void gdn_prefetch(const struct gdn_inputs *in, int64_t t, int64_t h, int64_t kh) {
    const int64_t elem = in->bf16 ? 2 : 4, K = in->K, V = in->V;
    prefetch_row(in->q, elem, t * in->q_stride + kh * K, K, 0);
    prefetch_row(in->k, elem, t * in->k_stride + kh * K, K, 0);
    prefetch_row(in->v, elem, t * in->v_stride + h * V, V, 0);
    prefetch_row(in->o, 4, (t * in->Hv + h) * V, V, 1);
}

/* Token t of key head kh: qn = q / |q| / sqrt(K), kn = k / |k| ([K] each, float32). */
static void gdn_normalise(const struct gdn_inputs *in, int64_t t, int64_t kh, float *qn,
                          float *kn) {
    const int64_t K = in->K;
    l2_normalise(in->q, in->bf16, t * in->q_stride + kh * K, K, 1.0f / sqrtf((float)K), qn);
    l2_normalise(in->k, in->bf16, t * in->k_stride + kh * K, K, 1.0f, kn);
}

/* p[j] = S^T kn over the block's nv vectors (rows at S + k * ld): two sets of sums, as one
 * sum is a chain of K dependent FMAs. */
HKV_INLINE void gdn_predict(const int nv, const float *S, int64_t ld, int64_t K,
                            const float *kn, hkv_vf *p) {
    hkv_vf a[HKV_GDN_VECS], b[HKV_GDN_VECS];
    for (int j = 0; j < nv; j++) a[j] = b[j] = (hkv_vf){0.0f};
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        const float *r0 = S + k * ld, *r1 = r0 + ld;
        for (int j = 0; j < nv; j++) {
            a[j] += loadv(r0 + j * HKV_LANES) * kn[k];
            b[j] += loadv(r1 + j * HKV_LANES) * kn[k + 1];
        }
    }
    for (; k < K; k++)
        for (int j = 0; j < nv; j++) a[j] += loadv(S + k * ld + j * HKV_LANES) * kn[k];
    for (int j = 0; j < nv; j++) p[j] = a[j] + b[j];
}

/* One token's sweep over the block's K rows (rows at S + k * ld), nv vectors wide:
 *     row = decay * row + kn[k] * delta        o += row * qn[k]
 *     predict: p += row * kn_next[k]           (else p is left alone)
 * o and p start at zero. `predict` is a constant where it is inlined. */
HKV_INLINE void gdn_sweep(const int nv, const int predict, float *S, int64_t ld, int64_t K,
                          float decay, const hkv_vf *delta,
                          const float *qn, const float *kn, const float *kn_next, hkv_vf *o,
                          hkv_vf *p) {
    for (int j = 0; j < nv; j++) o[j] = p[j] = (hkv_vf){0.0f};
    for (int64_t k = 0; k < K; k++) {
        float *row = S + k * ld;
        /* read once: the stores to row might alias them as far as the compiler knows */
        const float kk = kn[k], qk = qn[k], nk = predict ? kn_next[k] : 0.0f;
        for (int j = 0; j < nv; j++) {
            hkv_vf s = loadv(row + j * HKV_LANES);
            s = s * decay + delta[j] * kk;
            storev(row + j * HKV_LANES, s);
            o[j] += s * qk;
            if (predict) p[j] += s * nk;
        }
    }
}

/* Columns v0 .. v0 + nv * HKV_LANES - 1 of S (rows at S + k * ld, float32) through tokens
 * tok0 .. tok0 + len - 1 of value head h. S holds zeros in columns V and beyond, and v reads
 * zeros there (so they stay zero); o gets columns below V only. work: 4 * K floats (the
 * normalised q and k of this token and the next). */
HKV_INLINE void gdn_block(const int nv, float *S, int64_t ld, int init, int64_t tok0,
                          int64_t len, int64_t h, int64_t v0, const struct gdn_inputs *in,
                          float *work) {
    const int64_t K = in->K, V = in->V, Hv = in->Hv, kh = h / (Hv / in->Hk);
    float *qn = work, *kn = work + K, *qn_next = work + 2 * K, *kn_next = work + 3 * K;
    hkv_vf p[HKV_GDN_VECS], delta[HKV_GDN_VECS], o[HKV_GDN_VECS];
    S += v0;
    for (int64_t i = 1; i < HKV_GDN_AHEAD && i < len; i++) gdn_prefetch(in, tok0 + i, h, kh);
    gdn_normalise(in, tok0, kh, qn, kn);
    if (init)
        gdn_predict(nv, S, ld, K, kn, p); /* p = S^T k_t, before token t's decay */
    else
        for (int j = 0; j < nv; j++) p[j] = (hkv_vf){0.0f};
    for (int64_t i = 0; i < len; i++) {
        const int64_t t = tok0 + i, th = t * Hv + h;
        if (i + HKV_GDN_AHEAD < len) gdn_prefetch(in, t + HKV_GDN_AHEAD, h, kh);
        const float log_decay = in->g[th];
        const float decay =
            expf(log_decay < HKV_GDN_MIN_LOG_DECAY ? HKV_GDN_MIN_LOG_DECAY : log_decay);
        const float beta = in->beta[th];
        const int64_t vrow = t * in->v_stride + h * V;
        for (int j = 0; j < nv; j++) { /* delta = beta * (v - decay * S^T k) */
            const int64_t col = v0 + j * HKV_LANES, n = V - col < HKV_LANES ? V - col : HKV_LANES;
            delta[j] = (load_lanes(in->v, in->bf16, vrow + col, n) - p[j] * decay) * beta;
        }
        if (i + 1 < len) {
            gdn_normalise(in, t + 1, kh, qn_next, kn_next);
            gdn_sweep(nv, 1, S, ld, K, decay, delta, qn, kn, kn_next, o, p);
        } else {
            gdn_sweep(nv, 0, S, ld, K, decay, delta, qn, kn, NULL, o, p);
        }
        float *ot = in->o + th * V;
        for (int j = 0; j < nv; j++) {
            const int64_t col = v0 + j * HKV_LANES, n = V - col < HKV_LANES ? V - col : HKV_LANES;
            store_lanes(ot + col, o[j], n);
        }
        float *swap = qn;
        qn = qn_next, qn_next = swap;
        swap = kn;
        kn = kn_next, kn_next = swap;
    }
}

/* One (request, value head): its K x V state from the page head (float32 or bfloat16, never
 * read without an initial state), through the span, back to the page. A float32 state whose V
 * is a multiple of HKV_LANES is worked on in its page; otherwise in a float32 copy with V
 * padded to Vp: work[0 .. K * Vp), 64-byte aligned; the normalised q and k after it. */
static void gdn_head(void *page_head, int state_bf16, int init, int64_t tok0, int64_t len,
                     int64_t h, const struct gdn_inputs *in, float *work) {
    const int64_t K = in->K, V = in->V;
    const int64_t Vp = (V + HKV_LANES - 1) / HKV_LANES * HKV_LANES;
    const int in_page = !state_bf16 && Vp == V;
    float *S = in_page ? (float *)page_head : work, *vecs = work + K * Vp;
    if (in_page && !init) {
        memset(S, 0, sizeof(float) * (size_t)(K * V));
    } else if (!in_page) {
        for (int64_t k = 0; k < K; k++) {
            float *row = S + k * Vp;
            if (init) load_floats(page_head, state_bf16, k * V, V, row);
            for (int64_t c = init ? V : 0; c < Vp; c++) row[c] = 0.0f;
        }
    }
    for (int64_t v0 = 0; v0 < Vp; v0 += HKV_GDN_VECS * HKV_LANES) {
        const int64_t left = (Vp - v0) / HKV_LANES;
        switch (left < HKV_GDN_VECS ? left : HKV_GDN_VECS) { /* constant nv: unrolled */
        case 1: gdn_block(1, S, Vp, init, tok0, len, h, v0, in, vecs); break;
#if HKV_GDN_VECS >= 4
        case 2: gdn_block(2, S, Vp, init, tok0, len, h, v0, in, vecs); break;
        case 3: gdn_block(3, S, Vp, init, tok0, len, h, v0, in, vecs); break;
#endif
        default: gdn_block(HKV_GDN_VECS, S, Vp, init, tok0, len, h, v0, in, vecs); break;
        }
    }
    if (in_page) return;
    for (int64_t k = 0; k < K; k++) {
        const float *row = S + k * Vp;
        if (state_bf16) {
            uint16_t *dst = (uint16_t *)page_head + k * V;
            for (int64_t c = 0; c < V; c++) dst[c] = hkv_f32_to_bf16(row[c]);
        } else {
            memcpy((float *)page_head + k * V, row, sizeof(float) * (size_t)V);
        }
    }
}

/* The gated delta rule of R packed requests, each state read and written once, in its page.
 *
 *   state page p: state + p * page_stride elements (float32, or bfloat16 when state_bf16),
 *   holding S[Hv][K][V]
 *
 * Request r owns tokens starts[r] .. starts[r] + lens[r] - 1 (prefill chunks and one-token
 * decode steps alike). A request without an initial state (has_initial[r] == 0) starts from
 * zeros: its page is overwritten, never read (it may hold NaN bit patterns). lens[r] == 0 leaves
 * the page untouched. One task per (request, value head); each thread allocates its work space
 * once (4 * K floats, and a K x Vp float32 copy of the state where it cannot work in the page).
 * Returns non-zero when that allocation fails (o and the states are then incomplete): a status,
 * not a flag in memory, so that a captured step's replay checks it without reading a tensor.
 *
 * Speculative decoding keeps the state after every position (pos_state non-NULL): a request
 * with pos_rows[r] >= 0 runs one token at a time (its state back in its page after each, as
 * decode steps leave it) and after each of its tokens i = 0 .. lens[r] - 2 its head's state is
 * copied, in the state's dtype, to
 *     pos_state + pos_rows[r] * pos_row_stride + i * pos_stride + h * K * V      (elements)
 */
int hkv_gated_delta_rule(void *state, int64_t page_stride, int state_bf16,
                         const int64_t *pages, const uint8_t *has_initial, const int64_t *starts,
                         const int64_t *lens, int64_t R, int64_t Hk, int64_t Hv, int64_t K,
                         int64_t V, const void *q, int64_t q_stride, const void *k,
                         int64_t k_stride, const void *v, int64_t v_stride,
                         int in_bf16, const float *g, const float *beta, float *o,
                         void *pos_state, const int64_t *pos_rows, int64_t pos_row_stride,
                         int64_t pos_stride) {
    const struct gdn_inputs in = {q, k, v, q_stride, k_stride, v_stride, in_bf16, g, beta, o,
                                  Hk, Hv, K, V};
    const int64_t Vp = (V + HKV_LANES - 1) / HKV_LANES * HKV_LANES;
    const size_t elem = state_bf16 ? 2 : 4;
    size_t bytes = sizeof(float) * (size_t)(K * Vp + 4 * K); /* a state copy, then q and k */
    bytes = (bytes + 63) / 64 * 64; /* aligned_alloc: a multiple of the alignment */
    int failed = 0;
#pragma omp parallel
    {
        float *work = aligned_alloc(64, bytes);
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            for (int64_t h = 0; h < Hv; h++) {
                if (lens[r] == 0 || work == NULL) continue;
                char *head = (char *)state + (pages[r] * page_stride + h * K * V) * elem;
                const int64_t row = pos_state != NULL ? pos_rows[r] : -1;
                if (row < 0) {
                    gdn_head(head, state_bf16, has_initial[r], starts[r], lens[r], h, &in, work);
                    continue;
                }
                char *kept = (char *)pos_state + (row * pos_row_stride + h * K * V) * elem;
                for (int64_t i = 0; i < lens[r]; i++) {
                    gdn_head(head, state_bf16, i > 0 || has_initial[r], starts[r] + i, 1, h, &in,
                             work);
                    if (i + 1 < lens[r])
                        memcpy(kept + i * pos_stride * elem, head, (size_t)(K * V) * elem);
                }
            }
        }
        free(work);
    }
    return failed;
}
#pragma GCC pop_options

/* ---- Row-wise element-wise kernels: one pass over memory where PyTorch makes four to six.
 * Rows are independent tasks; within a row, plain loops the compiler vectorises. */

/* RMSNorm of rows: out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps). x rows at x + r * x_stride,
 * out: [rows, cols] contiguous; w: [cols]. */
void hkv_rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                      int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < cols; c++) sq += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(sq / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = w[c] * (xr[c] * inv);
    }
}

/* Residual add, then RMSNorm: sum[r] = x[r] + mult * h[r]; out[r] = rms_norm(sum[r]).
 * x, h, sum, out: [rows, cols] contiguous (sum may be x itself). */
void hkv_add_rms_norm_f32(const float *x, const float *h, float mult, const float *w,
                          float *sum, float *out, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols, *hr = h + r * cols;
        float *sr = sum + r * cols, *o = out + r * cols;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < cols; c++) {
            const float v = xr[c] + hr[c] * mult;
            sr[c] = v;
            sq += v * v;
        }
        const float inv = 1.0f / sqrtf(sq / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = w[c] * (sr[c] * inv);
    }
}

/* SwiGLU's activation: out[r][i] = hkv_silu(gate[r][i]) * up[r][i]; gate and up rows at their
 * row strides (one fused [gate | up] projection: up = gate + I), out: [rows, I]. */
void hkv_silu_mul_f32(const float *gate, int64_t g_stride, const float *up, int64_t u_stride,
                      float *out, int64_t rows, int64_t I) {
#pragma omp parallel for schedule(static) if (rows * I >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * g_stride, *u = up + r * u_stride;
        float *o = out + r * I;
        int64_t i = 0;
#if HKV_AVX2_ONLY
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(hkv_silu8(_mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
#endif
#pragma omp simd
        for (int64_t j = i; j < I; j++) o[j] = hkv_silu(g[j]) * u[j];
    }
}

/* Rotary embedding over the first R of D channels of every head, the rest copied:
 *   out[i] = x[i] * cos[i] + r[i] * sin[i],  r = (-x[R/2 .. R), x[0 .. R/2))
 * x: [T, H, D] at x + t * tok_stride + h * head_stride (elements, channels contiguous);
 * cos, sin: [T, R]; out: [T, H, D] contiguous; all float32 (bf16 == 0) or all bfloat16. In
 * bfloat16 each product and the sum are rounded, as PyTorch computes the reference in bf16. */
void hkv_rope(const void *x, int64_t tok_stride, int64_t head_stride, const void *cos,
              const void *sin, void *out, int bf16, int64_t T, int64_t H, int64_t D,
              int64_t R) {
    const int64_t half = R / 2;
#pragma omp parallel for schedule(static) if (T * H * D >= HKV_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t src = t * tok_stride + h * head_stride, dst = (t * H + h) * D;
            if (!bf16) {
                const float *xs = (const float *)x + src, *c = (const float *)cos + t * R;
                const float *sn = (const float *)sin + t * R;
                float *o = (float *)out + dst;
                for (int64_t i = 0; i < R; i++) {
                    const float r = i < half ? -xs[i + half] : xs[i - half];
                    const float a = xs[i] * c[i], b = r * sn[i];
                    o[i] = a + b;
                }
                for (int64_t i = R; i < D; i++) o[i] = xs[i];
                continue;
            }
            const uint16_t *xs = (const uint16_t *)x + src, *c = (const uint16_t *)cos + t * R;
            const uint16_t *sn = (const uint16_t *)sin + t * R;
            uint16_t *o = (uint16_t *)out + dst;
            for (int64_t i = 0; i < R; i++) {
                const float xv = hkv_bf16_to_f32(xs[i]);
                const float r =
                    i < half ? -hkv_bf16_to_f32(xs[i + half]) : hkv_bf16_to_f32(xs[i - half]);
                const float a = hkv_bf16_to_f32(hkv_f32_to_bf16(xv * hkv_bf16_to_f32(c[i])));
                const float b = hkv_bf16_to_f32(hkv_f32_to_bf16(r * hkv_bf16_to_f32(sn[i])));
                o[i] = hkv_f32_to_bf16(a + b);
            }
            for (int64_t i = R; i < D; i++) o[i] = xs[i];
        }
    }
}

/* Gated, grouped RMSNorm of a Mamba2 mixer output, per row and per group of `group` channels:
 *   gate first (default):  out = w * normalise(x * hkv_silu(z))
 *   norm first (Falcon-H1): out = w * normalise(x) * hkv_silu(z)
 * x: [rows, C] contiguous; z rows at z + r * z_stride; w: [C]; out: [rows, C]. */
void hkv_gated_rms_norm_f32(const float *x, const float *z, int64_t z_stride, const float *w,
                            float *out, int64_t rows, int64_t C, int64_t group, float eps,
                            int norm_before_gate) {
#pragma omp parallel for schedule(static) if (rows * C >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g0 = 0; g0 < C; g0 += group) {
            const float *xr = x + r * C + g0, *zr = z + r * z_stride + g0, *wr = w + g0;
            float *o = out + r * C + g0;
            float sq = 0.0f;
#if HKV_AVX2_ONLY /* o = silu(z) first (o * x when gating first), then the sums */
            silu_row(zr, o, group);
            if (!norm_before_gate)
#pragma omp simd
                for (int64_t c = 0; c < group; c++) o[c] = xr[c] * o[c];
            const float *sqr = norm_before_gate ? xr : o;
#pragma omp simd reduction(+ : sq)
            for (int64_t c = 0; c < group; c++) sq += sqr[c] * sqr[c];
#else
#pragma omp simd reduction(+ : sq)
            for (int64_t c = 0; c < group; c++) {
                const float v = norm_before_gate ? xr[c] : xr[c] * hkv_silu(zr[c]);
                o[c] = v;
                sq += v * v;
            }
#endif
            const float inv = 1.0f / sqrtf(sq / (float)group + eps);
            if (norm_before_gate) {
#if HKV_AVX2_ONLY /* (o holds silu(z)) */
#pragma omp simd
                for (int64_t c = 0; c < group; c++) o[c] = wr[c] * (xr[c] * inv) * o[c];
#else
#pragma omp simd
                for (int64_t c = 0; c < group; c++) o[c] = wr[c] * (o[c] * inv) * hkv_silu(zr[c]);
#endif
            } else {
#pragma omp simd
                for (int64_t c = 0; c < group; c++) o[c] = wr[c] * (o[c] * inv);
            }
        }
    }
}

/* ---- The same row kernels on bfloat16 tensors: float32 math, rounded to bfloat16 where
 * PyTorch's reference (hybridkv/ops/norm.py, layers/mlp.py) rounds, so a bfloat16 model gives
 * the numbers it gives in PyTorch up to the float32 summation order:
 *   weighted (w_fp32 == 0): out = bf16(w * bf16(x_hat))   (Llama order: cast, then weight)
 *   weighted (w_fp32 == 1): out = bf16(w * x_hat)         (NemotronH, Falcon-H1)
 * x_hat = x / sqrt(mean(x^2) + eps) in float32. Weights come as float32 (a bfloat16 weight
 * widened exactly, or a float32 one such as Qwen3-Next's 1 + weight), so either kind is exact. */

static inline uint16_t hkv_weigh(float w, float x_hat, int w_fp32) {
    return hkv_f32_to_bf16(w * (w_fp32 ? x_hat : hkv_bf16_to_f32(hkv_f32_to_bf16(x_hat))));
}

/* One row: out = weighted normalise(v), v: [cols] float32. */
static inline void hkv_norm_row_bf16(const float *v, const float *w, uint16_t *o,
                                     int64_t cols, float eps, int w_fp32) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < cols; c++) sq += v[c] * v[c];
    const float inv = 1.0f / sqrtf(sq / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++) o[c] = hkv_weigh(w[c], v[c] * inv, w_fp32);
}

#define HKV_ROW_STACK 8192 /* float32 row buffer on the stack; wider rows use the heap */

/* RMSNorm of bfloat16 rows: x rows at x + r * x_stride, out: [rows, cols] contiguous. */
void hkv_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const float *w, uint16_t *out,
                       int64_t rows, int64_t cols, float eps, int w_fp32) {
#pragma omp parallel for schedule(static) if (rows * cols >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float stack[HKV_ROW_STACK];
        float *v = cols <= HKV_ROW_STACK ? stack : malloc(sizeof(float) * (size_t)cols);
        if (v == NULL) continue;
        load_floats(x, 1, r * x_stride, cols, v);
        hkv_norm_row_bf16(v, w, out + r * cols, cols, eps, w_fp32);
        if (v != stack) free(v);
    }
}

/* Residual add, then RMSNorm, on bfloat16 rows: sum = bf16(x + bf16(mult * h)) (no inner
 * rounding when mult == 1, as PyTorch skips the multiply), out = rms_norm(sum). x, h, sum, out:
 * [rows, cols] contiguous (sum may be x itself). */
void hkv_add_rms_norm_bf16(const uint16_t *x, const uint16_t *h, float mult, const float *w,
                           uint16_t *sum, uint16_t *out, int64_t rows, int64_t cols, float eps,
                           int w_fp32) {
#pragma omp parallel for schedule(static) if (rows * cols >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float stack[HKV_ROW_STACK];
        float *v = cols <= HKV_ROW_STACK ? stack : malloc(sizeof(float) * (size_t)cols);
        if (v == NULL) continue;
        const uint16_t *xr = x + r * cols, *hr = h + r * cols;
        uint16_t *sr = sum + r * cols;
        for (int64_t c = 0; c < cols; c++) {
            float hv = hkv_bf16_to_f32(hr[c]);
            if (mult != 1.0f) hv = hkv_bf16_to_f32(hkv_f32_to_bf16(hv * mult));
            sr[c] = hkv_f32_to_bf16(hkv_bf16_to_f32(xr[c]) + hv);
            v[c] = hkv_bf16_to_f32(sr[c]);
        }
        hkv_norm_row_bf16(v, w, out + r * cols, cols, eps, w_fp32);
        if (v != stack) free(v);
    }
}

/* SwiGLU's activation on bfloat16 rows: out = bf16(bf16(hkv_silu(gate)) * up). */
void hkv_silu_mul_bf16(const uint16_t *gate, int64_t g_stride, const uint16_t *up,
                       int64_t u_stride, uint16_t *out, int64_t rows, int64_t I) {
#pragma omp parallel for schedule(static) if (rows * I >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * g_stride, *u = up + r * u_stride;
        uint16_t *o = out + r * I;
        int64_t i = 0;
#if HKV_AVX2_ONLY
        for (; i + 8 <= I; i += 8) {
            const __m256 a = hkv_round8_bf16(hkv_silu8(hkv_bf16x8_load(g + i)));
            _mm_storeu_si128((__m128i *)(o + i),
                             hkv_f32x8_to_bf16(_mm256_mul_ps(a, hkv_bf16x8_load(u + i))));
        }
#endif
        for (; i < I; i++) {
            const float a = hkv_bf16_to_f32(hkv_f32_to_bf16(hkv_silu(hkv_bf16_to_f32(g[i]))));
            o[i] = hkv_f32_to_bf16(a * hkv_bf16_to_f32(u[i]));
        }
    }
}

/* The gated, grouped RMSNorm with x, the gate z and out each float32 or bfloat16 (x_bf16,
 * z_bf16, out_bf16); w: [C] float32. The gate's silu and the products stay float32, and the
 * result is rounded where PyTorch's reference (ops/norm.py), which computes in x's dtype, then
 * casts to out's, rounds:
 *   gate first:  out = weighted normalise(x * hkv_silu(z))   (the Llama-order bf16(x_hat) only for
 *                                                          bfloat16 x without w_fp32)
 *   norm first:  out = w * normalise(x) * hkv_silu(z)        (Falcon-H1; w_fp32 is implied)
 * A float32 x (a Mamba2 scan's output) with a bfloat16 gate and out is the mixer's norm and
 * its cast to the model dtype in one pass. A bfloat16 x with a float32 out is rounded to
 * bfloat16 all the same (the reference's result in x's dtype), then widened. x: [rows, C]
 * contiguous; z rows at z + r * z_stride (elements); out: [rows, C]. */
void hkv_gated_rms_norm_mixed(const void *x, int x_bf16, const void *z, int z_bf16,
                              int64_t z_stride, const float *w, void *out, int out_bf16,
                              int64_t rows, int64_t C, int64_t group, float eps,
                              int norm_before_gate, int w_fp32) {
    const int round_x_hat = x_bf16 && !w_fp32 && !norm_before_gate;
#pragma omp parallel for schedule(static) if (rows * C >= HKV_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float stack[2 * HKV_ROW_STACK];
        float *v = group <= HKV_ROW_STACK ? stack : malloc(sizeof(float) * 2 * (size_t)group);
        if (v == NULL) continue;
        float *gate = v + group; /* hkv_silu(z) of the group */
        for (int64_t g0 = 0; g0 < C; g0 += group) {
            load_floats(x, x_bf16, r * C + g0, group, v);
            load_floats(z, z_bf16, r * z_stride + g0, group, gate);
            float sq = 0.0f;
#if HKV_AVX2_ONLY
            silu_row(gate, gate, group);
            for (int64_t c = 0; c < group; c++) {
                if (!norm_before_gate) v[c] *= gate[c];
                sq += v[c] * v[c];
            }
#else
            for (int64_t c = 0; c < group; c++) {
                gate[c] = hkv_silu(gate[c]);
                if (!norm_before_gate) v[c] *= gate[c];
                sq += v[c] * v[c];
            }
#endif
            const float inv = 1.0f / sqrtf(sq / (float)group + eps);
            const float *wr = w + g0;
            for (int64_t c = 0; c < group; c++) {
                float x_hat = v[c] * inv;
                if (round_x_hat) x_hat = hkv_bf16_to_f32(hkv_f32_to_bf16(x_hat));
                const float o = norm_before_gate ? wr[c] * x_hat * gate[c] : wr[c] * x_hat;
                if (out_bf16)
                    ((uint16_t *)out)[r * C + g0 + c] = hkv_f32_to_bf16(o);
                else if (x_bf16) /* bfloat16 in x's dtype first, exactly widened */
                    ((float *)out)[r * C + g0 + c] = hkv_bf16_to_f32(hkv_f32_to_bf16(o));
                else
                    ((float *)out)[r * C + g0 + c] = o;
            }
        }
        if (v != stack) free(v);
    }
}

/* Greedy sampling: out[r] = the first index of row r's maximum (of its first NaN if it has one,
 * as torch.argmax). x rows at x + r * x_stride. One vectorised max pass, then a search for it:
 * 0.3 ms for 64 rows of 32000 against 0.9 to 1.8 ms for PyTorch's CPU argmax here. */
void hkv_argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols,
                    int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t c = 0; c < cols; c++) {
            best = xr[c] > best ? xr[c] : best;
            nan |= xr[c] != xr[c];
        }
        int64_t idx = 0;
        for (int64_t c = 0; c < cols; c++)
            if (nan ? xr[c] != xr[c] : xr[c] == best) {
                idx = c;
                break;
            }
        out[r] = idx;
    }
}

/* ---- The Mamba1 selective scan (Mamba, FalconMamba, Jamba), state in place.
 *
 * Per request and inner channel d, the state row h[d] of N numbers (page layout [Di][N]) goes
 * through the request's tokens with delta = softplus(dt_t[d] + dt_bias[d]):
 *
 *     h[d][n] = exp(delta * A[d][n]) * h[d][n] + delta * x_t[d] * B_t[n]
 *     y_t[d]  = (sum_n h[d][n] * C_t[n] + D[d] * x_t[d]) * hkv_silu(z_t[d])
 *
 * Unlike Mamba2 the decay differs for every (d, n), so the cost is one exp per state element
 * and token. One task per (request, block of HKV_M1_CHANNELS channels): the block's state is
 * copied out of its page transposed, st[n][l] (l: channel in the block, along a vector's
 * lanes; 4 KB for N = 16, in L1), goes through all of the request's tokens, and is written back
 * once; the per-token work is plain loops over the block's channels that GCC vectorises, with
 * the exp and softplus in polynomial arithmetic (hkv_exp_nonpositive; libm's calls do not
 * vectorise). x, dt, z: [T, Di] and B, C: [T, N] rows at a stride (float32, or all bfloat16);
 * the state float32 or bfloat16; the math float32 throughout.
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#define HKV_M1_CHANNELS 64 /* channels per task: four AVX-512 vectors, eight AVX2 ones */

/* softplus(v) = max(v, 0) + log1p(e^-|v|), log1p(e) = 2 atanh(e / (2 + e)) by its series to
 * s^11 (s <= 1/3: the first term left out is below 1e-7): relative error below 3e-7. */
static inline float softplus(float v) {
    const float e = hkv_exp_nonpositive(v < 0.0f ? v : -v);
    const float s = e / (2.0f + e), s2 = s * s;
    const float series =
        1.0f + s2 * (3.3333334e-1f + s2 * (2.0e-1f + s2 * (1.4285715e-1f
                     + s2 * (1.1111111e-1f + s2 * 9.0909094e-2f))));
    return (v > 0.0f ? v : 0.0f) + 2.0f * s * series;
}

#if HKV_AVX2_ONLY
/* softplus of 8 lanes (the same operations; GCC left the scalar loops over it, hkv_silu and
 * hkv_exp_nonpositive unvectorised for AVX2: one thread, a decode step of 64 requests at
 * d_inner 1536 took 13.0 ms against 2.3 with AVX-512; 2.2 ms with the 8-lane loops). */
static inline __m256 softplus8(__m256 v) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 neg = _mm256_cmp_ps(v, zero, _CMP_LT_OQ);
    const __m256 e = hkv_exp8_nonpositive(_mm256_blendv_ps(_mm256_xor_ps(v, HKV_C8(-0.0f)), v, neg));
    const __m256 s = _mm256_div_ps(e, _mm256_add_ps(HKV_C8(2.0f), e)), s2 = _mm256_mul_ps(s, s);
    __m256 series = _mm256_add_ps(HKV_C8(1.1111111e-1f), _mm256_mul_ps(s2, HKV_C8(9.0909094e-2f)));
    series = _mm256_add_ps(HKV_C8(1.4285715e-1f), _mm256_mul_ps(s2, series));
    series = _mm256_add_ps(HKV_C8(2.0e-1f), _mm256_mul_ps(s2, series));
    series = _mm256_add_ps(HKV_C8(3.3333334e-1f), _mm256_mul_ps(s2, series));
    series = _mm256_add_ps(HKV_C8(1.0f), _mm256_mul_ps(s2, series));
    const __m256 pos = _mm256_blendv_ps(zero, v, _mm256_cmp_ps(v, zero, _CMP_GT_OQ));
    return _mm256_add_ps(pos, _mm256_mul_ps(_mm256_mul_ps(HKV_C8(2.0f), s), series));
}
#endif

/* What every (request, channel block) task reads, in one place. */
struct m1_inputs {
    const void *x, *dt, *z, *B, *C;   /* x, dt, z: [T, Di]; B, C: [T, N]; z may be NULL */
    int64_t x_stride, dt_stride, z_stride, b_stride, c_stride; /* elements between tokens */
    int bf16;                         /* x, dt, z, B, C in bfloat16 (else float32) */
    const float *D, *dt_bias;          /* [Di] or NULL */
    float *y;                         /* [T, Di] */
    int64_t Di, N;
};

/* n (<= HKV_M1_CHANNELS) elements from element i of a float32 / bfloat16 array, zeros after. */
static inline void m1_load(const void *x, int bf16, int64_t i, int64_t n, float *out) {
    load_floats(x, bf16, i, n, out);
    for (int64_t l = n; l < HKV_M1_CHANNELS; l++) out[l] = 0.0f;
}

/* Tiles of HKV_LANES x HKV_LANES floats transposed in registers (the state's page layout
 * [channel][n] <-> the kernel's [n][channel]): log2(HKV_LANES) stages of two-source shuffles,
 * stage b exchanging bit b of the row and column index of every element where they differ
 * (64 shuffles for a 16 x 16 tile, where element-wise copies took 512 loads and stores and
 * were two thirds of a decode step). Needs __builtin_shufflevector (GCC 12, Clang); other
 * compilers copy element-wise. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HKV_M1_TILES 1
#define M1_LO(j, b) (((j) & (b)) ? HKV_LANES + (j) - (b) : (j))
#define M1_HI(j, b) (((j) & (b)) ? HKV_LANES + (j) : (j) + (b))
#if HKV_LANES == 16
#define M1_IDX(F, b)                                                                          \
    F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b), F(8, b), F(9, b), \
        F(10, b), F(11, b), F(12, b), F(13, b), F(14, b), F(15, b)
#else
#define M1_IDX(F, b) F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b)
#endif
#define M1_STAGE(r, b)                                                                        \
    for (int i = 0; i < HKV_LANES; i++) {                                                     \
        if (i & (b)) continue;                                                                \
        const hkv_vf lo = r[i], hi = r[i + (b)];                                              \
        r[i] = __builtin_shufflevector(lo, hi, M1_IDX(M1_LO, b));                             \
        r[i + (b)] = __builtin_shufflevector(lo, hi, M1_IDX(M1_HI, b));                       \
    }

static inline void m1_transpose_tile(hkv_vf *r) {
    M1_STAGE(r, 1)
    M1_STAGE(r, 2)
    M1_STAGE(r, 4)
#if HKV_LANES == 16
    M1_STAGE(r, 8)
#endif
}


/* v rounded to bfloat16 at p, as f32_to_bf16 (NaN -> 0x7fc0). */
static inline void m1_store_bf16(uint16_t *p, hkv_vf v) {
    const hkv_vu bits = (hkv_vu)v;
    const hkv_vu nan = (hkv_vu)((bits & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const hkv_vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    *(hkv_vh *)p = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), hkv_vh);
}
#else
#define HKV_M1_TILES 0
#endif

/* Whether the block goes through whole tiles: 64 channels and N a multiple of the lanes. */
static inline int m1_tiled(int64_t nc, int64_t N) {
    return HKV_M1_TILES && nc == HKV_M1_CHANNELS && N % HKV_LANES == 0;
}

/* The block's state from its page (init) or zeros, transposed: st[n][l]. Lanes past nc hold
 * zeros and are never written back. */
static void m1_state_in(const void *page, int state_bf16, int init, int64_t c0, int64_t nc,
                        int64_t N, float *restrict st) {
    if (!init || nc < HKV_M1_CHANNELS)
        for (int64_t i = 0; i < N * HKV_M1_CHANNELS; i++) st[i] = 0.0f;
    if (!init) return;
#if HKV_M1_TILES
    if (m1_tiled(nc, N)) {
        for (int64_t l0 = 0; l0 < HKV_M1_CHANNELS; l0 += HKV_LANES)
            for (int64_t n0 = 0; n0 < N; n0 += HKV_LANES) {
                hkv_vf r[HKV_LANES];
                for (int i = 0; i < HKV_LANES; i++) {
                    const int64_t at = (c0 + l0 + i) * N + n0; /* channel l0 + i, n0.. */
                    r[i] = state_bf16 ? m1_load_bf16((const uint16_t *)page + at)
                                      : loadv((const float *)page + at);
                }
                m1_transpose_tile(r);
                for (int k = 0; k < HKV_LANES; k++)
                    storev(st + (n0 + k) * HKV_M1_CHANNELS + l0, r[k]);
            }
        return;
    }
#endif
    if (state_bf16) {
        const uint16_t *src = (const uint16_t *)page + c0 * N;
        for (int64_t l = 0; l < nc; l++)
            for (int64_t n = 0; n < N; n++)
                st[n * HKV_M1_CHANNELS + l] = hkv_bf16_to_f32(src[l * N + n]);
    } else {
        const float *src = (const float *)page + c0 * N;
        for (int64_t l = 0; l < nc; l++)
            for (int64_t n = 0; n < N; n++) st[n * HKV_M1_CHANNELS + l] = src[l * N + n];
    }
}

static void m1_state_out(void *page, int state_bf16, int64_t c0, int64_t nc, int64_t N,
                         const float *restrict st) {
#if HKV_M1_TILES
    if (m1_tiled(nc, N)) {
        for (int64_t l0 = 0; l0 < HKV_M1_CHANNELS; l0 += HKV_LANES)
            for (int64_t n0 = 0; n0 < N; n0 += HKV_LANES) {
                hkv_vf r[HKV_LANES];
                for (int k = 0; k < HKV_LANES; k++)
                    r[k] = loadv(st + (n0 + k) * HKV_M1_CHANNELS + l0);
                m1_transpose_tile(r);
                for (int i = 0; i < HKV_LANES; i++) {
                    const int64_t at = (c0 + l0 + i) * N + n0;
                    if (state_bf16)
                        m1_store_bf16((uint16_t *)page + at, r[i]);
                    else
                        storev((float *)page + at, r[i]);
                }
            }
        return;
    }
#endif
    if (state_bf16) {
        uint16_t *dst = (uint16_t *)page + c0 * N;
        for (int64_t l = 0; l < nc; l++)
            for (int64_t n = 0; n < N; n++)
                dst[l * N + n] = hkv_f32_to_bf16(st[n * HKV_M1_CHANNELS + l]);
    } else {
        float *dst = (float *)page + c0 * N;
        for (int64_t l = 0; l < nc; l++)
            for (int64_t n = 0; n < N; n++) dst[l * N + n] = st[n * HKV_M1_CHANNELS + l];
    }
}

/* A [Di, N] transposed per block of channels: At[blk][n][l] = A[blk * CHANNELS + l][n], zeros
 * past Di (decay 1 in lanes that are never written back). */
static void m1_transpose_a(const float *A, int64_t Di, int64_t N, float *At) {
    const int64_t blocks = (Di + HKV_M1_CHANNELS - 1) / HKV_M1_CHANNELS;
    for (int64_t blk = 0; blk < blocks; blk++) {
        float *out = At + blk * N * HKV_M1_CHANNELS;
        for (int64_t n = 0; n < N; n++)
            for (int64_t l = 0; l < HKV_M1_CHANNELS; l++) {
                const int64_t d = blk * HKV_M1_CHANNELS + l;
                out[n * HKV_M1_CHANNELS + l] = d < Di ? A[d * N + n] : 0.0f;
            }
    }
}

/* One token through the block: st advanced in place, returns sum_n st[n][l] * C[n] in acc. */
static inline void m1_token(float *restrict st, const float *restrict At, int64_t N,
                            const float *restrict delta, const float *restrict dx,
                            const float *restrict b, const float *restrict c,
                            float *restrict acc) {
#if HKV_AVX2_ONLY /* the 8 vectors of sums in registers */
    __m256 sum[HKV_M1_CHANNELS / 8];
    for (int j = 0; j < HKV_M1_CHANNELS / 8; j++) sum[j] = _mm256_setzero_ps();
    for (int64_t n = 0; n < N; n++) {
        float *restrict row = st + n * HKV_M1_CHANNELS;
        const float *restrict a = At + n * HKV_M1_CHANNELS;
        const __m256 bn = _mm256_set1_ps(b[n]), cn = _mm256_set1_ps(c[n]);
#pragma GCC unroll 8
        for (int j = 0; j < HKV_M1_CHANNELS / 8; j++) {
            const __m256 decay = hkv_exp8_nonpositive(
                _mm256_mul_ps(_mm256_loadu_ps(delta + 8 * j), _mm256_load_ps(a + 8 * j)));
            const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(row + 8 * j), decay),
                                           _mm256_mul_ps(_mm256_loadu_ps(dx + 8 * j), bn));
            _mm256_store_ps(row + 8 * j, v);
            sum[j] = _mm256_add_ps(sum[j], _mm256_mul_ps(v, cn));
        }
    }
    for (int j = 0; j < HKV_M1_CHANNELS / 8; j++) _mm256_storeu_ps(acc + 8 * j, sum[j]);
    return;
#endif
    for (int64_t l = 0; l < HKV_M1_CHANNELS; l++) acc[l] = 0.0f;
    for (int64_t n = 0; n < N; n++) {
        float *restrict row = st + n * HKV_M1_CHANNELS;
        const float *restrict a = At + n * HKV_M1_CHANNELS;
        const float bn = b[n], cn = c[n];
#pragma omp simd
        for (int64_t l = 0; l < HKV_M1_CHANNELS; l++) {
            const float v = row[l] * hkv_exp_nonpositive(delta[l] * a[l]) + dx[l] * bn;
            row[l] = v;
            acc[l] += v * cn;
        }
    }
}

/* A row of nc (<= HKV_M1_CHANNELS) channels from element i: in place for a whole float32 block,
 * else converted (bfloat16) or zero-padded into buf. */
static inline const float *m1_row(const void *x, int bf16, int64_t i, int64_t nc, float *buf) {
    if (!bf16 && nc == HKV_M1_CHANNELS) return (const float *)x + i;
    m1_load(x, bf16, i, nc, buf);
    return buf;
}

/* Channels c0 .. c0 + nc - 1 of one request through tokens tok0 .. tok0 + len - 1. At: the
 * block's A, transposed; work: N * HKV_M1_CHANNELS + 2 * N floats (the transposed state, a
 * token's B and C). kept (NULL: none): a [Di][N] state like the page, kept_stride bytes apart,
 * for the state after each token but the last. */
static void m1_block(void *page, int state_bf16, int init, int64_t tok0, int64_t len,
                     int64_t c0, int64_t nc, const struct m1_inputs *in, const float *At,
                     float *work, char *kept, int64_t kept_stride) {
    const int64_t N = in->N, Di = in->Di;
    const int whole = nc == HKV_M1_CHANNELS;
    float *st = work, *bbuf = st + N * HKV_M1_CHANNELS;
    float *cbuf = bbuf + N;
    float bias[HKV_M1_CHANNELS] = {0.0f}, D[HKV_M1_CHANNELS] = {0.0f};
    float xbuf[HKV_M1_CHANNELS], zbuf[HKV_M1_CHANNELS], delta[HKV_M1_CHANNELS];
    float dx[HKV_M1_CHANNELS], part[HKV_M1_CHANNELS];
    for (int64_t l = 0; l < nc; l++) {
        if (in->dt_bias != NULL) bias[l] = in->dt_bias[c0 + l];
        if (in->D != NULL) D[l] = in->D[c0 + l];
    }
    m1_state_in(page, state_bf16, init, c0, nc, N, st);
    for (int64_t t = tok0; t < tok0 + len; t++) {
        const float *xs = m1_row(in->x, in->bf16, t * in->x_stride + c0, nc, xbuf);
        const float *dts = m1_row(in->dt, in->bf16, t * in->dt_stride + c0, nc, delta);
        const float *b = in->bf16 ? bbuf : (const float *)in->B + t * in->b_stride;
        const float *c = in->bf16 ? cbuf : (const float *)in->C + t * in->c_stride;
        if (in->bf16) {
            load_floats(in->B, 1, t * in->b_stride, N, bbuf);
            load_floats(in->C, 1, t * in->c_stride, N, cbuf);
        }
#if HKV_AVX2_ONLY
        for (int64_t l = 0; l < HKV_M1_CHANNELS; l += 8) {
            const __m256 d8 =
                softplus8(_mm256_add_ps(_mm256_loadu_ps(dts + l), _mm256_loadu_ps(bias + l)));
            _mm256_storeu_ps(delta + l, d8);
            _mm256_storeu_ps(dx + l, _mm256_mul_ps(d8, _mm256_loadu_ps(xs + l)));
        }
#else
#pragma omp simd
        for (int64_t l = 0; l < HKV_M1_CHANNELS; l++) {
            delta[l] = softplus(dts[l] + bias[l]);
            dx[l] = delta[l] * xs[l];
        }
#endif
        float *acc = whole ? in->y + t * Di + c0 : part; /* y's row in place when whole */
        m1_token(st, At, N, delta, dx, b, c, acc);
        if (in->z != NULL) {
            const float *zs = m1_row(in->z, in->bf16, t * in->z_stride + c0, nc, zbuf);
#if HKV_AVX2_ONLY
            for (int64_t l = 0; l < HKV_M1_CHANNELS; l += 8)
                _mm256_storeu_ps(zbuf + l, hkv_silu8(_mm256_loadu_ps(zs + l)));
            zs = zbuf;
#endif
#pragma omp simd
            for (int64_t l = 0; l < HKV_M1_CHANNELS; l++)
#if HKV_AVX2_ONLY
                acc[l] = (acc[l] + D[l] * xs[l]) * zs[l]; /* (zs: silu(z) already) */
#else
                acc[l] = (acc[l] + D[l] * xs[l]) * hkv_silu(zs[l]);
#endif
        } else {
#pragma omp simd
            for (int64_t l = 0; l < HKV_M1_CHANNELS; l++) acc[l] += D[l] * xs[l];
        }
        if (!whole) memcpy(in->y + t * Di + c0, acc, sizeof(float) * (size_t)nc);
        if (kept != NULL && t + 1 < tok0 + len)
            m1_state_out(kept + (t - tok0) * kept_stride, state_bf16, c0, nc, N, st);
    }
    m1_state_out(page, state_bf16, c0, nc, N, st);
}

/* The Mamba1 scan of R packed requests, each state read and written once, in its page.
 *
 *   state page p: state + p * page_stride elements (float32, or bfloat16 when state_bf16),
 *   holding h[Di][N]
 *
 * Request r owns tokens starts[r] .. starts[r] + lens[r] - 1 (prefill chunks and one-token
 * decode steps alike). A request without an initial state (has_initial[r] == 0) starts from
 * zeros: its page is overwritten, never read (it may hold NaN bit patterns). lens[r] == 0 leaves
 * the page untouched. One task per (request, channel block); each thread allocates its work
 * space once; the result is non-zero when that fails (y and the states are then incomplete).
 * Speculative decoding keeps the state after every position (pos_state non-NULL): a request
 * with pos_rows[r] >= 0 also writes its state, in the state's dtype, after each of its tokens
 * i = 0 .. lens[r] - 2, to pos_state + pos_rows[r] * pos_row_stride + i * pos_stride
 * (elements; [Di][N] as a page).
 */
int hkv_mamba1_scan(void *state, int64_t page_stride, int state_bf16, const int64_t *pages,
                     const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                     int64_t R, int64_t Di, int64_t N, const void *x, int64_t x_stride,
                     const void *dt, int64_t dt_stride, const void *z, int64_t z_stride,
                     const void *B, int64_t b_stride, const void *C, int64_t c_stride,
                     int in_bf16, const float *A, const float *D, const float *dt_bias, float *y,
                     void *pos_state, const int64_t *pos_rows, int64_t pos_row_stride,
                     int64_t pos_stride) {
    int failed = 0;
    const struct m1_inputs in = {x, dt, z, B, C, x_stride, dt_stride, z_stride, b_stride,
                                 c_stride, in_bf16, D, dt_bias, y, Di, N};
    const int64_t blocks = (Di + HKV_M1_CHANNELS - 1) / HKV_M1_CHANNELS;
    const size_t elem = state_bf16 ? 2 : 4;
    size_t bytes = sizeof(float) * (size_t)(N * HKV_M1_CHANNELS + 2 * N);
    bytes = (bytes + 63) / 64 * 64; /* aligned_alloc: a multiple of the alignment */
    const size_t a_bytes = sizeof(float) * (size_t)(blocks * N * HKV_M1_CHANNELS);
    float *At = aligned_alloc(64, (a_bytes + 63) / 64 * 64);
    if (At == NULL) return 1;
    m1_transpose_a(A, Di, N, At);
#pragma omp parallel
    {
        float *work = aligned_alloc(64, bytes);
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(guided)
        for (int64_t r = 0; r < R; r++) {
            for (int64_t blk = 0; blk < blocks; blk++) {
                if (lens[r] == 0 || work == NULL) continue;
                const int64_t c0 = blk * HKV_M1_CHANNELS;
                const int64_t nc = Di - c0 < HKV_M1_CHANNELS ? Di - c0 : HKV_M1_CHANNELS;
                char *page = (char *)state + pages[r] * page_stride * elem;
                const int64_t row = pos_state != NULL ? pos_rows[r] : -1;
                char *kept = row < 0 ? NULL
                                     : (char *)pos_state + row * pos_row_stride * (int64_t)elem;
                m1_block(page, state_bf16, has_initial[r], starts[r], lens[r], c0, nc, &in,
                         At + blk * N * HKV_M1_CHANNELS, work, kept,
                         pos_stride * (int64_t)elem);
            }
        }
        free(work);
    }
    free(At);
    return failed;
}
#pragma GCC pop_options

/* One Mamba2 mixer between its two projections, in one call (prefill chunks and decode steps
 * alike), from the in_proj output to out_proj's input:
 *
 *   zxbcdt row t:  [ z (I) | x (I) | B (G N) | C (G N) | dt (H) ]      (float32 or bfloat16)
 *                         \________ xBC: conv_dim ________/
 *   xBC  -> causal conv + silu (conv state in place; rounded to bf16 values when round_conv)
 *   dt   -> clamp(softplus(dt + dt_bias), dt_min, dt_max)
 *   x, B, C, dt -> selective scan (ssm state in place) -> y [T, I] float32
 *   out  =  gated RMSNorm(y, z) in out's dtype (hkv_gated_rms_norm_mixed's rules)
 *
 * Each step is the kernel the separate ops call (hkv_conv1d, hkv_mamba2_scan,
 * hkv_gated_rms_norm_mixed), with the same numbers; one call saves the dozens of small tensor
 * ops and wrapper checks between them, which at batch 1 cost more than the arithmetic.
 * Scratch (the conv output, dt, y) is malloc'd here; the conv reads a bf16 xBC in place.
 * pos_conv / pos_ssm (with pos_rows; NULL: none): the states after every position, as the
 * two kernels' pos_state arguments (strides in elements of each state).
 * Returns 0, or -1 when scratch could not be allocated (nothing written then). */
int hkv_mamba2_mix(const void *zx, int zx_bf16, int64_t zx_stride, void *conv_state,
                   int64_t conv_page_stride, int conv_bf16, const float *conv_wt,
                   const float *conv_bias, int64_t K, int round_conv, void *ssm_state,
                   int64_t ssm_page_stride, int ssm_bf16, const int64_t *pages,
                   const uint8_t *has_initial, const int64_t *starts, const int64_t *lens,
                   int64_t R, int64_t T, int64_t H, int64_t P, int64_t N, int64_t G,
                   const float *A, const float *D, const float *dt_bias, float dt_min,
                   float dt_max, const float *norm_w, int64_t norm_group, float eps,
                   int norm_before_gate, int w_fp32, void *out, int out_bf16, void *pos_conv,
                   int64_t conv_row_stride, int64_t conv_pos_stride, void *pos_ssm,
                   int64_t ssm_row_stride, int64_t ssm_pos_stride, const int64_t *pos_rows) {
    const int64_t I = H * P, conv_dim = I + 2 * G * N;
    const size_t need = (size_t)T * (size_t)(conv_dim + H + I);
    float *scratch = malloc(sizeof(float) * (need ? need : 1));
    if (scratch == NULL) return -1;
    float *conv_y = scratch, *dtp = conv_y + T * conv_dim, *y = dtp + T * H;
    /* the conv reads xBC in place, float32 or bfloat16 */
    const void *conv_in = zx_bf16 ? (const void *)((const uint16_t *)zx + I)
                                  : (const void *)((const float *)zx + I);
    if (hkv_conv1d(conv_state, conv_page_stride, conv_bf16, pages, has_initial, starts, lens,
                       R, conv_dim, K, conv_in, zx_stride, zx_bf16, conv_wt, conv_bias, 1,
                       round_conv, conv_y, pos_conv, pos_rows, conv_row_stride,
                       conv_pos_stride)) {
        free(scratch);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) /* softplus as PyTorch's (threshold 20), then the limits */
        for (int64_t h = 0; h < H; h++) {
            const int64_t at = t * zx_stride + I + conv_dim + h;
            const float raw = zx_bf16 ? hkv_bf16_to_f32(((const uint16_t *)zx)[at])
                                      : ((const float *)zx)[at];
            const float v = raw + dt_bias[h];
            float sp = v > 20.0f ? v : log1pf(expf(v));
            sp = sp < dt_min ? dt_min : sp;
            dtp[t * H + h] = sp > dt_max ? dt_max : sp;
        }
    hkv_mamba2_scan(ssm_state, ssm_page_stride, ssm_bf16, pages, has_initial, starts, lens, R,
                    H, P, N, G, conv_y, conv_dim, dtp, A, conv_y + I, conv_y + I + G * N,
                    conv_dim, D, y, pos_ssm, pos_rows, ssm_row_stride, ssm_pos_stride);
    hkv_gated_rms_norm_mixed(y, 0, zx, zx_bf16, zx_stride, norm_w, out, out_bf16, T, I,
                             norm_group, eps, norm_before_gate, w_fp32);
    free(scratch);
    return 0;
}
