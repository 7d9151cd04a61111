/* Decode attention straight from the paged KV cache (hkv_paged_decode, declared in
 * hybridkv/ops/native/__init__.py and called by `native.paged_decode_attention`): one query
 * per request. Compiled into the one native library with the other C files of this folder.
 *
 *   cache: [num_kernel_blocks, 2, kbs, KVH, Dh] (K at 0, V at 1)
 *   position t of request s -> block block_table[s * table_stride + t / kbs], offset t % kbs
 *
 * Request s attends to positions seq_lens[s] - window .. seq_lens[s] - 1 (from 0 when window
 * is 0, no sliding window, or reaches past the start); no other slot is read, so whatever other
 * slots hold (NaN included) cannot leak; a request with no position gets a zero output.
 * q, out: [S, H, Dh]; the group = H / KVH query heads of a KV head share its keys and values.
 * sinks: [H] or NULL (gpt-oss): one more logit per head in the softmax denominator, no value.
 * softcap: c > 0 caps every score s = scale * q.k to c * tanh(s / c) before the softmax
 * (attention logit soft-capping, Gemma 2); 0: none. The sinks are not capped. Vector paths
 * take tanh(y) = sign(y) (1 - e) / (1 + e), e = e^(-2|y|) by the exponential the softmax uses,
 * and below |y| = HKV_TANH_SMALL (where 1 - e would lose digits) its Taylor polynomial to y^9:
 * relative error below 3e-7 everywhere (a few float32 steps); the plain loops call tanhf.
 * Masked positions stay -inf (capped first, then masked).
 * q, the cache and out are float32, or all bfloat16 (out rounded once, to nearest even, from
 * the float32 result; products and sums float32 either way).
 *
 * One pass over a request's positions, DA_TILE (16) at a time, with an online softmax: for
 * each KV head of a tile, the scores of its query group (each key row read once for all of
 * them), the group's running maxima and sums updated (the weighted sums of V rescaled when a
 * maximum grows), then the weighted rows of V added. K and V of a token are read once, while
 * the tile is in L1; a token's whole row (all KV heads) is used before the next tile's. The
 * next tile's lines are prefetched (to L2) spread over the loops that read this tile's: a K
 * line with each K line the scores read, a V line with each V line the values read; the last
 * tile of a task prefetches the first of the next task. (Issued at once, the prefetches stall
 * the core when the fill buffers run out: 64 requests' 23 MB of bfloat16 K/V from memory took
 * 4.5 ms with each next tile prefetched at once, 2.4 ms spread, 4.4 ms without prefetching.
 * Tiles of 16 positions were 5% faster than 32.)
 *
 * Scores, by what the machine has:
 * - bfloat16 with AMX (even Dh): a tile's K rows are loaded as AMX tiles straight from the
 *   cache (16 positions of one kernel block: consecutive rows; partial or straddling ones via
 *   a staging copy of just their rows) and multiplied by the group's query packed as a B tile:
 *   [positions][heads] float32, exact products of the bfloat16 numbers, float32 sums. The
 *   softmax works on that layout directly (heads of up to 16 lanes, positions along vectors).
 * - AVX-512 otherwise: per position and head, vectors of partial products; 16 positions' sums
 *   formed together by a transpose-and-add tree (3 operations a position, not 8 for each
 *   horizontal sum); bfloat16 keys widened in registers, even and odd elements apart (a shift
 *   and a mask), or vdpbf16ps where there is AVX512-BF16 and no AMX. (vdpbf16ps on the AMX
 *   machine this was written on: 0.45 per cycle against 1.9 FMAs; AMX tiles: 17 cycles for
 *   16 x 16 x 32.)
 * - AVX2 + FMA without AVX-512 (AMD Zen 2/3, most laptops): the AVX-512 path on 8-lane
 *   vectors (see the DA_AVX2 section): 8 positions' sums per transpose-and-add tree, bfloat16
 *   widened even / odd per 16 elements. Against the plain loops it replaced (x86-64-v3 build,
 *   one thread, benchmarks/decode_attention.py): 2.2-3.3x, 64 requests of 32..640 positions
 *   (Qwen3-Next's 8 / 2 heads of 128) 15.8 -> 2.9 ms in bfloat16, 17.8 -> 8.1 ms in float32;
 *   1.0-1.35x the AVX-512 build's time in float32, 1.2-1.7x in bfloat16 (AMX there).
 * - plain loops otherwise.
 * The values are AVX-512 FMAs of the weights with V rows widened in registers, 32 elements of
 * the head dim at a time for up to 8 heads in registers (bfloat16: the sums kept as even
 * elements then odd ones, put back in order at the end); with AVX2, 16 elements for up to 4
 * heads at a time.
 *
 * Threads: requests are tasks; with more than one thread and enough work, requests longer
 * than a piece (total positions / (4 x threads), at least DA_SPLIT_MIN) are split into
 * pieces, each piece's maxima, sums and weighted V kept apart and merged after (so that one
 * long request keeps every thread busy). Below DA_PARALLEL_MIN elements of K the call runs on
 * the calling thread (waking the team costs more than such a step).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hkv_common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define DA_AVX512 HKV_AVX512
#define DA_AVX2 (HKV_AVX2 && !HKV_AVX512) /* the 8-lane path (AVX-512 builds keep theirs) */
#define DA_DOT_BF16 HKV_AVX512_BF16 /* bfloat16 scores as vdpbf16ps dot products (not on AMX) */
#define DA_AMX HKV_AMX_BF16

#define DA_TILE 16                /* positions per tile (one AMX tile's rows) */
#define DA_HEADS 8                /* query heads whose sums of V are in registers together */
#define DA_AMX_HEADS 16           /* query heads per AMX pass (the columns of a tile) */
#define DA_CHUNK 32               /* the sums' head dim is padded to a multiple of this */
#define DA_SPLIT_MIN 256          /* positions: the shortest piece a request is split into */
#define DA_PIECES_PER_THREAD 4    /* pieces per thread the split aims at */
#define DA_PARALLEL_MIN (1 << 17) /* elements of K read (positions x KVH x Dh) */
#define DA_AMX_MIN 128            /* positions x KVH below which AMX does not pay its set-up */
#define DA_INLINE static inline __attribute__((always_inline))

typedef struct {
    const void *cache;
    const int32_t *table; /* the request's row of the block table */
    int bf16, amx;        /* amx: scores on AMX tiles */
    int64_t kbs, KVH, Dh, Dp, H, group, row; /* row: elements of a token (all KV heads) */
    int64_t hp, passes, nbp; /* heads per pass, passes per group; AMX: tile columns (2^k) */
    float scale;
    float cap, inv_cap; /* logit soft-capping: c and 1 / c (cap 0: none) */
} da_shape;

/* A span's state: acc [H][Dp] (sums of e^(s - m) v; with AVX-512 and bfloat16 each 32-chunk
 * holds its even elements, then its odd ones), m [H] (running maxima), l [H] (sums of
 * e^(s - m)). One block of da_state_floats(A) floats, a multiple of 16 (64-byte aligned). */
static inline int64_t da_state_floats(const da_shape *A) {
    return A->H * A->Dp + ((2 * A->H + 15) & ~(int64_t)15);
}

typedef struct { /* one thread's working memory, 64-byte aligned */
    float *rows;  /* AVX-512: [DA_HEADS][DA_TILE][16] partial dot products; AMX: scores
                     [DA_TILE][nbp]; plain: scores [DA_HEADS][DA_TILE] */
    float *p;     /* the tile's softmax weights, in the layout of its scores */
    void *q;      /* the request's query: [H][Dp] float32 or bfloat16, or (AMX) B tiles */
    uint16_t *stage; /* AMX: [16][Dp] rows of a partial tile */
    float *state; /* one span's state */
    float *tmp;   /* [Dp] (merging; widened rows without AVX-512) */
    void *block;
} da_work;

static inline int64_t da_up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* Floats of the query buffer: [H][Dp] float32, or (AMX) per KV head, pass and 32-chunk of
 * the head dim one B tile of 16 rows x nbp pairs of bfloat16 values. */
static inline int64_t da_query_floats(const da_shape *A) {
    const int64_t plain = A->H * A->Dp;
    const int64_t tiles = A->KVH * A->passes * (A->Dp / 32) * 16 * A->nbp;
    return da_up16(A->amx && tiles > plain ? tiles : plain);
}

static int da_work_alloc(const da_shape *A, da_work *w) {
    const int64_t rows = A->amx ? DA_TILE * 16 : DA_HEADS * DA_TILE * 16, p = DA_TILE * 16;
    const int64_t q = da_query_floats(A), stage = da_up16(A->amx ? 8 * A->Dp : 0);
    const int64_t state = da_state_floats(A), tmp = da_up16(A->Dp);
    const size_t bytes = sizeof(float) * (size_t)(rows + p + q + stage + state + tmp);
    float *base = aligned_alloc(64, bytes);
    if (base == NULL) return 0;
    /* partial dot products of positions past a tile's end are summed (then masked): finite */
    if (!A->amx) memset(base, 0, sizeof(float) * (size_t)rows);
    w->block = base;
    w->rows = base;
    w->p = w->rows + rows;
    w->q = w->p + p;
    w->stage = (uint16_t *)((float *)w->q + q);
    w->state = (float *)w->stage + stage;
    w->tmp = w->state + state;
    return 1;
}

/* Element offsets of the K rows (all KV heads) of positions pos .. pos + n - 1. */
static inline void da_offsets(const da_shape *A, int64_t pos, int64_t n, int64_t *off) {
    int64_t b = pos / A->kbs, r = pos % A->kbs;
    for (int64_t i = 0; i < n; i++) {
        off[i] = ((int64_t)A->table[b] * 2 * A->kbs + r) * A->row;
        if (++r == A->kbs) {
            r = 0;
            b++;
        }
    }
}

/* The request's query into w->q. AMX: B tiles, tile (g, pass, c) at 16 * nbp * (c + nchunks *
 * (pass + passes * g)) floats: row r holds, for each column n (head h0 + n of the pass; zeros
 * past its heads), the pair q_h[32c + 2r], q_h[32c + 2r + 1] (zeros past Dh). Else [H][Dp]
 * (zeros past Dh): bfloat16 as it is for vdpbf16ps; float32 otherwise (with AVX-512 and
 * bfloat16: each 32-chunk's even elements, then its odd ones, as the widened keys). */
static void da_load_query(const da_shape *A, const void *q, da_work *w) {
    const int64_t H = A->H, Dh = A->Dh, Dp = A->Dp;
    if (A->amx) {
        const uint16_t *src = q;
        uint16_t *dst = w->q;
        const int64_t nchunks = Dp / 32, cols = 2 * A->nbp, tile = 16 * cols;
        memset(dst, 0, sizeof(uint16_t) * (size_t)(A->KVH * A->passes * nchunks * tile));
        for (int64_t h = 0; h < H; h++) { /* pairs (Dh is even) as 32-bit units */
            const int64_t g = h / A->group, j = h % A->group, pass = j / A->hp, n = j % A->hp;
            uint16_t *t = dst + tile * nchunks * (pass + A->passes * g) + 2 * n;
            for (int64_t r = 0; r < Dh / 2; r++)
                memcpy(t + tile * (r / 16) + cols * (r % 16), src + h * Dh + 2 * r, 4);
        }
        return;
    }
    if (A->bf16 && DA_DOT_BF16) {
        uint16_t *dst = w->q;
        for (int64_t h = 0; h < H; h++) {
            memcpy(dst + h * Dp, (const uint16_t *)q + h * Dh, sizeof(uint16_t) * (size_t)Dh);
            memset(dst + h * Dp + Dh, 0, sizeof(uint16_t) * (size_t)(Dp - Dh));
        }
        return;
    }
    float *dst = w->q;
    memset(dst, 0, sizeof(float) * (size_t)(H * Dp));
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < Dh; d++) {
            const float x = A->bf16 ? hkv_bf16_to_f32(((const uint16_t *)q)[h * Dh + d])
                                    : ((const float *)q)[h * Dh + d];
            int64_t at = d;
            if (A->bf16 && DA_AVX512) /* even elements of the chunk first, then odd ones */
                at = (d & ~(int64_t)31) + (d & 1) * 16 + ((d & 31) >> 1);
            else if (A->bf16 && DA_AVX2) /* the same per 16-chunk (8 even, then 8 odd) */
                at = (d & ~(int64_t)15) + (d & 1) * 8 + ((d & 15) >> 1);
            dst[h * Dp + at] = x;
        }
}

/* A call with the number of heads nh (1 .. DA_HEADS) as a constant. */
#define DA_BY_HEADS(CALL)                                                                      \
    switch (nh) {                                                                              \
    case 1: CALL(1); break;                                                                    \
    case 2: CALL(2); break;                                                                    \
    case 3: CALL(3); break;                                                                    \
    case 4: CALL(4); break;                                                                    \
    case 5: CALL(5); break;                                                                    \
    case 6: CALL(6); break;                                                                    \
    case 7: CALL(7); break;                                                                    \
    default: CALL(8); break;                                                                   \
    }

#if DA_AVX512

static inline __m512 da_exp16(__m512 x) { /* hkv_exp_nonpositive of 16 lanes (with FMAs) */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* (NaN stays NaN) */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333338e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666668e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

static inline __mmask16 da_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Soft-capped scores of 16 lanes: c * tanh(x / c) (see the top of this file). */
static inline __m512 da_softcap16(__m512 x, float cap, float inv_cap) {
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(inv_cap)), one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    const __m512i ybits = _mm512_castps_si512(y);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, ybits)); /* |y| */
    /* (each branch only where a lane needs it: with caps well above the scores, as Gemma 2's
     * 50, every lane takes the polynomial) */
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(HKV_TANH_SMALL), _CMP_LT_OQ);
    __m512 t = a;
    if (small != 0xffff) {
        const __m512 e = da_exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
        t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    }
    if (small) {
        const __m512 a2 = _mm512_mul_ps(a, a);
        __m512 p = _mm512_fmadd_ps(a2, _mm512_set1_ps(HKV_TANH_T9), _mm512_set1_ps(HKV_TANH_T7));
        p = _mm512_fmadd_ps(a2, p, _mm512_set1_ps(HKV_TANH_T5));
        p = _mm512_fmadd_ps(a2, p, _mm512_set1_ps(HKV_TANH_T3));
        p = _mm512_fmadd_ps(a2, p, one);
        t = _mm512_mask_mul_ps(t, small, a, p);
    }
    const __m512i tbits = _mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign, ybits));
    return _mm512_mul_ps(_mm512_castsi512_ps(tbits), _mm512_set1_ps(cap));
}

/* The weights' rescale when maxima grow: acc row of head h times alpha, l[h] too. */
static inline void da_rescale(float *acc, int64_t Dp, float *l, float alpha) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < Dp; d += 16)
        _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), av));
    *l *= alpha;
}

/* acc[h] += sum_i p(h, i) v_i for nh heads over n positions, 32 elements of the head dim at a
 * time, their sums in registers. p(h, i): p[h * DA_TILE + i] (rows layout) or p[i * pt + h]
 * (cols: the AMX scores' layout). The V row of position i (KV head at hoff): off[i] + voff.
 * Each V line read comes with a prefetch of the same line of V in position i of the next tile
 * (pf, its first npf positions). */
DA_INLINE void da_values(const da_shape *A, const int64_t *off, int64_t hoff, int64_t n,
                         const float *p, const int cols, int64_t pt, const int nh, float *acc,
                         const int64_t *pf, int64_t npf) {
    const int64_t Dh = A->Dh, Dp = A->Dp, voff = A->kbs * A->row + hoff;
    for (int64_t d = 0; d < Dh; d += 32) {
        __m512 e[DA_HEADS], o[DA_HEADS];
        for (int h = 0; h < nh; h++) {
            e[h] = _mm512_load_ps(acc + h * Dp + d);
            o[h] = _mm512_load_ps(acc + h * Dp + d + 16);
        }
        if (A->bf16) {
            const uint16_t *cache = A->cache;
            const __mmask32 m = Dh - d >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (Dh - d)) - 1);
            const __m512i high = _mm512_set1_epi32((int)0xffff0000);
            for (int64_t i = 0; i < n; i++) {
                const uint16_t *next = cache + (i < npf ? pf[i] : off[i]) + hoff + d;
                _mm_prefetch((const char *)(next + A->kbs * A->row), _MM_HINT_T1);
                const __m512i v = _mm512_maskz_loadu_epi16(m, cache + off[i] + voff + d);
                const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                const float *pi = cols ? p + i * pt : p + i;
                for (int h = 0; h < nh; h++) {
                    const __m512 pb = _mm512_set1_ps(cols ? pi[h] : pi[h * DA_TILE]);
                    e[h] = _mm512_fmadd_ps(pb, ve, e[h]);
                    o[h] = _mm512_fmadd_ps(pb, vo, o[h]);
                }
            }
        } else {
            const float *cache = A->cache;
            const __mmask16 m0 = da_mask16(Dh - d), m1 = da_mask16(Dh - d - 16);
            for (int64_t i = 0; i < n; i++) {
                const float *next = cache + (i < npf ? pf[i] : off[i]) + hoff + d;
                const float *v = cache + off[i] + voff + d;
                _mm_prefetch((const char *)(next + A->kbs * A->row), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + A->kbs * A->row + 16), _MM_HINT_T1);
                const __m512 v0 = _mm512_maskz_loadu_ps(m0, v);
                const __m512 v1 = _mm512_maskz_loadu_ps(m1, v + 16);
                const float *pi = cols ? p + i * pt : p + i;
                for (int h = 0; h < nh; h++) {
                    const __m512 pb = _mm512_set1_ps(cols ? pi[h] : pi[h * DA_TILE]);
                    e[h] = _mm512_fmadd_ps(pb, v0, e[h]);
                    o[h] = _mm512_fmadd_ps(pb, v1, o[h]);
                }
            }
        }
        for (int h = 0; h < nh; h++) {
            _mm512_store_ps(acc + h * Dp + d, e[h]);
            _mm512_store_ps(acc + h * Dp + d + 16, o[h]);
        }
    }
}

/* Lane i = the sum of the 16 floats at r + 16 i (a transpose-and-add tree: 30 shuffles and
 * 15 additions for 16 sums; each lane only ever adds its own row's numbers). */
static inline __m512 da_sum16(const float *r) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_load_ps(r + 16 * i);
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* rows 2i, 2i+1: per 128-bit lane [x02 y02 x13 y13] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* rows 4i .. 4i+3: per 128-bit lane, that lane's sums */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                    _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                    _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
}

/* s[h] += q_h . k over elements d .. d + 31 (kv: those of k, bfloat16). */
DA_INLINE void da_dot_chunk(__m512i kv, const void *qv, int64_t d, int64_t Dp, const int nh,
                            __m512 *s) {
#if DA_DOT_BF16
    const uint16_t *q = qv;
    for (int h = 0; h < nh; h++)
        s[h] = _mm512_dpbf16_ps(s[h], (__m512bh)kv, (__m512bh)_mm512_load_si512(q + h * Dp + d));
#else
    const float *q = qv;
    const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(kv, 16));
    const __m512 ko =
        _mm512_castsi512_ps(_mm512_and_si512(kv, _mm512_set1_epi32((int)0xffff0000)));
    for (int h = 0; h < nh; h++) {
        s[h] = _mm512_fmadd_ps(ke, _mm512_load_ps(q + h * Dp + d), s[h]);
        s[h] = _mm512_fmadd_ps(ko, _mm512_load_ps(q + h * Dp + d + 16), s[h]);
    }
#endif
}

/* Partial dot products of nh query heads with the keys of n positions (KV head at hoff):
 * rows[(h * DA_TILE + i) * 16 ..] for head h, position i. */
DA_INLINE void da_dots(const da_shape *A, const int64_t *off, int64_t hoff, int64_t n,
                       const void *qv, const int nh, float *rows, const int64_t *pf,
                       int64_t npf) {
    const int64_t Dh = A->Dh, Dp = A->Dp;
    if (!A->bf16) {
        const float *cache = A->cache, *q = qv;
        const int64_t full = Dh & ~(int64_t)15;
        const __mmask16 tail = da_mask16(Dh - full);
        for (int64_t i = 0; i < n; i++) {
            const float *k = cache + off[i] + hoff;
            const float *next = cache + (i < npf ? pf[i] : off[i]) + hoff;
            __m512 s[DA_HEADS];
            for (int h = 0; h < nh; h++) s[h] = _mm512_setzero_ps();
            for (int64_t d = 0; d < full; d += 16) {
                _mm_prefetch((const char *)(next + d), _MM_HINT_T1);
                const __m512 kv = _mm512_loadu_ps(k + d);
                for (int h = 0; h < nh; h++)
                    s[h] = _mm512_fmadd_ps(kv, _mm512_load_ps(q + h * Dp + d), s[h]);
            }
            if (tail) {
                _mm_prefetch((const char *)(next + full), _MM_HINT_T1);
                const __m512 kv = _mm512_maskz_loadu_ps(tail, k + full);
                for (int h = 0; h < nh; h++)
                    s[h] = _mm512_fmadd_ps(kv, _mm512_load_ps(q + h * Dp + full), s[h]);
            }
            for (int h = 0; h < nh; h++) _mm512_store_ps(rows + (h * DA_TILE + i) * 16, s[h]);
        }
        return;
    }
    const uint16_t *cache = A->cache;
    const int64_t full = Dh & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((1ull << (Dh - full)) - 1);
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *k = cache + off[i] + hoff;
        const uint16_t *next = cache + (i < npf ? pf[i] : off[i]) + hoff;
        __m512 s[DA_HEADS];
        for (int h = 0; h < nh; h++) s[h] = _mm512_setzero_ps();
        for (int64_t d = 0; d < full; d += 32) {
            _mm_prefetch((const char *)(next + d), _MM_HINT_T1);
            da_dot_chunk(_mm512_loadu_si512(k + d), qv, d, Dp, nh, s);
        }
        if (tail) {
            _mm_prefetch((const char *)(next + full), _MM_HINT_T1);
            da_dot_chunk(_mm512_maskz_loadu_epi16(tail, k + full), qv, full, Dp, nh, s);
        }
        for (int h = 0; h < nh; h++) _mm512_store_ps(rows + (h * DA_TILE + i) * 16, s[h]);
    }
}

/* The online softmax step of nh heads over a tile of n positions, scores from da_dots' rows:
 * maxima m and sums l updated (acc rescaled when a maximum grows), weights into p (rows
 * layout: p[h * DA_TILE + i]). */
static void da_softmax_rows(const da_shape *A, int64_t n, int64_t nh, const float *rows,
                            float *m, float *l, float *acc, float *p) {
    const __mmask16 valid = da_mask16(n);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(A->scale);
    for (int64_t h = 0; h < nh; h++) {
        __m512 x = _mm512_mul_ps(da_sum16(rows + h * 256), scale);
        if (A->cap > 0.0f) x = da_softcap16(x, A->cap, A->inv_cap);
        const __m512 s = _mm512_mask_mov_ps(ninf, valid, x);
        const float top = _mm512_reduce_max_ps(s);
        if (top > m[h]) {
            if (m[h] != -INFINITY)
                da_rescale(acc + h * A->Dp, A->Dp, l + h, hkv_exp_nonpositive(m[h] - top));
            m[h] = top;
        }
        const __m512 e = da_exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[h])));
        const __m512 pv = _mm512_maskz_mov_ps(valid, e);
        l[h] += _mm512_reduce_add_ps(pv);
        _mm512_store_ps(p + h * DA_TILE, pv);
    }
}

#if DA_AMX

/* Tiles: 0 the scores of a tile's 16 positions ([16][nbp] float32), 1 their keys (16 rows of
 * 32 bfloat16 values), 2 the query (16 pairs x nbp); 3, 4 keys and query for the last chunk
 * of tail (< 32, even) elements of the head dim. */
static void da_tiles(const da_shape *A) {
    const int64_t tail = A->Dh % 32;
    struct hkv_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(4 * A->nbp);
    cfg.rows[1] = 16, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(4 * A->nbp);
    if (tail) {
        cfg.rows[3] = 16, cfg.colsb[3] = (uint16_t)(2 * tail);
        cfg.rows[4] = (uint8_t)(tail / 2), cfg.colsb[4] = (uint16_t)(4 * A->nbp);
    }
    _tile_loadconfig(&cfg);
}

/* Whether the 16 positions at off are consecutive rows (of one kernel block). Every step
 * is checked: the ends alone can be 15 rows apart across three blocks (kbs 8, from offset 1:
 * 7 rows of block X, 8 of Y, row 0 of block X + 1), with V rows in between. */
static inline int da_consecutive16(const da_shape *A, const int64_t *off) {
    int same = 1;
    for (int64_t i = 1; i < 16; i++) same &= off[i] - off[i - 1] == A->row;
    return same;
}

/* Where the keys of a tile's n positions are read from, and their row stride in bytes:
 * straight from the cache when all 16 are consecutive rows of one kernel block, else copied
 * (the n valid rows only; zeros after) to stage. */
static const uint16_t *da_key_rows(const da_shape *A, const int64_t *off, int64_t n,
                                   int64_t hoff, uint16_t *stage, int64_t *stride) {
    const uint16_t *cache = A->cache;
    if (n == 16 && da_consecutive16(A, off)) {
        *stride = 2 * A->row;
        return cache + off[0] + hoff;
    }
    for (int64_t i = 0; i < 16; i++) {
        if (i < n)
            memcpy(stage + i * A->Dp, cache + off[i] + hoff, sizeof(uint16_t) * (size_t)A->Dh);
        else
            memset(stage + i * A->Dp, 0, sizeof(uint16_t) * (size_t)A->Dh);
    }
    *stride = 2 * A->Dp;
    return stage;
}

/* The line at element at of the K rows of the next tile's npf positions. */
static inline void da_prefetch_keys(const da_shape *A, const int64_t *pf, int64_t npf,
                                    int64_t at) {
    for (int64_t i = 0; i < npf; i++)
        _mm_prefetch((const char *)((const uint16_t *)A->cache + pf[i] + at), _MM_HINT_T1);
}

/* Scores of a tile's n positions for one pass of KV head g: sc[i * nbp + j] = q_j . k_i
 * (unscaled; rows of positions past n: zeros). */
static void da_scores_amx(const da_shape *A, const int64_t *off, int64_t n, int64_t g,
                          int64_t pass, const uint16_t *qt, uint16_t *stage, float *sc,
                          const int64_t *pf, int64_t npf) {
    const int64_t hoff = g * A->Dh, nchunks = A->Dp / 32, full = A->Dh / 32;
    const int64_t tail = A->Dh % 32, bstride = 4 * A->nbp;
    const uint16_t *b = qt + 32 * A->nbp * nchunks * (pass + A->passes * g);
    int64_t ks = 0;
    const uint16_t *k = da_key_rows(A, off, n, hoff, stage, &ks);
    _tile_zero(0);
    for (int64_t c = 0; c < full; c++) {
        da_prefetch_keys(A, pf, npf, hoff + 32 * c);
        _tile_loadd(2, b + 32 * A->nbp * c, bstride);
        _tile_loadd(1, k + 32 * c, ks);
        _tile_dpbf16ps(0, 1, 2);
    }
    if (tail) {
        da_prefetch_keys(A, pf, npf, hoff + 32 * full);
        _tile_loadd(4, b + 32 * A->nbp * full, bstride);
        _tile_loadd(3, k + 32 * full, ks);
        _tile_dpbf16ps(0, 3, 4);
    }
    _tile_stored(0, sc, bstride);
}

/* v with each lane replaced by the max (or sum) of the lanes that share its index modulo nbp
 * (xor-butterflies over the higher index bits). */
static inline __m512 da_fold(__m512 v, int64_t nbp, int max) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int sh = 8; sh >= nbp; sh >>= 1) {
        const __m512 w = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(sh)), v);
        v = max ? _mm512_max_ps(v, w) : _mm512_add_ps(v, w);
    }
    return v;
}

/* The online softmax step of nh heads over a tile of n positions, scores from the AMX tiles
 * ([position][nbp]): maxima m, sums l (acc rescaled when a maximum grows), weights into p in
 * the same layout. Each vector holds 16 / nbp positions of all the pass's heads. */
static void da_softmax_cols(const da_shape *A, int64_t n, int64_t nh, const float *sc,
                            float *m, float *l, float *acc, float *p) {
    const int64_t nbp = A->nbp, nv = (n * nbp + 15) / 16;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i col = _mm512_and_si512(lane, _mm512_set1_epi32((int)nbp - 1));
    const __mmask16 heads = _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32((int)nh));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(A->scale);
    __m512 s[DA_TILE * DA_AMX_HEADS / 16], top = ninf; /* nv <= nbp vectors */
    for (int64_t v = 0; v < nv; v++) {
        const __mmask16 valid = heads & da_mask16(n * nbp - 16 * v);
        __m512 x = _mm512_mul_ps(_mm512_load_ps(sc + 16 * v), scale);
        if (A->cap > 0.0f) x = da_softcap16(x, A->cap, A->inv_cap);
        s[v] = _mm512_mask_mov_ps(ninf, valid, x);
        top = _mm512_max_ps(top, s[v]);
    }
    top = da_fold(top, nbp, 1);
    /* the old maxima, lane i holding head i mod nbp's */
    const __m512 old = _mm512_permutexvar_ps(col, _mm512_mask_loadu_ps(ninf, da_mask16(nh), m));
    const __m512 mx = _mm512_max_ps(old, top);
    const __mmask16 grew = _mm512_mask_cmp_ps_mask(heads & da_mask16(nbp), mx, old, _CMP_GT_OQ);
    if (grew) {
        float alpha[16], olds[16];
        _mm512_storeu_ps(alpha, da_exp16(_mm512_sub_ps(old, mx)));
        _mm512_storeu_ps(olds, old);
        for (int64_t h = 0; h < nh; h++)
            if ((grew >> h) & 1 && olds[h] != -INFINITY)
                da_rescale(acc + h * A->Dp, A->Dp, l + h, alpha[h]);
        _mm512_mask_storeu_ps(m, da_mask16(nh), mx);
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t v = 0; v < nv; v++) {
        const __m512 pv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[v], ninf, _CMP_NEQ_OQ),
                                              da_exp16(_mm512_sub_ps(s[v], mx)));
        _mm512_store_ps(p + 16 * v, pv);
        total = _mm512_add_ps(total, pv);
    }
    total = da_fold(total, nbp, 0);
    _mm512_mask_storeu_ps(l, da_mask16(nh),
                          _mm512_add_ps(_mm512_maskz_loadu_ps(da_mask16(nh), l), total));
}

#endif /* DA_AMX */

/* One tile, one pass (query heads h0 .. h0 + nh - 1) of KV head g: scores, softmax, values.
 * pf, npf: the next tile's offsets (prefetched during the first pass). */
static void da_group(const da_shape *A, const int64_t *off, int64_t n, int64_t g, int64_t pass,
                     float *m, float *l, float *acc, da_work *w, const int64_t *pf,
                     int64_t npf) {
    const int64_t h0 = g * A->group + pass * A->hp, hoff = g * A->Dh, Dp = A->Dp;
    const int64_t heads = A->group - pass * A->hp < A->hp ? A->group - pass * A->hp : A->hp;
    if (pass > 0) {
        npf = 0;
    } else { /* this tile's V lines (prefetched to L2 a tile ago) into L1 during the scores */
        const int64_t elem = A->bf16 ? 2 : 4, bytes = A->Dh * elem;
        for (int64_t i = 0; i < n; i++) {
            const char *v = (const char *)A->cache + (off[i] + A->kbs * A->row + hoff) * elem;
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
        }
    }
#if DA_AMX
    if (A->amx) {
        da_scores_amx(A, off, n, g, pass, w->q, w->stage, w->rows, pf, npf);
        da_softmax_cols(A, n, heads, w->rows, m + h0, l + h0, acc + h0 * Dp, w->p);
        for (int64_t j0 = 0; j0 < heads; j0 += DA_HEADS) {
            const int64_t nh = heads - j0 < DA_HEADS ? heads - j0 : DA_HEADS;
            float *a = acc + (h0 + j0) * Dp;
#define DA_VALUES_COLS(NH) da_values(A, off, hoff, n, w->p + j0, 1, A->nbp, NH, a, pf, npf)
            DA_BY_HEADS(DA_VALUES_COLS)
#undef DA_VALUES_COLS
            npf = 0;
        }
        return;
    }
#endif
    const int64_t nh = heads;
    const void *qh = A->bf16 && DA_DOT_BF16 ? (const void *)((const uint16_t *)w->q + h0 * Dp)
                                            : (const void *)((const float *)w->q + h0 * Dp);
#define DA_DOTS(NH) da_dots(A, off, hoff, n, qh, NH, w->rows, pf, npf)
    DA_BY_HEADS(DA_DOTS)
#undef DA_DOTS
    da_softmax_rows(A, n, nh, w->rows, m + h0, l + h0, acc + h0 * Dp, w->p);
#define DA_VALUES_ROWS(NH) da_values(A, off, hoff, n, w->p, 0, 0, NH, acc + h0 * Dp, pf, npf)
    DA_BY_HEADS(DA_VALUES_ROWS)
#undef DA_VALUES_ROWS
}

#elif DA_AVX2 /* AVX2 + FMA: the same tiles on 8-lane vectors */

/* The AVX-512 path's structure on 16 ymm registers: partial dot products of 8 lanes per
 * (head, position), 8 positions' sums formed together by a transpose-and-add tree, bfloat16
 * keys and values widened in registers even and odd elements apart (a shift and a mask of 16
 * values; the query and the sums keep each 16-chunk's 8 even elements, then its 8 odd ones),
 * and the sums of V in registers for 4 heads at a time (8 of the 16 registers; a group of more
 * heads takes two rounds over the tile's V rows, from L1). Tails of the head dim (Dh not a
 * multiple of 16) are read with vmaskmovps (float32) or through a zeroed 16-value copy
 * (bfloat16): never past the row, whose next values may be another slot's NaN. */

#define DA_AVX2_HEADS 4 /* heads whose sums of V are in registers together */

static inline void da_rescale(float *acc, int64_t Dp, float *l, float alpha) {
    const __m256 av = _mm256_set1_ps(alpha);
    for (int64_t d = 0; d < Dp; d += 8)
        _mm256_store_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(acc + d), av));
    *l *= alpha;
}

/* 16 bfloat16 values at k (n < 16: the first n, zeros after) */
static inline __m256i da_load16_bf16(const uint16_t *k, int64_t n) {
    if (n >= 16) return _mm256_loadu_si256((const __m256i *)k);
    uint16_t buf[16] __attribute__((aligned(32))) = {0};
    memcpy(buf, k, sizeof(uint16_t) * (size_t)n);
    return _mm256_load_si256((const __m256i *)buf);
}

/* s[h] += q_h . k over a 16-chunk of bfloat16 keys at element d (q: [nh][Dp], 8 even elements
 * of the chunk then its 8 odd ones); the odd products go to t[h] when two (two chains). */
DA_INLINE void da_dot16_bf16(__m256i kv, const float *q, int64_t d, int64_t Dp, const int nh,
                             const int two, __m256 *s, __m256 *t) {
    const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(kv, 16));
    const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(kv, _mm256_set1_epi32((int)0xffff0000)));
    for (int h = 0; h < nh; h++) {
        s[h] = _mm256_fmadd_ps(ke, _mm256_load_ps(q + h * Dp + d), s[h]);
        if (two)
            t[h] = _mm256_fmadd_ps(ko, _mm256_load_ps(q + h * Dp + d + 8), t[h]);
        else
            s[h] = _mm256_fmadd_ps(ko, _mm256_load_ps(q + h * Dp + d + 8), s[h]);
    }
}

/* Partial dot products of nh query heads with the keys of n positions (KV head at hoff):
 * rows[(h * DA_TILE + i) * 8 ..] for head h, position i. Up to 4 heads keep two sets of sums
 * (the FMA latency is 4 cycles: one chain per head leaves the units idle). */
DA_INLINE void da_dots(const da_shape *A, const int64_t *off, int64_t hoff, int64_t n,
                       const float *q, const int nh, float *rows, const int64_t *pf,
                       int64_t npf) {
    const int64_t Dh = A->Dh, Dp = A->Dp;
    const int two = nh <= 4;
    if (!A->bf16) {
        const float *cache = A->cache;
        const int64_t full = Dh & ~(int64_t)15, rem = Dh - full;
        const __m256i m0 = hkv_mask8(rem), m1 = hkv_mask8(rem - 8);
        for (int64_t i = 0; i < n; i++) {
            const float *k = cache + off[i] + hoff;
            const float *next = cache + (i < npf ? pf[i] : off[i]) + hoff;
            __m256 s[DA_HEADS], t[DA_HEADS];
            for (int h = 0; h < nh; h++) s[h] = t[h] = _mm256_setzero_ps();
            for (int64_t d = 0; d < full; d += 16) { /* one 64-byte line */
                _mm_prefetch((const char *)(next + d), _MM_HINT_T1);
                const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
                for (int h = 0; h < nh; h++) {
                    s[h] = _mm256_fmadd_ps(k0, _mm256_load_ps(q + h * Dp + d), s[h]);
                    if (two)
                        t[h] = _mm256_fmadd_ps(k1, _mm256_load_ps(q + h * Dp + d + 8), t[h]);
                    else
                        s[h] = _mm256_fmadd_ps(k1, _mm256_load_ps(q + h * Dp + d + 8), s[h]);
                }
            }
            if (rem) {
                _mm_prefetch((const char *)(next + full), _MM_HINT_T1);
                const __m256 k0 = _mm256_maskload_ps(k + full, m0);
                const __m256 k1 = _mm256_maskload_ps(k + full + 8, m1);
                for (int h = 0; h < nh; h++) {
                    s[h] = _mm256_fmadd_ps(k0, _mm256_load_ps(q + h * Dp + full), s[h]);
                    s[h] = _mm256_fmadd_ps(k1, _mm256_load_ps(q + h * Dp + full + 8), s[h]);
                }
            }
            for (int h = 0; h < nh; h++)
                _mm256_store_ps(rows + (h * DA_TILE + i) * 8, _mm256_add_ps(s[h], t[h]));
        }
        return;
    }
    const uint16_t *cache = A->cache;
    const int64_t full = Dh & ~(int64_t)31;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *k = cache + off[i] + hoff;
        const uint16_t *next = cache + (i < npf ? pf[i] : off[i]) + hoff;
        __m256 s[DA_HEADS], t[DA_HEADS];
        for (int h = 0; h < nh; h++) s[h] = t[h] = _mm256_setzero_ps();
        for (int64_t d = 0; d < full; d += 32) { /* one 64-byte line, two chunks */
            _mm_prefetch((const char *)(next + d), _MM_HINT_T1);
            da_dot16_bf16(_mm256_loadu_si256((const __m256i *)(k + d)), q, d, Dp, nh, two, s, t);
            da_dot16_bf16(_mm256_loadu_si256((const __m256i *)(k + d + 16)), q, d + 16, Dp, nh,
                          two, s, t);
        }
        if (full < Dh) {
            _mm_prefetch((const char *)(next + full), _MM_HINT_T1);
            for (int64_t d = full; d < Dh; d += 16)
                da_dot16_bf16(da_load16_bf16(k + d, Dh - d), q, d, Dp, nh, two, s, t);
        }
        for (int h = 0; h < nh; h++)
            _mm256_store_ps(rows + (h * DA_TILE + i) * 8, _mm256_add_ps(s[h], t[h]));
    }
}

/* Lane i = the sum of the 8 floats at r + 8 i (a transpose-and-add tree: 6 vhaddps, 2
 * vperm2f128 and one add for 8 sums; each lane only ever adds its own row's numbers). */
static inline __m256 da_sum8(const float *r) {
    const __m256 a0 = _mm256_hadd_ps(_mm256_load_ps(r), _mm256_load_ps(r + 8));
    const __m256 a1 = _mm256_hadd_ps(_mm256_load_ps(r + 16), _mm256_load_ps(r + 24));
    const __m256 a2 = _mm256_hadd_ps(_mm256_load_ps(r + 32), _mm256_load_ps(r + 40));
    const __m256 a3 = _mm256_hadd_ps(_mm256_load_ps(r + 48), _mm256_load_ps(r + 56));
    /* 128-bit lane 0: rows 0..3's sums of elements 0..3 (lane 1: of 4..7); b1: rows 4..7 */
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                         _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Soft-capped scores of 8 lanes: c * tanh(x / c) (see the top of this file). */
static inline __m256 da_softcap8(__m256 x, float cap, float inv_cap) {
    const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(inv_cap)), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f), a = _mm256_andnot_ps(sign, y); /* |y| */
    const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(HKV_TANH_SMALL), _CMP_LT_OQ);
    const int lanes = _mm256_movemask_ps(small); /* (each branch only where a lane needs it) */
    __m256 t = a;
    if (lanes != 0xff) {
        const __m256 e = hkv_exp8_nonpositive(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
        t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    }
    if (lanes) {
        const __m256 a2 = _mm256_mul_ps(a, a);
        __m256 p = _mm256_fmadd_ps(a2, _mm256_set1_ps(HKV_TANH_T9), _mm256_set1_ps(HKV_TANH_T7));
        p = _mm256_fmadd_ps(a2, p, _mm256_set1_ps(HKV_TANH_T5));
        p = _mm256_fmadd_ps(a2, p, _mm256_set1_ps(HKV_TANH_T3));
        p = _mm256_fmadd_ps(a2, p, one);
        t = _mm256_blendv_ps(t, _mm256_mul_ps(a, p), small);
    }
    return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, y)), _mm256_set1_ps(cap));
}

/* Scaled (and soft-capped) scores of 8 positions from da_dots' rows. */
static inline __m256 da_scores8(const da_shape *A, const float *r, __m256 scale) {
    const __m256 x = _mm256_mul_ps(da_sum8(r), scale);
    return A->cap > 0.0f ? da_softcap8(x, A->cap, A->inv_cap) : x;
}

/* The online softmax step of nh heads over a tile of n positions (da_softmax_rows of the
 * AVX-512 path, two vectors of 8 positions). */
static void da_softmax_rows(const da_shape *A, int64_t n, int64_t nh, const float *rows,
                            float *m, float *l, float *acc, float *p) {
    const __m256 v0 = _mm256_castsi256_ps(hkv_mask8(n)), v1 = _mm256_castsi256_ps(hkv_mask8(n - 8));
    const __m256 ninf = _mm256_set1_ps(-INFINITY), scale = _mm256_set1_ps(A->scale);
    for (int64_t h = 0; h < nh; h++) {
        const float *r = rows + h * DA_TILE * 8;
        const __m256 s0 = _mm256_blendv_ps(ninf, da_scores8(A, r, scale), v0);
        const __m256 s1 = n > 8 ? _mm256_blendv_ps(ninf, da_scores8(A, r + 64, scale), v1) : ninf;
        const float top = hkv_hmax8(_mm256_max_ps(s0, s1));
        if (top > m[h]) {
            if (m[h] != -INFINITY)
                da_rescale(acc + h * A->Dp, A->Dp, l + h, hkv_exp_nonpositive(m[h] - top));
            m[h] = top;
        }
        const __m256 mh = _mm256_set1_ps(m[h]);
        const __m256 p0 = _mm256_and_ps(v0, hkv_exp8_nonpositive(_mm256_sub_ps(s0, mh)));
        const __m256 p1 = _mm256_and_ps(v1, hkv_exp8_nonpositive(_mm256_sub_ps(s1, mh)));
        l[h] += hkv_hsum8(_mm256_add_ps(p0, p1));
        _mm256_store_ps(p + h * DA_TILE, p0);
        _mm256_store_ps(p + h * DA_TILE + 8, p1);
    }
}

/* acc[h] += sum_i p[h * DA_TILE + i] v_i for nh (<= 4) heads over n positions, 16 elements of
 * the head dim at a time (bfloat16: 8 even, 8 odd), their sums in registers. The V row of
 * position i: off[i] + voff. Each V line read comes with a prefetch of the same line of V in
 * position i of the next tile (pf, its first npf positions; none when npf < 0). */
DA_INLINE void da_values4(const da_shape *A, const int64_t *off, int64_t hoff, int64_t n,
                          const float *p, const int nh, float *acc, const int64_t *pf,
                          int64_t npf) {
    const int64_t Dh = A->Dh, Dp = A->Dp, voff = A->kbs * A->row + hoff;
    const int fetch = npf >= 0;
    for (int64_t d = 0; d < Dh; d += 16) {
        __m256 e[DA_AVX2_HEADS], o[DA_AVX2_HEADS];
        for (int h = 0; h < nh; h++) {
            e[h] = _mm256_load_ps(acc + h * Dp + d);
            o[h] = _mm256_load_ps(acc + h * Dp + d + 8);
        }
        const int64_t left = Dh - d;
        if (A->bf16) {
            const uint16_t *cache = A->cache;
            const int line = fetch && (d & 31) == 0; /* 32 values a line */
            const __m256i high = _mm256_set1_epi32((int)0xffff0000);
            for (int64_t i = 0; i < n; i++) {
                if (line) {
                    const uint16_t *next = cache + (i < npf ? pf[i] : off[i]) + hoff + d;
                    _mm_prefetch((const char *)(next + A->kbs * A->row), _MM_HINT_T1);
                }
                const __m256i v = da_load16_bf16(cache + off[i] + voff + d, left);
                const __m256 ve = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 vo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int h = 0; h < nh; h++) {
                    const __m256 pb = _mm256_broadcast_ss(p + h * DA_TILE + i);
                    e[h] = _mm256_fmadd_ps(pb, ve, e[h]);
                    o[h] = _mm256_fmadd_ps(pb, vo, o[h]);
                }
            }
        } else {
            const float *cache = A->cache;
            const __m256i m0 = hkv_mask8(left), m1 = hkv_mask8(left - 8);
            for (int64_t i = 0; i < n; i++) {
                if (fetch) {
                    const float *next = cache + (i < npf ? pf[i] : off[i]) + hoff + d;
                    _mm_prefetch((const char *)(next + A->kbs * A->row), _MM_HINT_T1);
                }
                const float *v = cache + off[i] + voff + d;
                __m256 v0, v1;
                if (left >= 16) {
                    v0 = _mm256_loadu_ps(v);
                    v1 = _mm256_loadu_ps(v + 8);
                } else {
                    v0 = _mm256_maskload_ps(v, m0);
                    v1 = _mm256_maskload_ps(v + 8, m1);
                }
                for (int h = 0; h < nh; h++) {
                    const __m256 pb = _mm256_broadcast_ss(p + h * DA_TILE + i);
                    e[h] = _mm256_fmadd_ps(pb, v0, e[h]);
                    o[h] = _mm256_fmadd_ps(pb, v1, o[h]);
                }
            }
        }
        for (int h = 0; h < nh; h++) {
            _mm256_store_ps(acc + h * Dp + d, e[h]);
            _mm256_store_ps(acc + h * Dp + d + 8, o[h]);
        }
    }
}

/* da_values4 over nh (<= DA_HEADS) heads: four, then the rest (prefetching once). */
DA_INLINE void da_values(const da_shape *A, const int64_t *off, int64_t hoff, int64_t n,
                         const float *p, const int nh, float *acc, const int64_t *pf,
                         int64_t npf) {
    da_values4(A, off, hoff, n, p, nh < DA_AVX2_HEADS ? nh : DA_AVX2_HEADS, acc, pf, npf);
    if (nh > DA_AVX2_HEADS)
        da_values4(A, off, hoff, n, p + DA_AVX2_HEADS * DA_TILE, nh - DA_AVX2_HEADS,
                   acc + DA_AVX2_HEADS * A->Dp, pf, -1);
}

/* One tile, one pass (query heads h0 .. h0 + nh - 1) of KV head g: scores, softmax, values.
 * pf, npf: the next tile's offsets (prefetched during the first pass). */
static void da_group(const da_shape *A, const int64_t *off, int64_t n, int64_t g, int64_t pass,
                     float *m, float *l, float *acc, da_work *w, const int64_t *pf,
                     int64_t npf) {
    const int64_t h0 = g * A->group + pass * A->hp, hoff = g * A->Dh, Dp = A->Dp;
    const int64_t nh = A->group - pass * A->hp < A->hp ? A->group - pass * A->hp : A->hp;
    if (pass > 0) {
        npf = 0;
    } else { /* this tile's V lines (prefetched to L2 a tile ago) into L1 during the scores */
        const int64_t elem = A->bf16 ? 2 : 4, bytes = A->Dh * elem;
        for (int64_t i = 0; i < n; i++) {
            const char *v = (const char *)A->cache + (off[i] + A->kbs * A->row + hoff) * elem;
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
        }
    }
    const float *qh = (const float *)w->q + h0 * Dp;
#define DA_DOTS(NH) da_dots(A, off, hoff, n, qh, NH, w->rows, pf, npf)
    DA_BY_HEADS(DA_DOTS)
#undef DA_DOTS
    da_softmax_rows(A, n, nh, w->rows, m + h0, l + h0, acc + h0 * Dp, w->p);
#define DA_VALUES_ROWS(NH) da_values(A, off, hoff, n, w->p, NH, acc + h0 * Dp, pf, npf)
    DA_BY_HEADS(DA_VALUES_ROWS)
#undef DA_VALUES_ROWS
}

#else /* without AVX-512 or AVX2: the same tiles in plain loops */

/* Dh floats of the row at element at (float32 or bfloat16) into out. */
static inline void da_widen(const da_shape *A, int64_t at, float *out) {
    if (A->bf16) {
        const uint16_t *src = (const uint16_t *)A->cache + at;
        for (int64_t d = 0; d < A->Dh; d++) out[d] = hkv_bf16_to_f32(src[d]);
    } else {
        memcpy(out, (const float *)A->cache + at, sizeof(float) * (size_t)A->Dh);
    }
}

static void da_group(const da_shape *A, const int64_t *off, int64_t n, int64_t g, int64_t pass,
                     float *m, float *l, float *acc, da_work *w, const int64_t *pf,
                     int64_t npf) {
    (void)pf, (void)npf;
    const int64_t Dh = A->Dh, Dp = A->Dp, hoff = g * Dh, voff = A->kbs * A->row + hoff;
    const int64_t h0 = g * A->group + pass * A->hp;
    const int64_t nh = A->group - pass * A->hp < A->hp ? A->group - pass * A->hp : A->hp;
    float *x = w->tmp, *sc = w->rows, *p = w->p;
    for (int64_t i = 0; i < n; i++) {
        da_widen(A, off[i] + hoff, x);
        for (int64_t j = 0; j < nh; j++) {
            const float *qh = (const float *)w->q + (h0 + j) * Dp;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < Dh; d++) dot += qh[d] * x[d];
            const float sj = dot * A->scale;
            sc[j * DA_TILE + i] = A->cap > 0.0f ? A->cap * tanhf(sj * A->inv_cap) : sj;
        }
    }
    for (int64_t j = 0; j < nh; j++) {
        const int64_t h = h0 + j;
        float top = sc[j * DA_TILE];
        for (int64_t i = 1; i < n; i++) top = sc[j * DA_TILE + i] > top ? sc[j * DA_TILE + i] : top;
        if (top > m[h]) {
            if (m[h] != -INFINITY) {
                const float alpha = hkv_exp_nonpositive(m[h] - top);
                for (int64_t d = 0; d < Dp; d++) acc[h * Dp + d] *= alpha;
                l[h] *= alpha;
            }
            m[h] = top;
        }
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            p[j * DA_TILE + i] = hkv_exp_nonpositive(sc[j * DA_TILE + i] - m[h]);
            total += p[j * DA_TILE + i];
        }
        l[h] += total;
    }
    for (int64_t i = 0; i < n; i++) {
        da_widen(A, off[i] + voff, x);
        for (int64_t j = 0; j < nh; j++) {
            const float pj = p[j * DA_TILE + i];
            float *a = acc + (h0 + j) * Dp;
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) a[d] += pj * x[d];
        }
    }
}

#endif

/* Positions a .. b - 1 of a request (its query in w->q) into state (see da_state_floats).
 * after, nafter: the offsets of the first positions the thread will read next (another
 * request's), prefetched during the last tile. */
static void da_span(const da_shape *A, int64_t a, int64_t b, float *state, da_work *w,
                    const int64_t *after, int64_t nafter) {
    const int64_t H = A->H;
    float *acc = state, *m = acc + H * A->Dp, *l = m + H;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(H * A->Dp));
    int64_t offs[2][DA_TILE];
    int64_t *off = offs[0], *next = offs[1];
    da_offsets(A, a, b - a < DA_TILE ? b - a : DA_TILE, off);
    for (int64_t t = a; t < b; t += DA_TILE) {
        const int64_t n = b - t < DA_TILE ? b - t : DA_TILE;
        int64_t nn = b - t - n < DA_TILE ? b - t - n : DA_TILE;
        const int64_t *pf = next;
        if (nn > 0) {
            da_offsets(A, t + n, nn, next);
        } else {
            pf = after;
            nn = nafter;
        }
        for (int64_t g = 0; g < A->KVH; g++)
            for (int64_t pass = 0; pass < A->passes; pass++)
                da_group(A, off, n, g, pass, m, l, acc, w, pf, nn);
        int64_t *swap = off;
        off = next;
        next = swap;
    }
}

/* out (one request: [H][Dh], float32 or bfloat16) from k span states at states + i * stride:
 * per head, the states' sums rescaled to their common maximum (and the sink's), divided. */
static void da_finish(const da_shape *A, const float *states, int64_t k, int64_t stride,
                      const float *sinks, void *out, da_work *w) {
    const int64_t H = A->H, Dh = A->Dh, Dp = A->Dp;
    float *x = w->tmp;
    for (int64_t h = 0; h < H; h++) {
        float top = -INFINITY;
        for (int64_t i = 0; i < k; i++) {
            const float mi = states[i * stride + H * Dp + h];
            top = mi > top ? mi : top;
        }
        if (sinks != NULL && sinks[h] > top) top = sinks[h];
        float den = sinks != NULL ? hkv_exp_nonpositive(sinks[h] - top) : 0.0f;
        memset(x, 0, sizeof(float) * (size_t)Dp);
        for (int64_t i = 0; i < k; i++) {
            const float *st = states + i * stride;
            const float wi = hkv_exp_nonpositive(st[H * Dp + h] - top), *acc = st + h * Dp;
            den += wi * st[H * Dp + H + h];
            for (int64_t d = 0; d < Dp; d++) x[d] += wi * acc[d];
        }
        const float inv = 1.0f / den;
#if DA_AVX512
        const __m512 iv = _mm512_set1_ps(inv);
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi =
            _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        for (int64_t d = 0; d < Dh; d += 32) {
            __m512 y0 = _mm512_mul_ps(_mm512_load_ps(x + d), iv);
            __m512 y1 = _mm512_mul_ps(_mm512_load_ps(x + d + 16), iv);
            if (A->bf16) { /* even elements, odd elements -> in order */
                const __m512 e = y0;
                y0 = _mm512_permutex2var_ps(e, lo, y1);
                y1 = _mm512_permutex2var_ps(e, hi, y1);
            }
            const __mmask16 m0 = da_mask16(Dh - d), m1 = da_mask16(Dh - d - 16);
            if (A->bf16) {
                uint16_t *o = (uint16_t *)out + h * Dh + d;
                const __m512 ys[2] = {y0, y1};
                const __mmask16 ms[2] = {m0, m1};
                for (int j = 0; j < 2; j++) { /* round to nearest even; NaN -> 0x7fc0 */
                    const __m512i bits = _mm512_castps_si512(ys[j]);
                    const __m512i odd =
                        _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                    __m512i r = _mm512_srli_epi32(
                        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                        16);
                    const __mmask16 nan = _mm512_cmp_ps_mask(ys[j], ys[j], _CMP_UNORD_Q);
                    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
                    _mm256_mask_storeu_epi16(o + 16 * j, ms[j], _mm512_cvtepi32_epi16(r));
                }
            } else {
                float *o = (float *)out + h * Dh + d;
                _mm512_mask_storeu_ps(o, m0, y0);
                _mm512_mask_storeu_ps(o + 16, m1, y1);
            }
        }
#elif DA_AVX2
        const __m256 iv = _mm256_set1_ps(inv);
        for (int64_t d = 0; d < Dh; d += 16) {
            __m256 y0 = _mm256_mul_ps(_mm256_load_ps(x + d), iv);
            __m256 y1 = _mm256_mul_ps(_mm256_load_ps(x + d + 8), iv);
            if (A->bf16) { /* 8 even elements, 8 odd ones -> in order */
                const __m256 lo = _mm256_unpacklo_ps(y0, y1), hi = _mm256_unpackhi_ps(y0, y1);
                y0 = _mm256_permute2f128_ps(lo, hi, 0x20);
                y1 = _mm256_permute2f128_ps(lo, hi, 0x31);
            }
            const int64_t left = Dh - d;
            if (A->bf16) {
                uint16_t *o = (uint16_t *)out + h * Dh + d;
                uint16_t r[16] __attribute__((aligned(16)));
                _mm_store_si128((__m128i *)r, hkv_f32x8_to_bf16(y0));
                _mm_store_si128((__m128i *)(r + 8), hkv_f32x8_to_bf16(y1));
                memcpy(o, r, sizeof(uint16_t) * (size_t)(left < 16 ? left : 16));
            } else {
                float *o = (float *)out + h * Dh + d;
                _mm256_maskstore_ps(o, hkv_mask8(left), y0);
                _mm256_maskstore_ps(o + 8, hkv_mask8(left - 8), y1);
            }
        }
#else
        for (int64_t d = 0; d < Dh; d++) {
            if (A->bf16)
                ((uint16_t *)out)[h * Dh + d] = hkv_f32_to_bf16(x[d] * inv);
            else
                ((float *)out)[h * Dh + d] = x[d] * inv;
        }
#endif
    }
}

static inline int64_t da_len(int64_t end, int64_t window) {
    return end <= 0 ? 0 : window > 0 && end > window ? window : end;
}

/* Decode attention of S requests (one query each): see the comment at the top of this file. */
void hkv_paged_decode(const void *q, const void *cache, int bf16, int64_t kbs, int64_t KVH,
                      int64_t Dh, int64_t H, const int32_t *block_table, int64_t table_stride,
                      const int32_t *seq_lens, int64_t window, int64_t S, float scale,
                      float softcap, const float *sinks, void *out) {
    if (S <= 0 || H <= 0 || KVH <= 0 || Dh <= 0) return;
    const int64_t elem = bf16 ? 2 : 4, group = H / KVH;
    const int64_t Dp = (Dh + DA_CHUNK - 1) / DA_CHUNK * DA_CHUNK;
    const float cap = softcap > 0.0f ? softcap : 0.0f;
    da_shape base = {cache, block_table, bf16, 0, kbs, KVH, Dh, Dp, H, group, KVH * Dh, 0, 0, 0,
                     scale, cap, cap > 0.0f ? 1.0f / cap : 0.0f};
    int64_t total = 0;
    for (int64_t s = 0; s < S; s++) total += da_len(seq_lens[s], window);
#if DA_AMX
    base.amx = bf16 && Dh % 2 == 0 && total * KVH >= DA_AMX_MIN && hkv_amx_ready();
#endif
    const int64_t most = base.amx ? DA_AMX_HEADS : DA_HEADS; /* query heads per pass */
    base.hp = group < most ? group : most;
    base.passes = (group + base.hp - 1) / base.hp;
    base.nbp = 1;
    while (base.nbp < base.hp) base.nbp *= 2;
    const int64_t stride = da_state_floats(&base);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int parallel = threads > 1 && total * KVH * Dh >= DA_PARALLEL_MIN;
    int64_t piece = INT64_MAX;
    if (parallel) {
        piece = (total + threads * DA_PIECES_PER_THREAD - 1) / (threads * DA_PIECES_PER_THREAD);
        piece = piece < DA_SPLIT_MIN ? DA_SPLIT_MIN : piece;
    }
    /* units: (request, piece); pieces of a split request keep their states in part */
    int64_t units = 0, split = 0, split_requests = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t len = da_len(seq_lens[s], window);
        const int64_t np = len > piece ? (len + piece - 1) / piece : 1;
        units += np;
        if (np > 1) {
            split += np;
            split_requests++;
        }
    }
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)(4 * units + 2 * split_requests + 1));
    float *part = split > 0 ? aligned_alloc(64, sizeof(float) * (size_t)(split * stride)) : NULL;
    if (plan == NULL || (split > 0 && part == NULL)) {
        free(plan);
        free(part);
        return;
    }
    /* unit u: request plan[4u], piece plan[4u + 1] of its np, its state plan[4u + 2] in part
     * (-1: the thread's own), its split request plan[4u + 3] (-1: none); per split request r,
     * the pieces not done yet (left[r]) and its first state (first[r]): the piece that finishes
     * last merges them, so no thread waits for another before the end. */
    int64_t *left = plan + 4 * units, *first = left + split_requests;
    for (int64_t s = 0, u = 0, at = 0, r = 0; s < S; s++) {
        const int64_t len = da_len(seq_lens[s], window);
        const int64_t np = len > piece ? (len + piece - 1) / piece : 1;
        if (np > 1) {
            left[r] = np;
            first[r] = at;
        }
        for (int64_t i = 0; i < np; i++, u++) {
            plan[4 * u] = s;
            plan[4 * u + 1] = i;
            plan[4 * u + 2] = np > 1 ? at++ : -1;
            plan[4 * u + 3] = np > 1 ? r : -1;
        }
        r += np > 1;
    }
#pragma omp parallel if (parallel)
    {
        da_work w = {0};
        const int ok = da_work_alloc(&base, &w);
#if DA_AMX
        if (ok && base.amx) da_tiles(&base);
#endif
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t u = 0; u < units; u++) {
            const int64_t s = plan[4 * u], len = da_len(seq_lens[s], window);
            void *out_s = (char *)out + s * H * Dh * elem;
            if (len <= 0 || !ok) { /* (!ok: out of memory; zeros rather than garbage) */
                memset(out_s, 0, (size_t)(H * Dh * elem));
                continue;
            }
            const int64_t t0 = seq_lens[s] - len, i = plan[4 * u + 1], r = plan[4 * u + 3];
            const int64_t np = len > piece ? (len + piece - 1) / piece : 1;
            da_shape A = base;
            A.table = block_table + s * table_stride;
            da_load_query(&A, (const char *)q + s * H * Dh * elem, &w);
            float *state = r < 0 ? w.state : part + plan[4 * u + 2] * stride;
            /* the next unit's first positions (likely this thread's next, when it has one) */
            int64_t after[DA_TILE], nafter = 0;
            if (u + 1 < units) {
                const int64_t s1 = plan[4 * (u + 1)], len1 = da_len(seq_lens[s1], window);
                const int64_t np1 = len1 > piece ? (len1 + piece - 1) / piece : 1;
                const int64_t i1 = plan[4 * (u + 1) + 1], t1 = seq_lens[s1] - len1;
                const int64_t a1 = t1 + len1 * i1 / np1, b1 = t1 + len1 * (i1 + 1) / np1;
                da_shape A1 = base;
                A1.table = block_table + s1 * table_stride;
                nafter = b1 - a1 < DA_TILE ? b1 - a1 : DA_TILE;
                if (nafter > 0) da_offsets(&A1, a1, nafter, after);
            }
            da_span(&A, t0 + len * i / np, t0 + len * (i + 1) / np, state, &w, after, nafter);
            if (r < 0) {
                da_finish(&A, state, 1, stride, sinks, out_s, &w);
                continue;
            }
            int64_t remaining;
#pragma omp atomic capture seq_cst
            remaining = --left[r];
            if (remaining == 0)
                da_finish(&A, part + first[r] * stride, np, stride, sinks, out_s, &w);
        }
#if DA_AMX
        if (ok && base.amx) _tile_release();
#endif
        if (ok) free(w.block);
    }
    free(plan);
    free(part);
}
