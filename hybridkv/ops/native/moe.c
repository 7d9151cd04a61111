/* SwiGLU experts in bfloat16 on AMX tiles (Intel AMX-BF16): every (token, expert) pair of a
 * step through its expert's two GEMMs, and the weighted outputs summed per token, in one call.
 * hybridkv/ops/native/moe.py declares it and packs the weights; hybridkv/layers/mlp.py
 * (`gated_experts`: routed experts) and hybridkv/models/qwen3_next.py (a shared expert: one
 * expert that every token takes, its weight the sigmoid gate) call it. Compiled into the one
 * native library with the other C files of this folder.
 *
 *     x        [T, H] bfloat16 rows at a row stride (unit column stride)
 *     experts  [T, k] int64 (NULL: expert 0 for every pair), weights [T, k] bfloat16
 *     gate_up  expert e's [2I, H] weight ([gate | up] rows), packed (below)
 *     down     expert e's [H, I] weight, packed
 *     extra    NULL, or [T, H] bfloat16 rows at a row stride: added last (a shared expert)
 *     out      [T, H] bfloat16 rows at a row stride
 *
 *     out[t] = sum over j, in ascending expert order, of
 *              w[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]),   e = experts[t, j]
 *              (+ extra[t])
 *
 * rounded as the PyTorch path rounds it (`gated_experts` with bfloat16 linears; Qwen3-Next's
 * `routed + sigmoid(g) * shared_expert(x)`): each GEMM's float32 sums rounded to bfloat16, silu
 * rounded before the product with up, the product rounded, the down projection's output
 * rounded, times the pair's weight rounded, and the token's sum rounded after each addition
 * (index_add_ in bfloat16, experts in order; then + extra). Only the order of the float32 sums
 * inside a GEMM differs from oneDNN's.
 *
 * Packed weights (moe.py packs them once per weight): I padded to Ip, a multiple of 16; gate_up
 * reordered so that 16-row blocks alternate gate and up ([gate 0..15 | up 0..15 | gate 16..31 |
 * ...], zero rows past I in each), down's columns padded to Kp2 (a multiple of 32) with zeros;
 * then [E, N, K] -> tiles: N padded to a multiple of 16 and K to one of 32 with zeros; tile
 * (nb, kb) of expert e holds rows nb*16 .. +15 and columns kb*32 .. +31 as AMX wants its B
 * operand (pairs of k side by side): element [kp][n][p] = W[nb*16 + n][kb*32 + 2*kp + p], 1 KiB;
 * an expert's tiles in the order (nb, kb).
 *
 * The pairs are sorted by expert (a counting sort: pair order within an expert is token order,
 * as PyTorch's stable argsort) and cut into blocks of up to MOE_BLOCK pairs of one expert. Two
 * phases, each a loop of tasks shared among the OpenMP threads (the libgomp torch loaded:
 * torch.set_num_threads applies); a task is a block and a range of output columns (columns are
 * split only when there are too few blocks for the threads: decode steps):
 *   A: the block's rows of x gathered into a [rows, Kp1] buffer (zeros past H and past the
 *      last row), then per 16 columns of I and 32 rows, gate and up on 2 x 2 tiles of 16 x 16
 *      float32 sums (the weight tiles of those columns reused by every 32 rows of the block):
 *      h = bf16(bf16(silu(bf16(gate))) * bf16(up)) into h [P, Kp2] (sorted pairs)
 *   B: per 32 columns of H and 32 rows, h @ down^T on 2 x 2 tiles (h read in place):
 *      Y[pair] = bf16(bf16(sum) * w)  (or straight into out when k == 1 and no extra)
 * then each token sums its pairs' rows of Y in sorted (= expert) order.
 *
 * A build without AMX (or a kernel that refuses the tile data permission) reports no kernel:
 * hkv_amx_ready() (cpu.c) returns 0, and the callers take the kernels at the end of this file:
 * hkv_moe_route and hkv_moe_experts, the same router (and the sigmoid, grouped and biased rules
 * of DeepSeek-V3, Kimi, Nemotron-H and LFM2-MoE: struct moe_rule) and experts in float32 or
 * bfloat16 on the small-batch linears of every build (AVX-512, AVX2 + FMA, plain C).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"

#include <omp.h>

#if HKV_AMX_BF16
#define MOE_AMX 1
#else
#define MOE_AMX 0
#endif

#define MOE_BLOCK 128      /* pairs per block: the rows a weight tile is reused for */
#define MOE_TILE_K 32      /* bfloat16 values of k per tile row */
#define MOE_TILE_N 16      /* float32 sums per tile row */
#define MOE_TILE_ELEMS 512 /* bfloat16 values in one packed B tile (16 x 32) */
#define MOE_TASKS_PER_THREAD 4 /* column splits aim at this many tasks per thread */
#define MOE_KC 8 /* k tiles per pass over a block's rows: 2 x 8 weight tiles, 16 KiB, in L1 */
#define MOE_INLINE static inline __attribute__((always_inline))

static inline int64_t moe_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* ---- Shared by every build: the routing rules, the sort of the pairs by expert ---- */

static inline float moe_round1(float f) {
    const uint32_t bits = (uint32_t)hkv_f32_to_bf16(f) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

/* A routing rule (moe.py's `NativeRule`, layers/moe.py's `RoutingRule`):
 *     mode        0 softmax, then the k largest probabilities (Jamba, DeepSeek-V2); 1 the same
 *                 renormalised (Qwen3-Next); 2 the k largest logits, then the softmax of those
 *                 k (Granite MoE); 3 sigmoid scores (DeepSeek-V3, Kimi, Nemotron-H, LFM2-MoE)
 *     bias        NULL, or [E] float32 added to the scores for the choice only (never the
 *                 weights: those are the plain scores)
 *     groups      the experts in `groups` equal groups of which only the best `kept` can be
 *                 chosen (kept < groups), scored by their best choice ("max": the others'
 *                 choice 0, DeepSeek-V2) or the sum of their best two (top2_sum, at least two
 *                 an expert group: the others' choice -inf, DeepSeek-V3)
 *     renormalise the k weights divided by their sum (+ eps when eps != 0), then * scaling
 *     bf16        the scores and every step after them rounded to bfloat16, as PyTorch's ops on
 *                 bfloat16 logits (LFM2-MoE: `float32=False`; sigmoid only); else float32 */
struct moe_rule {
    int mode, group_max, renormalise, bf16;
    const float *bias;
    int64_t groups, kept;
    float eps, scaling;
};

/* v rounded to bfloat16 when r says so */
static inline float moe_r(const struct moe_rule *r, float v) { return r->bf16 ? moe_round1(v) : v; }

/* The k largest of v [n] (largest first; the lower index among equals, -inf counted as a
 * value) -> idx [k], val [k]; v overwritten (taken: NaN). k <= n. */
static void moe_topk(float *v, int64_t n, int64_t k, int64_t *idx, float *val) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!isnan(v[e]) && (best < 0 || v[e] > v[best])) best = e;
        if (best < 0) best = j; /* (NaN inputs: an index in range; PyTorch's is NaN too) */
        idx[j] = best, val[j] = v[best];
        v[best] = NAN;
    }
}

/* choice [E] with the experts outside the best r->kept groups set to 0 (max) or -inf
 * (top2_sum); gs: [groups] floats of work. */
static void moe_keep_groups(const struct moe_rule *r, float *choice, int64_t E, float *gs) {
    const int64_t G = r->groups, n = E / G;
    for (int64_t g = 0; g < G; g++) {
        const float *c = choice + g * n;
        float a = -INFINITY, b = -INFINITY; /* the group's largest, second largest */
        for (int64_t i = 0; i < n; i++) {
            if (c[i] > a) b = a, a = c[i];
            else if (c[i] > b) b = c[i];
        }
        gs[g] = r->group_max ? a : a + b;
    }
    for (int64_t j = 0; j < r->kept; j++) { /* the best kept groups: marked NaN in gs */
        int64_t g;
        float score;
        moe_topk(gs, G, 1, &g, &score);
    }
    const float fill = r->group_max ? 0.0f : -INFINITY;
    for (int64_t g = 0; g < G; g++)
        if (!isnan(gs[g]))
            for (int64_t i = 0; i < n; i++) choice[g * n + i] = fill;
}

/* The weights' last steps: renormalised (+ eps), scaled; rounded as r says. w: [k]. */
static void moe_finish(const struct moe_rule *r, float *w, int64_t k) {
    if (r->renormalise || r->mode == 1) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += w[j];
        total = moe_r(r, total);
        const float denom = r->eps != 0.0f ? moe_r(r, total + r->eps) : total;
        for (int64_t j = 0; j < k; j++) w[j] = moe_r(r, w[j] / denom);
    }
    if (r->scaling != 1.0f)
        for (int64_t j = 0; j < k; j++) w[j] = moe_r(r, w[j] * r->scaling);
}

/* One token's rule on its E float32 logits l (overwritten with its scores) -> experts [k]
 * (largest choice first), w [k] float32. choice: [E] floats of work, or l itself when there
 * is neither a bias nor groups; gs: [groups] floats of work (grouped rules only). */
static void moe_route_token(const struct moe_rule *r, float *l, float *choice, float *gs,
                            int64_t E, int64_t k, int64_t *experts, float *w) {
    float top = -INFINITY;
    for (int64_t e = 0; e < E; e++) top = l[e] > top ? l[e] : top;
    if (r->mode == 0 || r->mode == 1) { /* softmax in float32 */
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += (l[e] = expf(l[e] - top));
        const float inv = 1.0f / sum;
        for (int64_t e = 0; e < E; e++) l[e] *= inv;
    } else if (r->mode == 3) {
        for (int64_t e = 0; e < E; e++) l[e] = moe_r(r, 1.0f / (1.0f + expf(-l[e])));
    }
    if (choice != l)
        for (int64_t e = 0; e < E; e++) choice[e] = l[e] + (r->bias ? r->bias[e] : 0.0f);
    if (r->kept < r->groups) moe_keep_groups(r, choice, E, gs);
    moe_topk(choice, E, k, experts, w); /* w: the chosen values of choice */
    if (r->bias != NULL)
        for (int64_t j = 0; j < k; j++) w[j] = l[experts[j]]; /* the unbiased scores */
    if (r->mode == 2) { /* the softmax of the k largest logits (bf16: the result rounded,
                           * as PyTorch's softmax of bfloat16 values, gpt-oss) */
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += (w[j] = expf(w[j] - top));
        for (int64_t j = 0; j < k; j++) w[j] = moe_r(r, w[j] / sum);
    }
    moe_finish(r, w, k);
}

#if HKV_AMX_BF16
/* The AMX router's rules (mode 0-2, no bias, groups or scaling) on a token's E logits
 * (overwritten) -> experts [k], w [k] float32. */
static void moe_rule(float *logits, int64_t E, int64_t k, int mode, int64_t *experts, float *w) {
    const struct moe_rule r = {mode, 0, 0, 0, NULL, 1, 1, 0.0f, 1.0f};
    moe_route_token(&r, logits, logits, NULL, E, k, experts, w);
}
#endif

/* The P = T * k pairs (flat index i = t * k + j) sorted by expert with a counting sort (pair
 * order within an expert is token order, as PyTorch's stable argsort): offsets [E + 1] (expert
 * e's sorted positions offsets[e] .. offsets[e + 1] - 1), order [P] (sorted position -> pair),
 * pos [P] (pair -> sorted position). experts NULL: expert 0 for every pair. Returns 0, or -1
 * for an id outside 0 .. E - 1. */
static int moe_sort_pairs(const int64_t *experts, int64_t P, int64_t E, int64_t *offsets,
                          int64_t *order, int64_t *pos) {
    memset(offsets, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < P; i++) {
        const int64_t e = experts == NULL ? 0 : experts[i];
        if (e < 0 || e >= E) return -1;
        offsets[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    for (int64_t i = 0; i < P; i++) { /* offsets[e] walks expert e's positions ... */
        const int64_t p = offsets[experts == NULL ? 0 : experts[i]]++;
        order[p] = i, pos[i] = p;
    }
    for (int64_t e = E; e > 0; e--) offsets[e] = offsets[e - 1]; /* ... and is put back */
    offsets[0] = 0;
    return 0;
}

/* A token's k sorted positions (ps [k]) in ascending (= expert) order into mine [k]: the
 * order in which its experts' outputs are added (k is small: an insertion sort). */
static void moe_token_order(const int64_t *ps, int64_t k, int64_t *mine) {
    for (int64_t j = 0; j < k; j++) {
        int64_t v = ps[j], i = j;
        for (; i > 0 && mine[i - 1] > v; i--) mine[i] = mine[i - 1];
        mine[i] = v;
    }
}

#if MOE_AMX

/* 16 bfloat16 values (the lanes of m; zeros elsewhere) as float32 */
MOE_INLINE __m512 moe_load16(const uint16_t *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 float32 rounded to bfloat16 (nearest even, as torch; vcvtneps2bf16), stored (lanes of m) */
MOE_INLINE void moe_store16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bfloat16 values, kept in float32 */
MOE_INLINE __m512 moe_round16(__m512 v) {
    const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* the lanes below n (n <= 16) */
static inline __mmask16 moe_mask(int64_t n) {
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}


/* Sums of 32 rows (16 when !two_rows) of A (row stride lda values) by one or two column tiles
 * (B0, B1: Kb packed tiles each, consecutive in k) into C (row stride 32 floats: [32, 32], the
 * first tile's columns then the second's), added to what C holds when acc (else from zero).
 * Tiles 0-3: sums (row tile i, column tile j at 2i + j), 4-5: A, 6-7: B. two_rows, two_cols
 * and acc are constants where inlined. */
MOE_INLINE void moe_block(const int two_rows, const int two_cols, const int acc,
                          const uint16_t *A, int64_t lda, const uint16_t *B0, const uint16_t *B1,
                          int64_t Kb, float *C) {
    const int64_t sa = lda * 2;
    if (acc) {
        _tile_loadd(0, C, 128);
        if (two_cols) _tile_loadd(1, C + 16, 128);
        if (two_rows) _tile_loadd(2, C + 16 * 32, 128);
        if (two_rows && two_cols) _tile_loadd(3, C + 16 * 32 + 16, 128);
    } else {
        _tile_zero(0);
        if (two_cols) _tile_zero(1);
        if (two_rows) _tile_zero(2);
        if (two_rows && two_cols) _tile_zero(3);
    }
    for (int64_t kb = 0; kb < Kb; kb++) {
        _tile_loadd(4, A + kb * MOE_TILE_K, sa);
        _tile_loadd(6, B0 + kb * MOE_TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) {
            _tile_loadd(7, B1 + kb * MOE_TILE_ELEMS, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, A + 16 * lda + kb * MOE_TILE_K, sa);
            _tile_dpbf16ps(2, 5, 6);
            if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, C, 128);
    if (two_cols) _tile_stored(1, C + 16, 128);
    if (two_rows) _tile_stored(2, C + 16 * 32, 128);
    if (two_rows && two_cols) _tile_stored(3, C + 16 * 32 + 16, 128);
}

static void moe_block_any(int rows, int cols, int acc, const uint16_t *A, int64_t lda,
                          const uint16_t *B0, const uint16_t *B1, int64_t Kb, float *C) {
    switch ((rows > 16) * 4 + (cols > 1) * 2 + (acc != 0)) {
    case 0: moe_block(0, 0, 0, A, lda, B0, B1, Kb, C); break;
    case 1: moe_block(0, 0, 1, A, lda, B0, B1, Kb, C); break;
    case 2: moe_block(0, 1, 0, A, lda, B0, B1, Kb, C); break;
    case 3: moe_block(0, 1, 1, A, lda, B0, B1, Kb, C); break;
    case 4: moe_block(1, 0, 0, A, lda, B0, B1, Kb, C); break;
    case 5: moe_block(1, 0, 1, A, lda, B0, B1, Kb, C); break;
    case 6: moe_block(1, 1, 0, A, lda, B0, B1, Kb, C); break;
    default: moe_block(1, 1, 1, A, lda, B0, B1, Kb, C); break;
    }
}

/* C [rows, 32] (row pairs of 32 rows at C + 1024 r0 / 32 ... : [32, 32] each) = A [rows, 32 Kb]
 * @ (B0 | B1)^T: every row pair of the block through the same weight tiles, MOE_KC values of k at
 * a time (their 2 x MOE_KC tiles stay in L1 while the row pairs stream through). */
static void moe_panel(int rows, int cols, const uint16_t *A, int64_t lda, const uint16_t *B0,
                      const uint16_t *B1, int64_t Kb, float *C) {
    for (int64_t k0 = 0; k0 < Kb; k0 += MOE_KC) {
        const int64_t kn = Kb - k0 < MOE_KC ? Kb - k0 : MOE_KC;
        for (int r0 = 0; r0 < rows; r0 += 32) {
            const int n = rows - r0 < 32 ? rows - r0 : 32;
            moe_block_any(n, cols, k0 > 0, A + r0 * lda + k0 * MOE_TILE_K, lda,
                          B0 + k0 * MOE_TILE_ELEMS, B1 + k0 * MOE_TILE_ELEMS, kn,
                          C + (r0 / 32) * 1024);
        }
    }
}

/* What both phases read. */
struct moe_args {
    const uint16_t *x, *weights, *gate_up, *down, *extra;
    int64_t x_stride, extra_stride, out_stride, T, H, k, E, Ip;
    int64_t Kb1, Kp1, Kb2, Kp2, Nb2, per1, per2; /* tiles; per1, per2: values per expert */
    const int64_t *order;                        /* sorted position -> flat pair */
    uint16_t *h, *Y, *out;                       /* h [P + 32, Kp2]; Y [P, H] or NULL */
};

/* A thread's buffers, kept between calls (grown when a call needs more). */
struct moe_work {
    uint16_t *a; /* [MOE_BLOCK, Kp1] gathered rows of x */
    float *c;    /* [MOE_BLOCK / 32][32, 32] sums of the block's 2 x 2 tile blocks */
    size_t bytes;
};

static _Thread_local struct moe_work moe_tls;

static int moe_reserve(struct moe_work *w, int64_t Kp1) {
    const size_t a = (size_t)(MOE_BLOCK * Kp1 * 2), bytes = a + MOE_BLOCK * 32 * 4;
    if (bytes > w->bytes) {
        free(w->a);
        w->a = aligned_alloc(64, bytes);
        w->bytes = w->a == NULL ? 0 : bytes;
        if (w->a == NULL) return 0;
    }
    w->c = (float *)((char *)w->a + a);
    return 1;
}

/* Phase A of a block (expert e, sorted positions p0 .. p0 + rows - 1), 16-column blocks j0 .. j1
 * - 1 of I: h rows of those columns. */
static void moe_phase_a(const struct moe_args *s, int64_t e, int64_t p0, int rows, int64_t j0,
                        int64_t j1, struct moe_work *w) {
    const int64_t Kp1 = s->Kp1, H = s->H;
    const int tile_rows = (int)moe_up(rows, 16);
    for (int r = 0; r < tile_rows; r++) { /* gather, zeros past H and past the block's rows */
        uint16_t *dst = w->a + r * Kp1;
        if (r < rows) {
            memcpy(dst, s->x + (s->order[p0 + r] / s->k) * s->x_stride, (size_t)H * 2);
            memset(dst + H, 0, (size_t)(Kp1 - H) * 2);
        } else {
            memset(dst, 0, (size_t)Kp1 * 2);
        }
    }
    const uint16_t *W = s->gate_up + e * s->per1;
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *Bg = W + 2 * j * s->Kb1 * MOE_TILE_ELEMS, *Bu = Bg + s->Kb1 * MOE_TILE_ELEMS;
        moe_panel(rows, 2, w->a, Kp1, Bg, Bu, s->Kb1, w->c);
        for (int r = 0; r < rows; r++) { /* h = bf16(bf16(silu(bf16(g))) * bf16(u)) */
            const float *c = w->c + (r / 32) * 1024 + (r % 32) * 32;
            const __m512 g = moe_round16(_mm512_loadu_ps(c));
            const __m512 u = moe_round16(_mm512_loadu_ps(c + 16));
            moe_store16(s->h + (p0 + r) * s->Kp2 + j * 16,
                        _mm512_mul_ps(moe_round16(hkv_silu16(g)), u), 0xffff);
        }
    }
}

/* Phase B of a block, 32-column blocks c0 .. c1 - 1 of H: Y (or out) rows of those columns. */
static void moe_phase_b(const struct moe_args *s, int64_t e, int64_t p0, int rows, int64_t c0,
                        int64_t c1, struct moe_work *w) {
    const int64_t Kb2 = s->Kb2, H = s->H;
    const uint16_t *W = s->down + e * s->per2;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t nb = 2 * c, cols = nb + 1 < s->Nb2 ? 2 : 1;
        const uint16_t *B0 = W + nb * Kb2 * MOE_TILE_ELEMS, *B1 = B0 + Kb2 * MOE_TILE_ELEMS;
        /* (rows past the block read other pairs' h, or the zero rows past P: dropped) */
        moe_panel(rows, (int)cols, s->h + p0 * s->Kp2, s->Kp2, B0, B1, Kb2, w->c);
        for (int r = 0; r < rows; r++) { /* Y = bf16(bf16(sum) * w) */
            const int64_t pair = s->order[p0 + r];
            const float wt = _mm512_cvtss_f32(moe_load16(s->weights + pair, 1));
            const __m512 wv = _mm512_set1_ps(wt);
            const float *c = w->c + (r / 32) * 1024 + (r % 32) * 32;
            uint16_t *dst = s->Y ? s->Y + (p0 + r) * H : s->out + pair * s->out_stride;
            for (int64_t t = 0; t < cols; t++) {
                const int64_t col = nb * 16 + t * 16;
                const __mmask16 m = moe_mask(H - col);
                moe_store16(dst + col, _mm512_mul_ps(moe_round16(_mm512_loadu_ps(c + t * 16)), wv),
                            m);
            }
        }
    }
}

/* Tasks of a phase: every block, its columns (`ncols` units) cut into `split` ranges;
 * task[i] = (expert, first position, rows, first unit, end unit). */
static int64_t moe_tasks(const int64_t *offsets, int64_t E, int64_t ncols, int threads,
                         int64_t *tasks) {
    int64_t blocks = 0;
    for (int64_t e = 0; e < E; e++) blocks += (offsets[e + 1] - offsets[e] + MOE_BLOCK - 1) / MOE_BLOCK;
    int64_t split = (MOE_TASKS_PER_THREAD * threads + blocks - 1) / (blocks ? blocks : 1);
    split = split < 1 ? 1 : split > ncols ? ncols : split;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = offsets[e]; p < offsets[e + 1]; p += MOE_BLOCK)
            for (int64_t part = 0; part < split; part++) {
                const int64_t left = offsets[e + 1] - p;
                int64_t *t = tasks + 5 * n++;
                t[0] = e, t[1] = p, t[2] = left < MOE_BLOCK ? left : MOE_BLOCK;
                t[3] = ncols * part / split, t[4] = ncols * (part + 1) / split;
            }
    return n;
}

/* See the top of this file. Returns 0, -1 for an expert id outside 0 .. E - 1 (out untouched),
 * -2 when a work space could not be allocated (hkv_moe_bf16 returns it: a status kernel). */
static int moe_run(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H,
                   const int64_t *experts, const uint16_t *weights, int64_t k, int64_t E,
                   const uint16_t *gate_up, const uint16_t *down, int64_t Ip,
                   const uint16_t *extra, int64_t extra_stride, uint16_t *out,
                   int64_t out_stride) {
    const int64_t P = T * k;
    if (P == 0) return 0;
    struct moe_args s = {0};
    s.x = x, s.weights = weights, s.gate_up = gate_up, s.down = down, s.extra = extra;
    s.x_stride = x_stride, s.extra_stride = extra_stride, s.out_stride = out_stride;
    s.T = T, s.H = H, s.k = k, s.E = E, s.Ip = Ip;
    s.Kb1 = (H + MOE_TILE_K - 1) / MOE_TILE_K, s.Kp1 = s.Kb1 * MOE_TILE_K;
    s.Kb2 = (Ip + MOE_TILE_K - 1) / MOE_TILE_K, s.Kp2 = s.Kb2 * MOE_TILE_K;
    s.Nb2 = (H + MOE_TILE_N - 1) / MOE_TILE_N;
    s.per1 = (2 * Ip / MOE_TILE_N) * s.Kb1 * MOE_TILE_ELEMS;
    s.per2 = s.Nb2 * s.Kb2 * MOE_TILE_ELEMS;
    const int threads = omp_get_max_threads();
    const int64_t max_tasks = (P / MOE_BLOCK + E + 1) * (MOE_TASKS_PER_THREAD * threads + 1);
    /* offsets [E + 1], order [P] (sorted position -> flat pair), pos [P] (flat pair -> sorted
     * position), tasks */
    int64_t *ints = malloc(sizeof(int64_t) * (size_t)(E + 1 + 2 * P + 5 * max_tasks));
    const int direct = k == 1 && extra == NULL; /* Y rows straight into out */
    const size_t h_bytes = sizeof(uint16_t) * (size_t)((P + 32) * s.Kp2);
    const size_t y_bytes = direct ? 0 : sizeof(uint16_t) * (size_t)(P * H);
    char *buf = malloc(h_bytes + y_bytes);
    if (ints == NULL || buf == NULL) {
        free(ints), free(buf);
        return -2;
    }
    int64_t *offsets = ints, *order = offsets + E + 1, *pos = order + P, *tasks = pos + P;
    s.order = order, s.h = (uint16_t *)buf, s.Y = direct ? NULL : (uint16_t *)(buf + h_bytes);
    s.out = out;
    if (moe_sort_pairs(experts, P, E, offsets, order, pos) != 0) {
        free(ints), free(buf);
        return -1;
    }
    memset(s.h + P * s.Kp2, 0, sizeof(uint16_t) * (size_t)(32 * s.Kp2)); /* rows past P */
    if (s.Kp2 > Ip) /* h's columns past Ip meet zero weights, but must not be NaN */
        for (int64_t p = 0; p < P; p++) memset(s.h + p * s.Kp2 + Ip, 0, 2 * (size_t)(s.Kp2 - Ip));
    int failed = 0;
    int64_t num_tasks = 0;
#pragma omp parallel
    {
        struct moe_work *w = &moe_tls;
        const int ok = moe_reserve(w, s.Kp1);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            hkv_tiles_16x64();
        }
#pragma omp single
        num_tasks = moe_tasks(offsets, E, Ip / MOE_TILE_N, threads, tasks);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) {
            const int64_t *t = tasks + 5 * i;
            if (ok) moe_phase_a(&s, t[0], t[1], (int)t[2], t[3], t[4], w);
        }
#pragma omp single
        num_tasks = moe_tasks(offsets, E, (s.Nb2 + 1) / 2, threads, tasks);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) {
            const int64_t *t = tasks + 5 * i;
            if (ok) moe_phase_b(&s, t[0], t[1], (int)t[2], t[3], t[4], w);
        }
        if (ok) _tile_release();
    }
    if (failed || direct) {
        free(ints), free(buf);
        return failed ? -2 : 0;
    }
    /* each token's rows of Y in sorted (expert) order, rounded after each addition; + extra */
    const uint16_t *Y = s.Y;
#pragma omp parallel for schedule(static) if (T * H >= 32768)
    for (int64_t t = 0; t < T; t++) {
        int64_t stack[16] = {0};
        int64_t *mine = k <= 16 ? stack : malloc(sizeof(int64_t) * (size_t)k);
        if (mine == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        moe_token_order(pos + t * k, k, mine);
        uint16_t *o = out + t * out_stride;
        const uint16_t *ex = extra ? extra + t * extra_stride : NULL;
        for (int64_t c = 0; c < H; c += 16) { /* 0 + y, then + y rounded after each */
            const __mmask16 m = moe_mask(H - c);
            __m512 acc = _mm512_add_ps(_mm512_setzero_ps(), moe_load16(Y + mine[0] * H + c, m));
            for (int64_t j = 1; j < k; j++)
                acc = _mm512_add_ps(moe_round16(acc), moe_load16(Y + mine[j] * H + c, m));
            if (ex) acc = _mm512_add_ps(moe_round16(acc), moe_load16(ex + c, m));
            moe_store16(o + c, acc, m);
        }
        if (mine != stack) free(mine);
    }
    free(ints), free(buf);
    return failed ? -2 : 0;
}

/* ---- The router: softmax top-k of x @ router^T, and sigmoid(x @ shared_gate^T) ----
 *
 * Qwen3-Next's SparseMoe before its experts, as its PyTorch ops compute it:
 *     logits = bf16(x @ router^T)              [T, E] (float32 sums, rounded once)
 *     probs  = softmax(float(logits))           float32
 *     top, experts = topk(probs, k)             largest first (ties: the lower expert)
 * work: [T * (E + k)] floats. k <= E.
 *     top    = top / sum(top)  (if normalize)   float32
 *     weights = bf16(top)                       [T, k]
 *     scale  = bf16(sigmoid(bf16(x @ shared_gate^T)))   [T] (when shared_gate is given)
 * The dot products run on vdpbf16ps (another summation order than oneDNN's: a logit may differ
 * in its last bit, and so a near-tie of two experts may choose the other one). */

/* dot(x, w) of n bfloat16 values, float32 sums (vdpbf16ps, 32 values a step, masked tail) */
static inline float moe_dot(const uint16_t *x, const uint16_t *w, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + i),
                                (__m512bh)_mm512_loadu_si512(w + i));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(x + i + 32),
                                (__m512bh)_mm512_loadu_si512(w + i + 32));
    }
    for (; i < n; i += 32) {
        const __mmask32 m = n - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - i)) - 1u);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + i),
                                (__m512bh)_mm512_maskz_loadu_epi16(m, w + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void hkv_moe_route_bf16(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H,
                        const uint16_t *router, int64_t E, const uint16_t *shared_gate, int64_t k,
                        int mode, int64_t *experts, uint16_t *weights, uint16_t *scale,
                        float *work) {
#pragma omp parallel for schedule(static) if (T * E * H >= (1 << 20))
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xt = x + t * x_stride;
        float *prob = work + t * E, *w = work + T * E + t * k; /* E logits, k weights */
        for (int64_t e = 0; e < E; e++) prob[e] = moe_round1(moe_dot(xt, router + e * H, H));
        moe_rule(prob, E, k, mode, experts + t * k, w);
        for (int64_t j = 0; j < k; j++) weights[t * k + j] = hkv_f32_to_bf16(w[j]);
        if (shared_gate != NULL) {
            const float g = moe_round1(moe_dot(xt, shared_gate, H));
            scale[t] = hkv_f32_to_bf16(1.0f / (1.0f + expf(-g)));
        }
    }
}

int hkv_moe_bf16(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H,
                 const int64_t *experts, const uint16_t *weights, int64_t k, int64_t E,
                 const uint16_t *gate_up, const uint16_t *down, int64_t Ip,
                 const uint16_t *extra, int64_t extra_stride, uint16_t *out, int64_t out_stride) {
    return moe_run(x, x_stride, T, H, experts, weights, k, E, gate_up, down, Ip, extra,
                   extra_stride, out, out_stride);
}

#else /* no AMX: no kernel */

void hkv_moe_route_bf16(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H,
                        const uint16_t *router, int64_t E, const uint16_t *shared_gate, int64_t k,
                        int normalize, int64_t *experts, uint16_t *weights, uint16_t *scale,
                        float *work) {
    (void)x, (void)x_stride, (void)T, (void)H, (void)router, (void)E, (void)shared_gate;
    (void)k, (void)normalize, (void)experts, (void)weights, (void)scale, (void)work;
}

int hkv_moe_bf16(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H,
                 const int64_t *experts, const uint16_t *weights, int64_t k, int64_t E,
                 const uint16_t *gate_up, const uint16_t *down, int64_t Ip,
                 const uint16_t *extra, int64_t extra_stride, uint16_t *out, int64_t out_stride) {
    (void)x, (void)x_stride, (void)T, (void)H, (void)experts, (void)weights, (void)k, (void)E;
    (void)gate_up, (void)down, (void)Ip, (void)extra, (void)extra_stride, (void)out;
    (void)out_stride;
    return -3;
}

#endif

/* ---- The router and the experts on every build (AVX2 + FMA, AVX-512, plain C) ----
 *
 * What an AVX2 CPU, an AVX-512 one without AMX and a float32 model on any CPU run (moe.py's
 * `vector_route`, `vector_experts`): the same computation as the PyTorch paths, every product
 * on the small-batch linears of f32_linear.c and bf16_linear.c (their weight streams and tiles,
 * for whichever of AVX-512, AVX2 + FMA or plain C the library is built), the activation on
 * kernels.c's silu-mul. Both read their inputs and write
 * their outputs through pointers only, so a captured decode step (program.py) replays them
 * correctly when the routing changes from step to step. `bf16`: all tensors bfloat16 (each
 * product's float32 sums rounded once, as PyTorch's bfloat16 linear), else all float32. */

void hkv_f32_linear(const float *x, int64_t ldx, const float *w, const float *bias, int64_t M,
                    int64_t N, int64_t K, float *y, int64_t ldy);
void hkv_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     int64_t M, int64_t N, int64_t K, uint16_t *y, int64_t ldy);
void hkv_silu_mul_f32(const float *gate, int64_t g_stride, const float *up, int64_t u_stride,
                      float *out, int64_t rows, int64_t I);
void hkv_silu_mul_bf16(const uint16_t *gate, int64_t g_stride, const uint16_t *up,
                       int64_t u_stride, uint16_t *out, int64_t rows, int64_t I);
void hkv_relu2(const void *x, void *out, int64_t n, int bf16);

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w [N, K]^T in float32 or bfloat16 */
static void moe_linear(int bf16, const void *x, int64_t ldx, const void *w, int64_t M,
                       int64_t N, int64_t K, void *y, int64_t ldy) {
    if (bf16)
        hkv_bf16_linear(x, ldx, w, NULL, M, N, K, y, ldy);
    else
        hkv_f32_linear(x, ldx, w, NULL, M, N, K, y, ldy);
}

/* The router (moe.py's `vector_route`):
 *     x       [T, H] rows at a row stride, float32 or bfloat16 (types & 1)
 *     gate    [E, H] contiguous, float32 or bfloat16 (types & 2: then x is bfloat16 too)
 *     gate_bias NULL, or [E] of the gate's dtype: added to the logits (gpt-oss's router;
 *             bfloat16: in float32 to the product's sums, rounded once, as F.linear's)
 *     bias    NULL or [E] float32: the choice bias (struct moe_rule)
 *     experts [T, k] int64 (largest choice first), weights [T, k] bfloat16 (types & 4) or
 *             float32
 *     work    [T * (3E + H + groups + k)] float32
 * logits = x @ gate^T: both bfloat16, rounded once (as gate(x) in bfloat16); a float32 gate,
 * in float32 (x widened first: a Router's F.linear(x.float(), weight.float())); then per
 * token the rule (mode, and flags: 1 renormalise, 2 groups by their best ("max"; else
 * top2_sum), 4 scores in bfloat16; struct moe_rule) on the float32 logits, the weights
 * rounded to their dtype. k <= E; groups divides E (top2_sum: at least two experts a group),
 * 1 <= kept <= groups. */
void hkv_moe_route(const void *x, int64_t x_stride, int64_t T, int64_t H, const void *gate,
                   const void *gate_bias, int64_t E, int64_t k, int types, int mode,
                   const float *bias, int64_t groups,
                   int64_t kept, int flags, float eps, float scaling, int64_t *experts,
                   void *weights, float *work) {
    if (T <= 0 || k <= 0) return;
    const int x16 = types & 1, gate16 = (types & 2) != 0, w16 = (types & 4) != 0;
    const struct moe_rule r = {mode, (flags & 2) != 0, flags & 1, (flags & 4) != 0, bias,
                               groups, kept, eps, scaling};
    float *logits = work, *choice = logits + T * E, *scratch = choice + T * E;
    float *gs = scratch + T * (E + H), *wk = gs + T * groups; /* then [T, k] weights */
    if (gate16) { /* bfloat16 logits [T, E] in scratch */
        uint16_t *l16 = (uint16_t *)scratch;
        hkv_bf16_linear(x, x_stride, gate, gate_bias, T, E, H, l16, E);
        for (int64_t i = 0; i < T * E; i++) logits[i] = hkv_bf16_to_f32(l16[i]);
    } else if (x16) { /* x widened to float32 [T, H] in scratch */
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                scratch[t * H + h] = hkv_bf16_to_f32(((const uint16_t *)x)[t * x_stride + h]);
        hkv_f32_linear(scratch, H, gate, gate_bias, T, E, H, logits, E);
    } else {
        hkv_f32_linear(x, x_stride, gate, gate_bias, T, E, H, logits, E);
    }
    const int in_place = bias == NULL && kept >= groups; /* the choice is the scores */
#pragma omp parallel for schedule(static) if (T * E >= 4096)
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * E, *w = wk + t * k;
        moe_route_token(&r, l, in_place ? l : choice + t * E, gs + t * groups, E, k,
                        experts + t * k, w);
        for (int64_t j = 0; j < k; j++) {
            if (w16)
                ((uint16_t *)weights)[t * k + j] = hkv_f32_to_bf16(w[j]);
            else
                ((float *)weights)[t * k + j] = w[j];
        }
    }
}

/* out[t] (+)= w * y in float32 or bfloat16: bfloat16 rounds y * w, then the sum (as PyTorch's
 * `h * w` and `index_add_` in bfloat16); `first`: out = 0 + w * y */
static void moe_add_weighted(int bf16, void *out, const void *y, const void *w, int64_t n,
                             int first) {
    if (bf16) {
        uint16_t *o = out;
        const uint16_t *v = y;
        const float wt = hkv_bf16_to_f32(*(const uint16_t *)w);
        for (int64_t c = 0; c < n; c++) {
            const float p = moe_round1(hkv_bf16_to_f32(v[c]) * wt);
            o[c] = hkv_f32_to_bf16(first ? 0.0f + p : hkv_bf16_to_f32(o[c]) + p);
        }
    } else {
        float *o = out;
        const float *v = y, wt = *(const float *)w;
        if (first)
            for (int64_t c = 0; c < n; c++) o[c] = 0.0f + v[c] * wt;
        else
            for (int64_t c = 0; c < n; c++) o[c] += v[c] * wt;
    }
}

/* hkv_moe_experts' activations */
#define MOE_SWIGLU 0  /* silu(gate) * up */
#define MOE_RELU2 1   /* relu(up)^2, up [E, I, H] */
#define MOE_CLAMPED 2 /* gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit),
                       * on the checkpoint's x @ W layout (moe_linear_cols) */

/* What the two phases of hkv_moe_experts read: h, Y and the gathered rows by sorted pair. */
struct moe_vec {
    int bf16, relu2, act; /* relu2: up [E, I, H] and relu(up x)^2 (else gate_up) */
    int64_t es, H, I;
    const int64_t *offsets;
    const void *gate_up, *down;
    const void *gate_up_bias, *down_bias; /* NULL or [E, 2I] ([gate | up]), [E, H] */
    float alpha, limit;
    char *xg, *gu, *h, *Y; /* [P, H], [P, 2I], [P, I], [P, H] */
};

/* v rounded to bfloat16 when bf16 (kept in float32) */
static inline float moe_rb(int bf16, float v) { return bf16 ? moe_round1(v) : v; }

/* The value at i of a float32 or bfloat16 row */
static inline float moe_at(int bf16, const void *p, int64_t i) {
    return bf16 ? hkv_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void moe_put(int bf16, void *p, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = hkv_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* row[c] = row[c] + bias[c] for c in c0 .. c1 - 1, rounded (PyTorch's `x @ W + b`: the
 * product rounded, then the sum) */
static void moe_add_bias(int bf16, void *row, const void *bias, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++)
        moe_put(bf16, row, c, moe_at(bf16, row, c) + moe_at(bf16, bias, c));
}

/* gpt-oss's activation of one row's columns c0 .. c1 - 1 (ClampedSwigluExperts.activation:
 * gate and up interleaved as the checkpoint stores them, gate at gu[2c] and up at gu[2c + 1],
 * each biased first when gb: gb[2c], gb[2c + 1]); every step rounded in bfloat16 as PyTorch's
 * ops round it:
 *     g = min(gate, limit), u = clamp(up, -limit, limit),
 *     h = (u + 1) * (g * sigmoid(g * alpha)) */
static void moe_clamped(int bf16, const void *gu, const void *gb, void *h, int64_t c0,
                        int64_t c1, float alpha, float limit) {
    for (int64_t c = c0; c < c1; c++) {
        float g = moe_at(bf16, gu, 2 * c), u = moe_at(bf16, gu, 2 * c + 1);
        if (gb != NULL) {
            g = moe_rb(bf16, g + moe_at(bf16, gb, 2 * c));
            u = moe_rb(bf16, u + moe_at(bf16, gb, 2 * c + 1));
        }
        g = g > limit ? limit : g; /* (NaN stays NaN, as clamp) */
        u = u > limit ? limit : u < -limit ? -limit : u;
        const float z = moe_rb(bf16, g * alpha);
        const float s = moe_rb(bf16, 1.0f / (1.0f + expf(-z)));
        const float glu = moe_rb(bf16, g * s);
        moe_put(bf16, h, c - c0, moe_rb(bf16, u + 1.0f) * glu);
    }
}

/* Columns part * n / split .. (part + 1) * n / split of n, in whole 16s (the last: the rest) */
static void moe_part(int64_t n, int64_t part, int64_t split, int64_t *c0, int64_t *c1) {
    const int64_t blocks = (n + 15) / 16;
    *c0 = blocks * part / split * 16, *c1 = blocks * (part + 1) / split * 16;
    *c1 = *c1 < n ? *c1 : n;
}

/* y[r, c - c0] = sum over k < K of x[r, k] W[k, c], for rows r < n (x at row stride ldx, y
 * at ldy, pointing at column c0) and columns c0 .. c1 - 1 of W [K, ldw] row-major: x @ W on a
 * weight as gpt-oss's checkpoints store it (no transposed copy), float32 sums rounded once to
 * y's dtype. Tiles of MOE_COLS_ROWS rows x MOE_COLS_TILE columns keep their sums in L1; each
 * row of W's tile streams once per row block (decode: once):
 *
 *        W [K, ldw]        columns c0 ........ c1
 *        row k  ------->   | tile | tile | ... |     acc[r][:] += x[r, k] * W[k, tile]
 */
#define MOE_COLS_TILE 256
#define MOE_COLS_ROWS 4
static void moe_linear_cols(int bf16, const char *x, int64_t ldx, const char *W, int64_t ldw,
                            int64_t n, int64_t c0, int64_t c1, int64_t K, char *y, int64_t ldy) {
    const int64_t es = bf16 ? 2 : 4;
    float acc[MOE_COLS_ROWS][MOE_COLS_TILE];
    for (int64_t r0 = 0; r0 < n; r0 += MOE_COLS_ROWS) {
        const int64_t rn = n - r0 < MOE_COLS_ROWS ? n - r0 : MOE_COLS_ROWS;
        for (int64_t t0 = c0; t0 < c1; t0 += MOE_COLS_TILE) {
            const int64_t tn = c1 - t0 < MOE_COLS_TILE ? c1 - t0 : MOE_COLS_TILE;
            for (int64_t r = 0; r < rn; r++)
                for (int64_t c = 0; c < tn; c++) acc[r][c] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const char *w = W + (k * ldw + t0) * es;
                for (int64_t r = 0; r < rn; r++) {
                    const float xv = moe_at(bf16, x + (r0 + r) * ldx * es, k);
                    float *a = acc[r];
                    if (bf16) {
                        const uint16_t *w16 = (const uint16_t *)w;
                        for (int64_t c = 0; c < tn; c++) a[c] += xv * hkv_bf16_to_f32(w16[c]);
                    } else {
                        const float *w32 = (const float *)w;
                        for (int64_t c = 0; c < tn; c++) a[c] += xv * w32[c];
                    }
                }
            }
            for (int64_t r = 0; r < rn; r++) {
                char *yr = y + ((r0 + r) * ldy + (t0 - c0)) * es;
                for (int64_t c = 0; c < tn; c++) moe_put(bf16, yr, c, acc[r][c]);
            }
        }
    }
}

/* Phase A of expert e, part `part` of its I columns: gate and up of those columns for the
 * expert's rows, then h = silu(gate) * up. Called inside a parallel region: the linears' own
 * OpenMP regions nest there, and run on the calling thread (nesting is off: OpenMP's default,
 * and PyTorch's). */
static void moe_vec_a(const struct moe_vec *s, int64_t e, int64_t part, int64_t split) {
    const int64_t p0 = s->offsets[e], n = s->offsets[e + 1] - p0, H = s->H, I = s->I, es = s->es;
    int64_t c0, c1;
    moe_part(I, part, split, &c0, &c1);
    if (n == 0 || c1 <= c0) return;
    const int64_t rows = s->relu2 ? I : 2 * I; /* of an expert's first weight */
    const char *w = (const char *)s->gate_up + e * rows * H * es, *x = s->xg + p0 * H * es;
    char *g = s->gu + p0 * 2 * I * es;
    if (s->act == MOE_CLAMPED) /* [H, 2I], (gate, up) pairs interleaved: columns 2c0 .. 2c1 */
        moe_linear_cols(s->bf16, x, H, w, 2 * I, n, 2 * c0, 2 * c1, H, g + 2 * c0 * es, 2 * I);
    else
        moe_linear(s->bf16, x, H, w + c0 * H * es, n, c1 - c0, H, g + c0 * es, 2 * I);
    if (!s->relu2 && s->act != MOE_CLAMPED)
        moe_linear(s->bf16, x, H, w + (I + c0) * H * es, n, c1 - c0, H, g + (I + c0) * es,
                   2 * I);
    const char *gb = s->gate_up_bias;
    gb = gb == NULL ? NULL : gb + e * 2 * I * es; /* the expert's interleaved biases */
    for (int64_t r = 0; r < n; r++) { /* h row by row: [n, c1 - c0] at h's row stride I */
        char *gr = g + r * 2 * I * es, *a = s->h + ((p0 + r) * I + c0) * es;
        if (s->act == MOE_CLAMPED)
            moe_clamped(s->bf16, gr, gb, a, c0, c1, s->alpha, s->limit);
        else if (s->relu2)
            hkv_relu2(gr + c0 * es, a, c1 - c0, s->bf16);
        else if (s->bf16)
            hkv_silu_mul_bf16((uint16_t *)gr + c0, 0, (uint16_t *)gr + I + c0, 0, (uint16_t *)a,
                              1, c1 - c0);
        else
            hkv_silu_mul_f32((float *)gr + c0, 0, (float *)gr + I + c0, 0, (float *)a, 1,
                             c1 - c0);
    }
}

/* Phase B of expert e, part `part` of its H columns: Y = h @ down^T for the expert's rows. */
static void moe_vec_b(const struct moe_vec *s, int64_t e, int64_t part, int64_t split) {
    const int64_t p0 = s->offsets[e], n = s->offsets[e + 1] - p0, H = s->H, I = s->I, es = s->es;
    int64_t c0, c1;
    moe_part(H, part, split, &c0, &c1);
    if (n == 0 || c1 <= c0) return;
    const char *w = (const char *)s->down + e * H * I * es;
    if (s->act == MOE_CLAMPED) /* down [I, H] (x @ W) */
        moe_linear_cols(s->bf16, s->h + p0 * I * es, I, w, H, n, c0, c1, I,
                        s->Y + (p0 * H + c0) * es, H);
    else
        moe_linear(s->bf16, s->h + p0 * I * es, I, w + c0 * I * es, n, c1 - c0, I,
                   s->Y + (p0 * H + c0) * es, H);
    if (s->down_bias != NULL)
        for (int64_t r = 0; r < n; r++)
            moe_add_bias(s->bf16, s->Y + (p0 + r) * H * es, (const char *)s->down_bias + e * H * es,
                         c0, c1);
}

/* out[t] (T = 1 row) = the sum of a token's k rows of Y (of out's dtype) times their float32
 * weights, in float32 and rounded once (UngatedExperts: `(h * w).to(float32)` index_add_ into
 * float32 zeros, then `.to(x.dtype)`): rows [k] sorted positions in expert order; acc [H]. */
static void moe_sum_f32(int bf16, void *out, const char *Y, const float *w,
                        const int64_t *order, const int64_t *rows, int64_t k, int64_t H,
                        float *acc) {
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t c = 0; c < H; c++) acc[c] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const char *y = Y + rows[j] * H * es;
        const float wt = w[order[rows[j]]];
        for (int64_t c = 0; c < H; c++) {
            const float v =
                bf16 ? hkv_bf16_to_f32(((const uint16_t *)y)[c]) : ((const float *)y)[c];
            const float p = v * wt; /* (rounded before the sum: no contraction) */
            acc[c] += p;
        }
    }
    for (int64_t c = 0; c < H; c++) {
        if (bf16)
            ((uint16_t *)out)[c] = hkv_f32_to_bf16(acc[c]);
        else
            ((float *)out)[c] = acc[c];
    }
}

/* SwiGLU experts (act MOE_SWIGLU), Nemotron-H's relu2 experts (MOE_RELU2) or gpt-oss's clamped
 * SwiGLU experts with biases (MOE_CLAMPED), every (token, expert) pair of a step in one call:
 *     x        [T, H] rows at a row stride
 *     experts  [T, k] int64, weights [T, k] of x's dtype (relu2: float32)
 *     gate_up  [E, 2I, H] ([gate | up] rows) (relu2: up [E, I, H]), down [E, H, I], contiguous
 *              (clamped: the checkpoint's x @ W layout, gate_up [E, H, 2I] with (gate, up)
 *              column pairs interleaved and down [E, I, H]: moe_linear_cols, no copy)
 *     out      [T, H] rows at a row stride
 *     out[t] = sum over j, in ascending expert order, of
 *              w[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]),   e = experts[t, j]
 *              (relu2: w[t, j] * down_e relu(up_e x[t])^2, summed in float32: moe_sum_f32;
 *              clamped: w[t, j] * (down_e moe_clamped(gate_up_e x[t] + gb_e) + db_e), the
 *              biases gate_up_bias [E, 2I] (interleaved, as gate_up's columns) and down_bias
 *              [E, H] of x's dtype, each NULL for none, added after their product's rounding;
 *              alpha, limit: moe_clamped)
 * all float32 or all bfloat16 (bf16), rounded in bfloat16 as the AMX kernel above (and the
 * PyTorch path's per-expert loop): each product's output, silu before the product with up, the
 * product, y * w and the token's sum after each addition. The pairs are sorted by expert
 * (moe_sort_pairs) and each expert hit runs once on its rows, gathered: [n, H] -> gate_up ->
 * [n, 2I] -> silu * up -> [n, I] -> down -> [n, H]; then each token adds its pairs' rows. At
 * decode sizes (a few rows an expert) each product streams its expert's weight once. One
 * OpenMP region, two phases (gate / up / silu, then down), each a loop of tasks (an expert hit
 * and a range of its output columns, about MOE_TASKS_PER_THREAD a thread; dynamic schedule):
 * one region where a region per product (2-3 an expert hit) stalled on a loaded machine
 * whenever a thread was descheduled. Returns 0, -1 for an expert id
 * outside 0 .. E - 1 (out untouched), -2 without memory for the work space. */
int hkv_moe_experts(const void *x, int64_t x_stride, int64_t T, int64_t H,
                    const int64_t *experts, const void *weights, int64_t k, int64_t E,
                    const void *gate_up, const void *down, int64_t I, int bf16, int act,
                    const void *gate_up_bias, const void *down_bias, float alpha, float limit,
                    void *out, int64_t out_stride) {
    const int relu2 = act == MOE_RELU2;
    const int64_t P = T * k, es = bf16 ? 2 : 4;
    if (T <= 0) return 0;
    const int64_t acc_at = moe_up(P * (2 * H + 3 * I) * es, 64); /* float32 acc [H] (relu2) */
    int64_t *ints = malloc(sizeof(int64_t) * (size_t)(E + 1 + 2 * P + k));
    char *buf = aligned_alloc(64, (size_t)moe_up(acc_at + H * 4, 64) + 64);
    if (ints == NULL || buf == NULL) {
        free(ints), free(buf);
        return -2;
    }
    int64_t *offsets = ints, *order = offsets + E + 1, *pos = order + P, *mine = pos + P;
    if (moe_sort_pairs(experts, P, E, offsets, order, pos) != 0) {
        free(ints), free(buf);
        return -1;
    }
    struct moe_vec s = {bf16, relu2, act, es, H, I, offsets, gate_up, down,
                        gate_up_bias, down_bias, alpha, limit, buf, buf + P * H * es, NULL, NULL};
    s.h = s.gu + P * 2 * I * es, s.Y = s.h + P * I * es;
    const char *X = x;
    for (int64_t p = 0; p < P; p++) /* x's rows in sorted order */
        memcpy(s.xg + p * H * es, X + (order[p] / k) * x_stride * es, (size_t)(H * es));
    int64_t hits = 0;
    for (int64_t e = 0; e < E; e++) hits += offsets[e + 1] > offsets[e];
    const int threads = omp_get_max_threads();
    /* column ranges per expert hit: about MOE_TASKS_PER_THREAD tasks a thread in all */
    int64_t split = (MOE_TASKS_PER_THREAD * threads + hits - 1) / (hits ? hits : 1);
    split = split < 1 ? 1 : split;
#pragma omp parallel if (threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < E * split; i++) moe_vec_a(&s, i / split, i % split, split);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < E * split; i++) moe_vec_b(&s, i / split, i % split, split);
    }
    const char *Y = s.Y;
    const char *W = weights;
    for (int64_t t = 0; t < T; t++) { /* each token's rows, in expert order */
        char *o = (char *)out + t * out_stride * es;
        if (k == 0) memset(o, 0, (size_t)(H * es));
        moe_token_order(pos + t * k, k, mine);
        if (relu2) {
            moe_sum_f32(bf16, o, Y, weights, order, mine, k, H, (float *)(buf + acc_at));
            continue;
        }
        for (int64_t j = 0; j < k; j++)
            moe_add_weighted(bf16, o, Y + mine[j] * H * es, W + order[mine[j]] * es, H, j == 0);
    }
    free(ints), free(buf);
    return 0;
}
