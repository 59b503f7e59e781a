/* Paged decode attention for the CPU, fp32: one pass over each request's pages.
 *
 * The torch path gathers every request's K/V into a padded copy and runs SDPA on it, so
 * the keys cross memory three times and padding is computed, then masked. Here each
 * request reads its keys and values once, in place, block by block with an online
 * softmax; every query head reads its KV head's rows of a block while the block is in
 * L2 (GQA costs no extra memory traffic). One request per thread at a time.
 *
 * Layout (see kernels/__init__.py): k, v [num_slots, Hkv, D]; slot = page * page_size +
 * offset; page_table [B, max_pages] int32; seq_lens [B] int32; q, out [B, Hq, D];
 * lse [B, Hq] = natural log-sum-exp of the scaled scores (-inf for an empty row, whose
 * out is 0), so partial results over disjoint key sets merge exactly.
 *
 * Returns 0; 1 when a length or page id is out of range (nothing is read outside the
 * pool; the outputs are then unspecified); 2 for a head_dim or Hq over 256, or Hq % Hkv != 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"

#define BLOCK 32      /* tokens scored between softmax updates */
#define MAX_DIM 256   /* head_dim */
#define MAX_HEADS 256 /* query heads (per-head state lives on the thread's stack) */

static void finish_head(const float *acc, float run_max, float run_sum, int64_t dim, float *out,
                        float *lse) {
    if (run_sum > 0.0f) {
        const float inv = 1.0f / run_sum;
        for (int64_t d = 0; d < dim; d++) out[d] = acc[d] * inv;
        *lse = run_max + logf(run_sum);
    } else {
        memset(out, 0, sizeof(float) * dim);
        *lse = -INFINITY;
    }
}

/* Scalar version for any head_dim (the fallback; the vector copies below cover 64 and 128). */
static int attend_any(const float *q, const float *k, const float *v, const int32_t *pages,
                      int64_t len, int64_t num_pages, int64_t page_size, int64_t hq, int64_t hkv,
                      int64_t dim, float scale, float *out, float *lse) {
    float scores[BLOCK], acc[MAX_DIM];
    const int64_t group = hq / hkv, row = hkv * dim;
    for (int64_t h = 0; h < hq; h++) {
        const int64_t off = (h / group) * dim;
        const float *qh = q + h * dim;
        float run_max = -INFINITY, run_sum = 0.0f;
        memset(acc, 0, sizeof(float) * dim);
        for (int64_t start = 0; start < len; start += BLOCK) {
            const int64_t n = len - start < BLOCK ? len - start : BLOCK;
            float block_max = -INFINITY, block_sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const int64_t pos = start + j, page = pages[pos / page_size];
                if (page < 0 || page >= num_pages) return 1;
                const float *kr = k + (page * page_size + pos % page_size) * row + off;
                float dot = 0.0f;
                for (int64_t d = 0; d < dim; d++) dot += qh[d] * kr[d];
                scores[j] = dot * scale;
                block_max = scores[j] > block_max ? scores[j] : block_max;
            }
            const float new_max = block_max > run_max ? block_max : run_max;
            const float keep = run_max == -INFINITY ? 0.0f : exp_nonpos(run_max - new_max);
            for (int64_t d = 0; d < dim; d++) acc[d] *= keep;
            for (int64_t j = 0; j < n; j++) {
                const int64_t pos = start + j, page = pages[pos / page_size];
                const float *vr = v + (page * page_size + pos % page_size) * row + off;
                const float w = exp_nonpos(scores[j] - new_max);
                block_sum += w;
                for (int64_t d = 0; d < dim; d++) acc[d] += w * vr[d];
            }
            run_sum = run_sum * keep + block_sum;
            run_max = new_max;
        }
        finish_head(acc, run_max, run_sum, dim, out + h * dim, lse + h);
    }
    return 0;
}

/* Vector copies for head_dim 8 * NC: the scores of 8 keys are reduced together (one
 * transpose-add instead of 8 horizontal sums). */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* SHUF(a, b, i0..i7): lanes of the 16-lane concatenation [a, b]. clang and GCC >= 12 have
 * __builtin_shufflevector; older GCC only __builtin_shuffle with a mask vector. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef SHUF
typedef int32_t i8 __attribute__((vector_size(32)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i8){__VA_ARGS__})
#endif

/* [a0..a7] each a vector of partial sums -> the vector of their 8 totals. */
static inline v8 sum8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
#define PAIRS(a, b) (SHUF(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
    v8 b0 = PAIRS(a0, a1), b1 = PAIRS(a2, a3), b2 = PAIRS(a4, a5), b3 = PAIRS(a6, a7);
    /* b0 = [a0 01, a1 01, a0 23, a1 23, a0 45, a1 45, a0 67, a1 67] (pair sums) */
#define QUADS(a, b) (SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    v8 c0 = QUADS(b0, b1), c1 = QUADS(b2, b3);
    /* c0 = [a0 0-3, a1 0-3, a2 0-3, a3 0-3, a0 4-7, a1 4-7, a2 4-7, a3 4-7] */
    return SHUF(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
#undef PAIRS
#undef QUADS
}

/* The K and V rows (all KV heads of a token) of the block at ``start``. Rows past the end
 * of the block (up to a multiple of 8) repeat the first, so 8-key groups never read
 * garbage. Returns the block's token count, or -1 for a page id outside the pool. */
static int64_t block_rows(const float *k, const float *v, const int32_t *pages, int64_t start,
                          int64_t len, int64_t num_pages, int64_t page_size, int64_t row,
                          const float **rows_k, const float **rows_v) {
    const int64_t n = len - start < BLOCK ? len - start : BLOCK;
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = start + j, page = pages[pos / page_size];
        if (page < 0 || page >= num_pages) return -1;
        const int64_t slot = page * page_size + pos % page_size;
        rows_k[j] = k + slot * row;
        rows_v[j] = v + slot * row;
    }
    for (int64_t j = n; j < (n + 7) / 8 * 8; j++) {
        rows_k[j] = rows_k[0];
        rows_v[j] = rows_v[0];
    }
    return n;
}

/* Blocks outer, heads inner: a block's K/V rows (all KV heads, BLOCK tokens) come from
 * memory once and serve every query head from L2. A head's query and accumulator live in
 * NC registers of 8 floats while it works on a block; between blocks they wait in accs. */
#define DEFINE_ATTEND_VEC(NAME, NC)                                                           \
    static int NAME(const float *q, const float *k, const float *v, const int32_t *pages,      \
                    int64_t len, int64_t num_pages, int64_t page_size, int64_t hq, int64_t hkv,\
                    int64_t dim, float scale, float *out, float *lse) {                        \
        const float *bk[BLOCK], *bv[BLOCK]; /* the block's K and V rows */                     \
        float scores[BLOCK], run_max[hq], run_sum[hq];                                         \
        v8 accs[hq][NC];                                                                       \
        const int64_t group = hq / hkv, row = hkv * dim;                                       \
        for (int64_t h = 0; h < hq; h++) {                                                     \
            run_max[h] = -INFINITY;                                                            \
            run_sum[h] = 0.0f;                                                                 \
            for (int c = 0; c < NC; c++) accs[h][c] = (v8){0};                                 \
        }                                                                                      \
        for (int64_t start = 0; start < len; start += BLOCK) {                                 \
            const int64_t n =                                                                  \
                block_rows(k, v, pages, start, len, num_pages, page_size, row, bk, bv);        \
            if (n < 0) return 1;                                                               \
            for (int64_t h = 0; h < hq; h++) {                                                 \
                const int64_t off = (h / group) * dim;                                         \
                v8 qv[NC], acc[NC];                                                            \
                for (int c = 0; c < NC; c++) {                                                 \
                    qv[c] = load8(q + h * dim + 8 * c) * scale;                                \
                    acc[c] = accs[h][c];                                                       \
                }                                                                              \
                for (int64_t j0 = 0; j0 < n; j0 += 8) {                                        \
                    v8 part[8];                                                                \
                    for (int t = 0; t < 8; t++) {                                              \
                        const float *kr = bk[j0 + t] + off;                                    \
                        v8 s = qv[0] * load8(kr);                                              \
                        for (int c = 1; c < NC; c++) s += qv[c] * load8(kr + 8 * c);           \
                        part[t] = s;                                                           \
                    }                                                                          \
                    v8 tot = sum8(part[0], part[1], part[2], part[3], part[4], part[5],        \
                                  part[6], part[7]);                                           \
                    memcpy(scores + j0, &tot, sizeof tot);                                     \
                }                                                                              \
                float block_max = -INFINITY, block_sum = 0.0f;                                 \
                for (int64_t j = 0; j < n; j++)                                                \
                    block_max = scores[j] > block_max ? scores[j] : block_max;                 \
                const float new_max = block_max > run_max[h] ? block_max : run_max[h];         \
                const float keep =                                                             \
                    run_max[h] == -INFINITY ? 0.0f : exp_nonpos(run_max[h] - new_max);         \
                _Pragma("omp simd reduction(+ : block_sum)")                                   \
                for (int64_t j = 0; j < n; j++) {                                              \
                    scores[j] = exp_nonpos(scores[j] - new_max);                               \
                    block_sum += scores[j];                                                    \
                }                                                                              \
                run_sum[h] = run_sum[h] * keep + block_sum;                                    \
                run_max[h] = new_max;                                                          \
                for (int c = 0; c < NC; c++) acc[c] *= keep;                                   \
                for (int64_t j = 0; j < n; j++) {                                              \
                    const float *vr = bv[j] + off;                                             \
                    const float w = scores[j];                                                 \
                    for (int c = 0; c < NC; c++) acc[c] += w * load8(vr + 8 * c);              \
                }                                                                              \
                for (int c = 0; c < NC; c++) accs[h][c] = acc[c];                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t h = 0; h < hq; h++) {                                                     \
            float flat[8 * NC];                                                                \
            memcpy(flat, accs[h], sizeof flat);                                                \
            finish_head(flat, run_max[h], run_sum[h], dim, out + h * dim, lse + h);            \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_ATTEND_VEC(attend_d64, 8)
DEFINE_ATTEND_VEC(attend_d128, 16)

int arbor_decode_attention(const float *q, const float *k, const float *v,
                           const int32_t *page_table, const int32_t *seq_lens, float *out,
                           float *lse, int64_t batch, int64_t hq, int64_t hkv, int64_t dim,
                           int64_t max_pages, int64_t page_size, int64_t num_slots, float scale,
                           int num_threads) {
    if (hkv <= 0 || hq % hkv != 0 || hq > MAX_HEADS || dim > MAX_DIM) return 2;
    const int64_t num_pages = num_slots / page_size;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : bad)
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        if (len < 0 || len > max_pages * page_size) {
            bad = 1;
            continue;
        }
        int (*attend)(const float *, const float *, const float *, const int32_t *, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *) =
            dim == 64 ? attend_d64 : dim == 128 ? attend_d128 : attend_any;
        bad |= attend(q + b * hq * dim, k, v, page_table + b * max_pages, len, num_pages,
                      page_size, hq, hkv, dim, scale, out + b * hq * dim, lse + b * hq);
    }
    return bad;
}
