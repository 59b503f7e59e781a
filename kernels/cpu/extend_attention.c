/* Paged prefill ("extend") attention for the CPU: the new tokens of each request over its
 * cached prefix and each other, causal, with GQA, an optional sliding window and an
 * optional logit soft-cap, reading the pool's pages in place.
 *
 * Row invariance (docs/invariance.md): a query row's result depends on its own position
 * and keys only, never on how many rows or keys the call holds. Each row walks its keys
 * exactly as the decode kernel walks a decode of that token (decode_attention.c): partials
 * over positions [0, 256), [256, 512), ... merged in order, each an online softmax over
 * blocks of 32 positions on multiples of 32, every block one call of the shared block
 * step (arbor_block_fn). So a prompt prefilled in one call, in chunks, beside other
 * requests, or token by token as decodes, gets the same bits in every row; torch's fused
 * SDPA kernel sums a row in an order that depends on the call's key count.
 *
 * Work items are (request, tile of TILE_ROWS new tokens, KV head); a tile walks the
 * blocks its rows need once, and while one block's K/V rows of the KV head sit in L1 every
 * row of the tile and every query head of the group is stepped over them. A row's running
 * state (accumulator, max, sum per head) lives in the thread's scratch between blocks.
 *
 * Layout as in decode_attention.c; q, out [T, Hq, D] (the new tokens, request after
 * request, qo_indptr [B + 1] their offsets); lse [T, Hq]; prefix_lens, extend_lens [B];
 * new token i of request b sits at position prefix_lens[b] + i and its K/V is stored.
 *
 * Returns 0; 1 for a length, offset or page id out of range; 2 for refused shapes or pool
 * kind; 3 when scratch could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arbor_cpu.h"

#define TILE_ROWS 16
#define BLOCK ARBOR_ATTN_BLOCK
#define CHUNK ARBOR_ATTN_CHUNK
#define MAX_HEADS 256
#define MAX_DIM 256

typedef struct {
    const float *q;
    const void *k, *v;
    const float *ks, *vs;
    int kind;
    ArborBlockFn fn;
    int64_t hq, hkv, dim, num_pages, page_size, window;
    float scale, softcap;
    float *out, *lse;
} Call;

/* One thread's state for a tile: per (row, head of the group) an accumulator, a running
 * max and sum; and one partial of the group's heads for the merge. */
typedef struct {
    float *acc, *run_max, *run_sum, *part, *part_lse;
} Scratch;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Rows [i0, i1) of one request (positions prefix + i, q / out rows qo + i), the query
 * heads of KV head kvh. */
static int extend_tile(const Call *c, const int32_t *pages, int64_t prefix, int64_t qo, int64_t i0,
                       int64_t i1, int64_t kvh, const Scratch *s) {
    const int64_t group = c->hq / c->hkv, dim = c->dim, h0 = kvh * group, rows = i1 - i0;
    const int64_t last = prefix + i1 - 1, lo_tile = arbor_first_visible(prefix + i0 + 1, c->window);
    int64_t slots[BLOCK];
    for (int64_t chunk = 0; chunk < arbor_attn_chunks(last + 1); chunk++) {
        const int64_t c0 = chunk * CHUNK, end = min64(c0 + CHUNK, last + 1);
        for (int64_t r = 0; r < rows; r++) {
            if (chunk >= arbor_attn_chunks(prefix + i0 + r + 1)) continue; /* the row ended before */
            for (int64_t g = 0; g < group; g++) {
                s->run_max[r * group + g] = -INFINITY;
                s->run_sum[r * group + g] = 0.0f;
            }
            memset(s->acc + r * group * dim, 0, sizeof(float) * (size_t)(group * dim));
        }
        for (int64_t start = max64(c0, lo_tile) / BLOCK * BLOCK; start < end; start += BLOCK) {
            const int64_t m = min64(BLOCK, end - start), tile_lo = max64(lo_tile - start, 0);
            if (arbor_block_slots(pages, start, tile_lo, m, c->num_pages, c->page_size, slots) < 0) return 1;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t p = prefix + i0 + r, lo = arbor_first_visible(p + 1, c->window);
                if (start > p || start + BLOCK <= lo) continue;
                /* NOTE: n and j_lo are the decode kernel's for a query at p (keys past n and
                 * before j_lo in this tile's slots are other rows' and never reach a sum) */
                const int64_t n = min64(BLOCK, p + 1 - start), j_lo = max64(lo - start, 0);
                const float *qr = c->q + ((qo + i0 + r) * c->hq + h0) * dim;
                for (int64_t g = 0; g < group; g++)
                    c->fn(qr + g * dim, c->k, c->v, c->ks, c->vs, c->kind, slots, j_lo, n, kvh, c->hkv, dim,
                          c->scale, c->softcap, s->acc + (r * group + g) * dim, &s->run_max[r * group + g],
                          &s->run_sum[r * group + g]);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            if (chunk >= arbor_attn_chunks(prefix + i0 + r + 1)) continue;
            float *o = c->out + ((qo + i0 + r) * c->hq + h0) * dim, *l = c->lse + (qo + i0 + r) * c->hq + h0;
            for (int64_t g = 0; g < group; g++)
                arbor_finish_head(s->acc + (r * group + g) * dim, s->run_max[r * group + g],
                                  s->run_sum[r * group + g], dim, chunk == 0 ? o + g * dim : s->part + g * dim,
                                  chunk == 0 ? l + g : s->part_lse + g);
            if (chunk > 0) arbor_merge_partial(o, l, s->part, s->part_lse, 0, group, dim);
        }
    }
    return 0;
}

static int alloc_scratch(Scratch *s, int64_t group, int64_t dim) {
    const size_t floats = (size_t)(TILE_ROWS * group * (dim + 2) + group * (dim + 1));
    float *mem = malloc(sizeof(float) * floats);
    if (mem == NULL) return 0;
    s->acc = mem;
    s->run_max = s->acc + TILE_ROWS * group * dim;
    s->run_sum = s->run_max + TILE_ROWS * group;
    s->part = s->run_sum + TILE_ROWS * group;
    s->part_lse = s->part + group * dim;
    return 1;
}

int arbor_extend_attention(const float *q, const void *k, const void *v, const float *k_scale,
                           const float *v_scale, int kv_kind, const int32_t *page_table,
                           const int32_t *prefix_lens, const int32_t *extend_lens, const int32_t *qo_indptr,
                           float *out, float *lse, int64_t batch, int64_t num_tokens, int64_t hq, int64_t hkv,
                           int64_t dim, int64_t max_pages, int64_t page_size, int64_t num_slots, float scale,
                           float softcap, int64_t window, int num_threads) {
    if (hkv <= 0 || hq % hkv != 0 || hq > MAX_HEADS || dim > MAX_DIM || page_size <= 0) return 2;
    if (kv_kind != 0 && (k_scale == NULL || v_scale == NULL)) return 2;
    const ArborBlockFn fn = arbor_block_fn(kv_kind, dim);
    if (fn == NULL) return 2;
    /* tiles[b]: the first work tile of request b (tiles of all requests, in order) */
    int64_t *tiles = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    if (tiles == NULL) return 3;
    tiles[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t prefix = prefix_lens[b], ext = extend_lens[b];
        if (prefix < 0 || ext < 0 || prefix + ext > max_pages * page_size || qo_indptr[b] < 0
            || qo_indptr[b + 1] != qo_indptr[b] + ext || qo_indptr[b + 1] > num_tokens) {
            free(tiles);
            return 1;
        }
        tiles[b + 1] = tiles[b] + (ext + TILE_ROWS - 1) / TILE_ROWS;
    }
    const Call call = {q, k, v, k_scale, v_scale, kv_kind, fn, hq, hkv, dim, num_slots / page_size, page_size,
                       window, scale, softcap, out, lse};
    const int64_t group = hq / hkv, items = tiles[batch] * hkv;
    int bad = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
    {
        Scratch s = {NULL, NULL, NULL, NULL, NULL};
        const int ok = alloc_scratch(&s, group, dim);
        if (!ok) bad = 3;
        /* NOTE: the last tiles of a request see the most keys; handing them out first
         * keeps the threads' shares even (dynamic schedule) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
            const int64_t item = items - 1 - it, tile = item / hkv, kvh = item % hkv;
            int64_t b = 0;
            while (tiles[b + 1] <= tile) b++;
            const int64_t i0 = (tile - tiles[b]) * TILE_ROWS, i1 = min64(i0 + TILE_ROWS, extend_lens[b]);
            bad |= extend_tile(&call, page_table + b * max_pages, prefix_lens[b], qo_indptr[b], i0, i1, kvh, &s);
        }
        if (ok) free(s.acc);
    }
    free(tiles);
    return bad;
}
