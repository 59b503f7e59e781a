/* The serial building blocks that the CPU kernels share.
 *
 * Each kernel file exports its own parallel entry point (``arbor_quant_linear``,
 * ``arbor_decode_attention``, ...) for the layer-by-layer path, and the pieces declared
 * here, which run on the calling thread only. The fused decode step (decode_step.c) is
 * compiled together with those files and calls the pieces from inside its one parallel
 * region, so both paths run the same arithmetic.
 */
#ifndef ARBOR_CPU_H
#define ARBOR_CPU_H

#include <stddef.h>
#include <stdint.h>

/* NOTE: every shared piece is compiled out of line, so the layer-by-layer kernel that
 * calls it from its own file and the fused step that calls it from decode_step.c run the
 * same machine code: inlined into a caller, the compiler may contract a different set of
 * multiply-adds, and the two paths' results would differ in their last bits. */
#define ARBOR_SHARED __attribute__((noinline))

/* ---- quant_linear.c: block-quantized weights (kernels/reference/quant.py) ---------------- */

/* One weight, as QuantizedWeight holds it: w[n, k] = d[n, g] * code[n, k] + m[n, g], in
 * rows or in tiles of 16 rows (quant_linear.c, "Tiles of 16 rows"). */
typedef struct {
    const uint8_t *codes;  /* [n_out, kp / 2] (4 bits), [n_out, kp / 64 * 40] (5), [n_out, kp] (8 bits), [n_out, kp / 256 * 208] (6 bits: Q6_K) */
    const uint16_t *d;     /* [n_out, num_groups] fp16 bits */
    const uint16_t *m;     /* [n_out, num_groups] fp16 bits */
    const float *bias;     /* [n_out] or NULL */
    int64_t n_out, k_len, kp, num_groups;
    int32_t group_shift, bits; /* g = (k / 32) >> group_shift; bits 4, 5, 6 or 8 */
    int32_t tiled;             /* codes, d and m in tiles of 16 rows (AVX-512 VNNI builds only) */
} ArborQWeight;

/* Bytes of codes per weight row of `bits` (4, 5, 6, 8) and padded width kp (a tile's / 16). */
ARBOR_SHARED int64_t arbor_qweight_row_bytes(int bits, int64_t kp, int tiled);

/* Activation rows quantized to int8 per block of 32 for weights of padded width kp. */
typedef struct {
    int8_t *xq;     /* [rows, kp] */
    float *dx;      /* [rows, nb] block scales */
    float *xs;      /* [rows, nb] dx * sum of the block's codes */
    int32_t *xsum;  /* [rows, nb] sum of the block's codes */
    int32_t *xsum16; /* [rows, 2 nb] sum of each half block's codes (Q6_K's sub-blocks of 16) */
    float *dxe;     /* [rows, nb / 2, 16]: per superblock, dx of its 2 blocks, 8 lanes each */
    int64_t rows, kp;
} ArborQAct;

/* Bytes of an ArborQAct's arrays for `rows` rows of width kp (64-byte aligned pieces). */
ARBOR_SHARED size_t arbor_qact_bytes(int64_t rows, int64_t kp);
/* Lay the arrays out in `mem` (64-byte aligned, arbor_qact_bytes long). */
ARBOR_SHARED void arbor_qact_init(ArborQAct *a, void *mem, int64_t rows, int64_t kp);
/* Quantize row r from x (k_len floats; columns past k_len are zero). */
ARBOR_SHARED void arbor_qact_quantize_row(ArborQAct *a, int64_t r, const float *x, int64_t k_len);
/* y[m * ldy + (n - n0)] (+)= sum_k w[n, k] x[m, k] (+ bias[n]) for n in [n0, n1) and every
 * activation row m; `accumulate` adds into y instead of storing. Serial. */
ARBOR_SHARED void arbor_qmatmul_range(const ArborQWeight *w, const ArborQAct *a, int64_t n0, int64_t n1, float *y,
                         int64_t ldy, int accumulate);

/* ---- decode_attention.c: paged decode attention ------------------------------------------ */

/* Query heads [h0, h1) of one request over its positions [p0, p1): out[h] (normalized
 * over those positions) and lse[h] (log-sum-exp of the scaled, soft-capped scores there;
 * -inf and a zero out for an empty range). q, out: [Hq, D]; lse: [Hq]; pages: the
 * request's page table; softcap 0: none. Returns 0, 1 for a page id outside the pool, 2
 * for arguments the kernel refuses. */
ARBOR_SHARED int arbor_attend_range(const float *q, const void *k, const void *v, const float *k_scale,
                       const float *v_scale, int kv_kind, const int32_t *pages, int64_t p0,
                       int64_t p1, int64_t num_pages, int64_t page_size, int64_t h0, int64_t h1,
                       int64_t hq, int64_t hkv, int64_t dim, float scale, float softcap, float *out,
                       float *lse);

/* A request's attention is the merge, in order, of partials over positions [0, 256),
 * [256, 512), ... (each cut to the query's window): how many partials a query at position
 * len - 1 has. */
ARBOR_SHARED int64_t arbor_attn_chunks(int64_t len);
/* Positions [c * 256, min((c + 1) * 256, len)) of partial c. */
#define ARBOR_ATTN_CHUNK 256
/* Positions per block of the online softmax (blocks start at multiples of it). */
#define ARBOR_ATTN_BLOCK 32
/* The first position a query at position len - 1 sees (window 0: none, so 0). */
ARBOR_SHARED int64_t arbor_first_visible(int64_t len, int64_t window);
/* Merge partial (part, part_lse) into (out, lse) for heads [h0, h1); all [Hq, D] / [Hq]. */
ARBOR_SHARED void arbor_merge_partial(float *out, float *lse, const float *part, const float *part_lse,
                                      int64_t h0, int64_t h1, int64_t dim);
/* Heads [h0, h1) of one request over its last min(len, window) positions (window 0: all
 * len), partial by partial (chunk 0 into out / lse, each later one into tmp [Hq * D + Hq]
 * and merged). Returns as arbor_attend_range. */
ARBOR_SHARED int arbor_attend_chunked(const float *q, const void *k, const void *v, const float *k_scale,
                                      const float *v_scale, int kv_kind, const int32_t *pages,
                                      int64_t len, int64_t window, int64_t num_pages, int64_t page_size,
                                      int64_t h0, int64_t h1, int64_t hq, int64_t hkv, int64_t dim,
                                      float scale, float softcap, float *out, float *lse, float *tmp);

/* The block step: one head of one query over the keys of one BLOCK-position block, an
 * online-softmax update of (acc [D], run_max, run_sum). slots: the block's pool slots (a
 * multiple of 8 of them readable); keys [j_lo, n) are visible. One function per pool kind
 * and head_dim, so every caller computes a query's block with the same instructions. */
typedef void (*ArborBlockFn)(const float *q, const void *k, const void *v, const float *k_scale,
                             const float *v_scale, int kv_kind, const int64_t *slots, int64_t j_lo,
                             int64_t n, int64_t kvh, int64_t hkv, int64_t dim, float scale, float softcap,
                             float *acc, float *run_max, float *run_sum);
/* The block step for a pool kind and head_dim (NULL: refused). */
ARBOR_SHARED ArborBlockFn arbor_block_fn(int kv_kind, int64_t dim);
/* Slots [j_lo, n) of the block at position `start` from the page table; the others (up to
 * a multiple of 8) repeat slot j_lo. Returns n, or -1 for a page id outside the pool. */
ARBOR_SHARED int64_t arbor_block_slots(const int32_t *pages, int64_t start, int64_t j_lo, int64_t n,
                                       int64_t num_pages, int64_t page_size, int64_t *slots);
/* out = acc / run_sum, lse = run_max + log(run_sum) (zeros and -inf when run_sum is 0). */
ARBOR_SHARED void arbor_finish_head(const float *acc, float run_max, float run_sum, int64_t dim, float *out,
                                    float *lse);

/* ---- store_kv.c: one (token, head) row into an 8-bit pool (kind 1 int8, 2 fp8) ----------- */
ARBOR_SHARED void arbor_store_kv_row(const float *x, int64_t dim, int kind, void *codes, float *scale);

/* ---- moe_experts.c: a mixture-of-experts block (kernels/reference/moe.py) ---------------- */
/* Rows [n0, n1) of expert e's share (n_out / num_experts rows) of the stacked weight w
 * times activation rows [row0, row1) of a: y[(r - row0) * ldy + (n - n0)]. Serial. */
ARBOR_SHARED void arbor_expert_matmul(const ArborQWeight *w, int64_t num_experts, int64_t e, const ArborQAct *a,
                                      int64_t row0, int64_t row1, int64_t n0, int64_t n1, float *y, int64_t ldy);
/* One token's route: the router's logits router[E, H] . x, their softmax (into probs [E]),
 * the top_k largest (ids, weights [top_k]; a tie goes to the lower id), renormalized to
 * sum to 1 when `normalize`. */
ARBOR_SHARED void arbor_route_row(const float *x, const float *router, int64_t hidden, int64_t num_experts,
                                  int64_t top_k, int normalize, float *probs, float *weights, int64_t *ids);

/* ---- elementwise.c: one row at a time ---------------------------------------------------- */
/* h += x (x may be NULL); out = w * h / rms(h). */
ARBOR_SHARED void arbor_add_rms_norm_row(const float *x, float *h, const float *weight, float *out,
                            int64_t hidden, float eps);
/* out[i] = silu(g[i]) * u[i]. */
ARBOR_SHARED void arbor_silu_mul_row(const float *g, const float *u, float *out, int64_t n);
/* Rotate `heads` heads of head_dim at x (head stride head_dim) by one position's cos, sin. */
ARBOR_SHARED void arbor_rotary_row(float *x, const float *cos, const float *sin, int64_t heads, int64_t head_dim);

#endif
