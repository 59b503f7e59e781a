/* A mixture-of-experts block's experts over block-quantized weights, in one call and one
 * OpenMP region: the rows of a batch sorted by expert (kernels/reference/moe.py is the
 * specification), each expert's SwiGLU MLP over its contiguous rows.
 *
 *   x      [S, H]  rows sorted by expert; expert e owns rows [offsets[e], offsets[e + 1])
 *   gate_up        E * 2I stacked rows [gate (I) | up (I)] per expert, K = H
 *   down           E * H stacked rows, K = I
 *   out    [S, H]  each row through its expert, unweighted (the caller adds them per token)
 *
 * Phases, each a worksharing loop of the one parallel region (its barrier between them):
 *   1. quantize every row of x to int8 blocks (quant_linear.c's arithmetic);
 *   2. gate_up: work items of (expert, CHUNK_ROWS output rows) -> h [S, 2I];
 *   3. per row: silu(gate) * up -> g [S, I], quantized at once;
 *   4. down: work items as in 2 -> out.
 * An item multiplies its expert's rows [n0, n1) with that expert's activation rows only,
 * through arbor_qmatmul_range: the same arithmetic as arbor_quant_linear per expert.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "arbor_cpu.h"

#define CHUNK_ROWS 64 /* output rows per work item: whole 16-row tiles */

int arbor_quant_tiles(void);

/* Expert e's n rows of a stacked weight (tiles of 16 rows are contiguous like rows). */
static ArborQWeight expert_weight(const ArborQWeight *w, int64_t e, int64_t n) {
    ArborQWeight v = *w;
    const int64_t row_bytes = arbor_qweight_row_bytes(w->bits, w->kp, w->tiled);
    v.codes = w->codes + e * n * row_bytes;
    v.d = w->d + e * n * w->num_groups;
    v.m = w->m + e * n * w->num_groups;
    v.bias = NULL;
    v.n_out = n;
    return v;
}

/* Activation rows [lo, hi) of a, as their own ArborQAct (a view, no copy). */
static ArborQAct act_rows(const ArborQAct *a, int64_t lo, int64_t hi) {
    const int64_t nb = a->kp / 32;
    ArborQAct v = *a;
    v.xq = a->xq + lo * a->kp;
    v.dx = a->dx + lo * nb;
    v.xs = a->xs + lo * nb;
    v.xsum = a->xsum + lo * nb;
    v.dxe = a->dxe + lo * (nb / 2) * 16;
    v.rows = hi - lo;
    return v;
}

/* The (expert, first output row) work items of the experts that own rows; returns how many. */
static int64_t plan_items(const int64_t *offsets, int64_t num_experts, int64_t n, int64_t *item_e, int64_t *item_n0) {
    int64_t count = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (offsets[e + 1] == offsets[e]) continue;
        for (int64_t n0 = 0; n0 < n; n0 += CHUNK_ROWS) item_e[count] = e, item_n0[count] = n0, count++;
    }
    return count;
}

void arbor_expert_matmul(const ArborQWeight *w, int64_t num_experts, int64_t e, const ArborQAct *a, int64_t row0,
                         int64_t row1, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const ArborQWeight we = expert_weight(w, e, w->n_out / num_experts);
    const ArborQAct ae = act_rows(a, row0, row1);
    arbor_qmatmul_range(&we, &ae, n0, n1, y, ldy, 0);
}

/* One work item of a grouped matmul: y[rows of expert e, n0 .. n0 + CHUNK_ROWS) of width n. */
static void run_item(const ArborQWeight *w, const ArborQAct *a, const int64_t *offsets, int64_t num_experts,
                     int64_t e, int64_t n0, float *y) {
    const int64_t n = w->n_out / num_experts, n1 = n0 + CHUNK_ROWS < n ? n0 + CHUNK_ROWS : n;
    arbor_expert_matmul(w, num_experts, e, a, offsets[e], offsets[e + 1], n0, n1, y + offsets[e] * n + n0, n);
}

void arbor_route_row(const float *x, const float *router, int64_t hidden, int64_t num_experts, int64_t top_k,
                     int normalize, float *probs, float *weights, int64_t *ids) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < num_experts; e++) {
        const float *w = router + e * hidden;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < hidden; i++) dot += w[i] * x[i];
        probs[e] = dot;
        top = dot > top ? dot : top;
    }
    for (int64_t e = 0; e < num_experts; e++) sum += probs[e] = expf(probs[e] - top);
    for (int64_t e = 0; e < num_experts; e++) probs[e] /= sum;
    float picked = 0.0f;
    for (int64_t j = 0; j < top_k; j++) { /* the largest not yet taken; a tie goes to the lower id */
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = best, weights[j] = probs[best], picked += probs[best];
    }
    if (normalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= picked;
}

/* Returns 0, -1 when scratch memory ran out, -2 for tiled weights in a build without the
 * AVX-512 VNNI path. */
int arbor_moe_experts(const float *x, int64_t rows, const int64_t *offsets, int64_t num_experts,
                      const ArborQWeight *gate_up, const ArborQWeight *down, float *out, int num_threads) {
    if ((gate_up->tiled || down->tiled) && !arbor_quant_tiles()) return -2;
    const int64_t hidden = gate_up->k_len, inter = down->k_len, n_gu = 2 * inter;
    const int64_t max_items = num_experts * ((n_gu > hidden ? n_gu : hidden) + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const size_t bytes_a = arbor_qact_bytes(rows, gate_up->kp), bytes_b = arbor_qact_bytes(rows, down->kp);
    const size_t bytes_h = ((size_t)(rows * (n_gu + inter)) * sizeof(float) + 63) / 64 * 64;
    const size_t bytes_items = 4 * max_items * sizeof(int64_t);
    char *mem = aligned_alloc(64, (bytes_a + bytes_b + bytes_h + bytes_items + 63) / 64 * 64);
    if (mem == NULL) return -1;
    ArborQAct a, b;
    arbor_qact_init(&a, mem, rows, gate_up->kp);
    arbor_qact_init(&b, mem + bytes_a, rows, down->kp);
    float *h = (float *)(mem + bytes_a + bytes_b), *g = h + rows * n_gu;
    int64_t *items = (int64_t *)(mem + bytes_a + bytes_b + bytes_h);
    int64_t *gu_e = items, *gu_n0 = items + max_items, *dn_e = items + 2 * max_items, *dn_n0 = items + 3 * max_items;
    const int64_t num_gu = plan_items(offsets, num_experts, n_gu, gu_e, gu_n0);
    const int64_t num_dn = plan_items(offsets, num_experts, hidden, dn_e, dn_n0);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) arbor_qact_quantize_row(&a, r, x + r * hidden, hidden);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_gu; i++) run_item(gate_up, &a, offsets, num_experts, gu_e[i], gu_n0[i], h);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            arbor_silu_mul_row(h + r * n_gu, h + r * n_gu + inter, g + r * inter, inter);
            arbor_qact_quantize_row(&b, r, g + r * inter, inter);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_dn; i++) run_item(down, &b, offsets, num_experts, dn_e[i], dn_n0[i], out);
    }
    free(mem);
    return 0;
}
