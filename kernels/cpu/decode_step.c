/* A whole decode forward pass of a Llama-family model with block-quantized weights, in one
 * call: the CPU's analogue of the CUDA graphs that SGLang and vLLM capture for decode.
 *
 * The layer-by-layer path runs ~12 kernels per layer, each a Python call, a dispatch, an
 * OpenMP fork/join and a pass over memory; at batch 1 on the default model that overhead
 * was ~14 of a 23 ms step (measured), more than the matmuls. Here every op of every layer
 * runs inside one OpenMP parallel region, phases separated by barriers, with the same
 * serial pieces the layer-by-layer kernels use (arbor_cpu.h), so the arithmetic is theirs:
 *
 *   h = embeddings                                   (the caller looks them up)
 *   per layer:  x = quantize(rms_norm(h))            rows over threads
 *               qkv = Wqkv x (+ bias)                output rows over threads
 *               rotate q, k; store k, v in the pool  rows over threads
 *               attention partials                   (request, KV head, chunk) over threads
 *               x = quantize(merge(partials))        rows over threads
 *               h += Wo x                            output rows over threads
 *               x = quantize(rms_norm(h))
 *               a = silu(Wgate x) * (Wup x)          output rows over threads (fused)
 *               x = quantize(a)
 *               h += Wdown x
 *   logits = Whead quantize(rms_norm(h))
 *
 * A layer with experts (Qwen3-MoE, Mixtral) replaces the MLP's four lines by the experts
 * block of moe_experts.c, phase by phase (experts_step): the router's top-k per token,
 * the (token, expert) rows sorted by expert, each expert's SwiGLU over its rows in work
 * items of (expert, 64 output rows), and h += each token's weighted sum of its rows.
 *
 * Attention's work items are (request, KV head, 256-position partial), so one long request
 * spreads over every thread; the partials merge in order exactly as the layer-by-layer
 * kernel merges them (arbor_attend_chunked), so both paths compute the same bits.
 *
 * Every residual add happens in h (the o and down projections accumulate into it), which
 * is the caller's [B, hidden] buffer; the layer-by-layer path's fused add + norm computes
 * the same sums in the same order.
 *
 * NOTE: the phases meet at a spinning barrier of our own, not OpenMP's. libgomp makes its
 * waiting threads sleep after ~1000 spins once it manages more threads than there are
 * CPUs, which it does as soon as a second thread (the engine's) opens a parallel region
 * beside the main thread's: each of the ~300 barriers of a step then costs a futex wake,
 * and a batch-1 step took 17.3 ms instead of 8.0 (measured, 2 threads). The team is forked
 * once per step; between phases nobody sleeps (a waiter yields its core after a while, so
 * an oversubscribed machine still makes progress).
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "arbor_cpu.h"
#include "fastmath.h"

#define TILE 16      /* weight rows per work item of a matmul (a tile of the tiled layout) */
#define MLP_CHUNK 64 /* gate (and up) rows per call: the tiled kernel's 4 tiles at a time */
#define SPINS_BEFORE_YIELD 4096

/* A sense-reversing barrier shared by the team of one step. */
typedef struct {
    atomic_int arrived, sense;
} SpinBarrier;

/* One thread's view of the team: its index, the team size, and the barrier. */
typedef struct {
    int tid, size, sense;
    SpinBarrier *barrier;
} Team;

static void team_sync(Team *t) {
    if (t->size == 1) return;
    t->sense = !t->sense;
    if (atomic_fetch_add(&t->barrier->arrived, 1) == t->size - 1) {
        atomic_store(&t->barrier->arrived, 0);
        atomic_store(&t->barrier->sense, t->sense); /* releases everyone's writes */
        return;
    }
    for (int spins = 0; atomic_load(&t->barrier->sense) != t->sense;) {
        CPU_RELAX();
        if (++spins == SPINS_BEFORE_YIELD) spins = 0, sched_yield();
    }
}

/* This thread's contiguous share [lo, hi) of n items. */
static void share(const Team *t, int64_t n, int64_t *lo, int64_t *hi) {
    *lo = n * t->tid / t->size;
    *hi = n * (t->tid + 1) / t->size;
}

typedef struct {
    ArborQWeight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    void *k, *v;                         /* this layer's pool, [num_slots, Hkv, D] */
    float *k_scale, *v_scale;            /* [num_slots, Hkv] of an 8-bit pool, else NULL */
    int64_t window;                      /* attend to the last `window` positions (0: all) */
    /* experts (num_experts > 0): gate_up, down hold every expert's rows stacked
     * (moe_experts.c); router [num_experts, hidden] fp32 */
    const float *router;
    int64_t num_experts, top_k;
    int32_t normalize_topk; /* renormalize the top-k probabilities */
    const float *q_norm, *k_norm; /* [head_dim]: RMSNorm over each q and k head before the rotary (Qwen 3), or NULL */
} ArborDecodeLayer;

typedef struct {
    int64_t num_layers, hidden, inter, num_heads, num_kv_heads, head_dim, vocab; /* inter: the dense MLPs' */
    float eps, attn_scale, attn_softcap; /* softcap 0: none */
    int32_t kv_kind; /* 0 fp32, 1 int8, 2 fp8 e4m3 */
    int64_t num_slots, page_size;
    const ArborDecodeLayer *layers; /* [num_layers] */
    const float *final_norm;        /* [hidden] */
    ArborQWeight lm_head;
} ArborDecodeModel;

/* Where each piece of the scratch memory lies for a batch (all offsets 64-byte aligned). */
typedef struct {
    int64_t chunks, qkv_width, tmp_floats; /* chunks: attention partials per request, at most */
    size_t qkv, part_out, part_lse, mlp, act_h, act_o, act_i, tmp;
    /* the experts' (experts_step), sized by the first layer with experts (all alike) */
    int64_t max_items;
    size_t xn, probs, sel_w, sel_e, row_token, row_w, token_rows, offsets, items, act_s, g, act_g, y, total;
} Layout;

static size_t align64(size_t n) { return (n + 63) / 64 * 64; }

/* The first layer with (or without) experts, or NULL. */
static const ArborDecodeLayer *first_layer(const ArborDecodeModel *m, int experts) {
    for (int64_t i = 0; i < m->num_layers; i++)
        if ((m->layers[i].num_experts > 0) == experts) return &m->layers[i];
    return NULL;
}

static Layout layout_for(const ArborDecodeModel *m, int64_t batch, int64_t max_len, int num_threads) {
    Layout l;
    const int64_t hq_d = m->num_heads * m->head_dim;
    l.chunks = arbor_attn_chunks(max_len);
    l.qkv_width = hq_d + 2 * m->num_kv_heads * m->head_dim;
    const int64_t row = m->hidden > hq_d ? m->hidden : hq_d;
    l.tmp_floats = row + 2 * batch * MLP_CHUNK;
    size_t at = 0;
#define PLACE(FIELD, BYTES) l.FIELD = at, at += align64(BYTES)
    PLACE(qkv, 4 * (size_t)(batch * l.qkv_width));
    PLACE(part_out, 4 * (size_t)(batch * l.chunks * hq_d));
    PLACE(part_lse, 4 * (size_t)(batch * l.chunks * m->num_heads));
    const ArborDecodeLayer *dense = first_layer(m, 0), *moe = first_layer(m, 1);
    PLACE(mlp, 4 * (size_t)(batch * m->inter));
    PLACE(act_h, arbor_qact_bytes(batch, m->layers[0].qkv.kp));
    PLACE(act_o, arbor_qact_bytes(batch, m->layers[0].o.kp));
    PLACE(act_i, dense == NULL ? 0 : arbor_qact_bytes(batch, dense->down.kp));
    PLACE(tmp, 4 * (size_t)(num_threads * l.tmp_floats));
    const int64_t e = moe == NULL ? 0 : moe->num_experts, k = moe == NULL ? 0 : moe->top_k, rows = batch * k;
    const int64_t inter = moe == NULL ? 0 : moe->down.k_len, widest = inter > m->hidden ? inter : m->hidden;
    l.max_items = e * ((widest + MLP_CHUNK - 1) / MLP_CHUNK);
    PLACE(xn, 4 * (size_t)(batch * m->hidden));
    PLACE(probs, 4 * (size_t)(batch * e));
    PLACE(sel_w, 4 * (size_t)rows);
    PLACE(sel_e, 8 * (size_t)rows);
    PLACE(row_token, 8 * (size_t)rows);
    PLACE(row_w, 4 * (size_t)rows);
    PLACE(token_rows, 8 * (size_t)rows);
    PLACE(offsets, 8 * (size_t)(e + 1));
    PLACE(items, 8 * (size_t)(4 * l.max_items + 2));
    PLACE(act_s, moe == NULL ? 0 : arbor_qact_bytes(rows, moe->gate_up.kp));
    PLACE(g, 4 * (size_t)(rows * inter));
    PLACE(act_g, moe == NULL ? 0 : arbor_qact_bytes(rows, moe->down.kp));
    PLACE(y, 4 * (size_t)(rows * m->hidden));
#undef PLACE
    l.total = at;
    return l;
}

/* Bytes of scratch memory arbor_decode_step needs for this batch size, longest sequence
 * (seq_lens' largest) and thread count. */
int64_t arbor_decode_scratch_bytes(const ArborDecodeModel *m, int64_t batch, int64_t max_len, int num_threads) {
    return (int64_t)layout_for(m, batch, max_len, num_threads).total;
}

/* Output rows [0, n_out) of w, TILE-row tiles shared over the team (one contiguous run,
 * in one call, per thread); y row stride ldy. */
static void matmul(Team *team, const ArborQWeight *w, const ArborQAct *a, float *y, int64_t ldy,
                   int accumulate) {
    int64_t lo, hi;
    share(team, (w->n_out + TILE - 1) / TILE, &lo, &hi);
    const int64_t n0 = lo * TILE, n1 = hi * TILE < w->n_out ? hi * TILE : w->n_out;
    if (n0 < n1) arbor_qmatmul_range(w, a, n0, n1, y + n0, ldy, accumulate);
    team_sync(team);
}

/* a = quantize(rms_norm(h) * weight), rows over the team. */
static void norm_quantize(Team *team, const ArborDecodeModel *m, float *h, const float *weight,
                          ArborQAct *a, int64_t batch, float *tmp) {
    int64_t lo, hi;
    share(team, batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) {
        arbor_add_rms_norm_row(NULL, h + b * m->hidden, weight, tmp, m->hidden, m->eps);
        arbor_qact_quantize_row(a, b, tmp, m->hidden);
    }
    team_sync(team);
}

/* Each of `heads` heads of x (head_dim apart) through RMSNorm with `weight`, as the
 * layer-by-layer norm does it row by row (tmp: head_dim floats). */
static void norm_heads(float *x, int64_t heads, int64_t dim, const float *weight, float eps, float *tmp) {
    for (int64_t h = 0; h < heads; h++) {
        arbor_add_rms_norm_row(NULL, x + h * dim, weight, tmp, dim, eps);
        memcpy(x + h * dim, tmp, sizeof(float) * (size_t)dim);
    }
}

/* Norm q and k heads (when the layer has q/k norms), rotate them, and store each row's k,
 * v in its pool slot (checked by the caller). */
static void rotate_and_store(Team *team, const ArborDecodeModel *m, const ArborDecodeLayer *layer,
                             float *qkv, int64_t width, const float *cos, const float *sin,
                             const int64_t *slots, int64_t batch, float *tmp) {
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads, dim = m->head_dim, half = dim / 2;
    int64_t lo, hi;
    share(team, batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) {
        float *row = qkv + b * width, *k = row + hq * dim, *v = k + hkv * dim;
        if (layer->q_norm != NULL) {
            norm_heads(row, hq, dim, layer->q_norm, m->eps, tmp);
            norm_heads(k, hkv, dim, layer->k_norm, m->eps, tmp);
        }
        arbor_rotary_row(row, cos + b * half, sin + b * half, hq + hkv, dim);
        const int64_t slot = slots[b];
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t at = slot * hkv + h;
            if (m->kv_kind == 0) {
                memcpy((float *)layer->k + at * dim, k + h * dim, sizeof(float) * (size_t)dim);
                memcpy((float *)layer->v + at * dim, v + h * dim, sizeof(float) * (size_t)dim);
            } else {
                arbor_store_kv_row(k + h * dim, dim, m->kv_kind, (int8_t *)layer->k + at * dim, layer->k_scale + at);
                arbor_store_kv_row(v + h * dim, dim, m->kv_kind, (int8_t *)layer->v + at * dim, layer->v_scale + at);
            }
        }
    }
    team_sync(team);
}

typedef struct {
    int64_t batch, max_pages;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *page_table, *seq_lens;
} StepInputs;

/* Attention of every request for one layer, written as quantized o-projection input. */
static int attention(Team *team, const ArborDecodeModel *m, const ArborDecodeLayer *layer,
                     const Layout *l, char *scratch, const StepInputs *in, ArborQAct *act_o) {
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads, dim = m->head_dim, group = hq / hkv;
    const int64_t chunks = l->chunks, items = in->batch * hkv * chunks;
    const float *qkv = (const float *)(scratch + l->qkv);
    float *part_out = (float *)(scratch + l->part_out), *part_lse = (float *)(scratch + l->part_lse);
    const int64_t num_pages = m->num_slots / m->page_size;
    int bad = 0;
    /* NOTE: items (request, KV head, partial) interleave over the team (item i to thread
     * i % size), so a long request's partials spread over every thread. */
    for (int64_t item = team->tid; item < items; item += team->size) {
        const int64_t b = item / (hkv * chunks), kvh = (item / chunks) % hkv, c = item % chunks;
        const int64_t len = in->seq_lens[b], lo = arbor_first_visible(len, layer->window);
        if (c >= arbor_attn_chunks(len)) continue;
        /* NOTE: a partial wholly before the window is empty (a zero out, lse -inf), as in
         * arbor_attend_chunked; the merge skips it */
        const int64_t c0 = c * ARBOR_ATTN_CHUNK, p0 = c0 > lo ? c0 : lo;
        const int64_t p1 = c0 + ARBOR_ATTN_CHUNK < len ? c0 + ARBOR_ATTN_CHUNK : len;
        const int status = arbor_attend_range(
            qkv + b * l->qkv_width, layer->k, layer->v, layer->k_scale, layer->v_scale, m->kv_kind,
            in->page_table + b * in->max_pages, p0, p1, num_pages, m->page_size, kvh * group,
            (kvh + 1) * group, hq, hkv, dim, m->attn_scale, m->attn_softcap,
            part_out + (b * chunks + c) * hq * dim, part_lse + (b * chunks + c) * hq);
        if (status != 0) bad = status; /* this thread's; the region ORs them */
    }
    team_sync(team);
    int64_t lo, hi;
    share(team, in->batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) { /* partial 0 becomes the output; the rest merge into it in order */
        float *out = part_out + b * chunks * hq * dim, *lse = part_lse + b * chunks * hq;
        for (int64_t c = 1; c < arbor_attn_chunks(in->seq_lens[b]); c++)
            arbor_merge_partial(out, lse, out + c * hq * dim, lse + c * hq, 0, hq, dim);
        arbor_qact_quantize_row(act_o, b, out, hq * dim);
    }
    team_sync(team);
    return bad;
}

/* The rows of a batch's (token, expert) pairs sorted by expert, by token within one
 * (kernels/reference/moe.py group_by_expert), and the work items of both matmuls; run by
 * one thread. items: [count_gu, count_down, (e, n0) pairs of gate_up..., of down...]. */
static void group_rows(const ArborDecodeLayer *layer, const Layout *l, char *scratch, int64_t batch,
                       int64_t hidden) {
    const int64_t e_num = layer->num_experts, k = layer->top_k, inter = layer->down.k_len;
    const int64_t *sel_e = (const int64_t *)(scratch + l->sel_e);
    const float *sel_w = (const float *)(scratch + l->sel_w);
    int64_t *row_token = (int64_t *)(scratch + l->row_token), *token_rows = (int64_t *)(scratch + l->token_rows);
    int64_t *offsets = (int64_t *)(scratch + l->offsets), *items = (int64_t *)(scratch + l->items);
    float *row_w = (float *)(scratch + l->row_w);
    int64_t s = 0, num_gu = 0, num_down = 0;
    int64_t *gu = items + 2, *down = gu + 2 * l->max_items;
    for (int64_t e = 0; e < e_num; e++) {
        offsets[e] = s;
        for (int64_t b = 0; b < batch; b++)
            for (int64_t j = 0; j < k; j++)
                if (sel_e[b * k + j] == e) row_token[s] = b, row_w[s] = sel_w[b * k + j], s++;
        if (s == offsets[e]) continue;
        for (int64_t n0 = 0; n0 < inter; n0 += MLP_CHUNK) gu[2 * num_gu] = e, gu[2 * num_gu + 1] = n0, num_gu++;
        for (int64_t n0 = 0; n0 < hidden; n0 += MLP_CHUNK)
            down[2 * num_down] = e, down[2 * num_down + 1] = n0, num_down++;
    }
    offsets[e_num] = s;
    int64_t seen[batch];
    for (int64_t b = 0; b < batch; b++) seen[b] = 0;
    for (int64_t r = 0; r < s; r++) token_rows[row_token[r] * k + seen[row_token[r]]++] = r; /* ascending */
    items[0] = num_gu, items[1] = num_down;
}

/* h += sum over j of y[rows[j]] * w[rows[j]], summed from zero in the order of rows, then
 * added: the reference's products, index_add and residual add, each rounded on its own
 * (no multiply-add contracted). */
__attribute__((optimize("fp-contract=off"))) static void combine_row(const float *y, const float *w,
                                                                      const int64_t *rows, int64_t k,
                                                                      int64_t hidden, float *sum, float *h) {
    for (int64_t i = 0; i < hidden; i++) sum[i] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float *row = y + rows[j] * hidden, weight = w[rows[j]];
        for (int64_t i = 0; i < hidden; i++) sum[i] += row[i] * weight;
    }
    for (int64_t i = 0; i < hidden; i++) h[i] += sum[i];
}

/* h += the experts block of norm(h) for the batch (moe_experts.c's arithmetic, with the
 * route of arbor_route_row); the team runs it together. */
static void experts_step(Team *team, const ArborDecodeModel *m, const ArborDecodeLayer *layer, const Layout *l,
                         char *scratch, int64_t batch, float *h, float *tmp) {
    const int64_t hidden = m->hidden, e_num = layer->num_experts, k = layer->top_k, inter = layer->down.k_len;
    const int64_t rows = batch * k;
    float *xn = (float *)(scratch + l->xn), *probs = (float *)(scratch + l->probs);
    float *g = (float *)(scratch + l->g), *y = (float *)(scratch + l->y);
    const float *row_w = (const float *)(scratch + l->row_w);
    const int64_t *row_token = (const int64_t *)(scratch + l->row_token);
    const int64_t *token_rows = (const int64_t *)(scratch + l->token_rows);
    const int64_t *offsets = (const int64_t *)(scratch + l->offsets), *items = (const int64_t *)(scratch + l->items);
    ArborQAct act_s, act_g;
    arbor_qact_init(&act_s, scratch + l->act_s, rows, layer->gate_up.kp);
    arbor_qact_init(&act_g, scratch + l->act_g, rows, layer->down.kp);
    int64_t lo, hi;
    share(team, batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) {
        arbor_add_rms_norm_row(NULL, h + b * hidden, layer->post_norm, xn + b * hidden, hidden, m->eps);
        arbor_route_row(xn + b * hidden, layer->router, hidden, e_num, k, layer->normalize_topk, probs + b * e_num,
                        (float *)(scratch + l->sel_w) + b * k, (int64_t *)(scratch + l->sel_e) + b * k);
    }
    team_sync(team);
    if (team->tid == 0) group_rows(layer, l, scratch, batch, hidden);
    team_sync(team);
    share(team, rows, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) arbor_qact_quantize_row(&act_s, r, xn + row_token[r] * hidden, hidden);
    team_sync(team);
    /* gate rows [n0, n1) of an expert and its up rows [inter + n0, inter + n1), as the
     * dense MLP's chunks, for the expert's rows */
    const int64_t *gu = items + 2, *down = gu + 2 * l->max_items;
    float *gate = tmp + (l->tmp_floats - 2 * batch * MLP_CHUNK), *up = gate + batch * MLP_CHUNK;
    share(team, items[0], &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const int64_t e = gu[2 * i], n0 = gu[2 * i + 1], n1 = n0 + MLP_CHUNK < inter ? n0 + MLP_CHUNK : inter;
        const int64_t r0 = offsets[e], r1 = offsets[e + 1];
        arbor_expert_matmul(&layer->gate_up, e_num, e, &act_s, r0, r1, n0, n1, gate, MLP_CHUNK);
        arbor_expert_matmul(&layer->gate_up, e_num, e, &act_s, r0, r1, inter + n0, inter + n1, up, MLP_CHUNK);
        for (int64_t r = r0; r < r1; r++)
            arbor_silu_mul_row(gate + (r - r0) * MLP_CHUNK, up + (r - r0) * MLP_CHUNK, g + r * inter + n0, n1 - n0);
    }
    team_sync(team);
    share(team, rows, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) arbor_qact_quantize_row(&act_g, r, g + r * inter, inter);
    team_sync(team);
    share(team, items[1], &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const int64_t e = down[2 * i], n0 = down[2 * i + 1], n1 = n0 + MLP_CHUNK < hidden ? n0 + MLP_CHUNK : hidden;
        arbor_expert_matmul(&layer->down, e_num, e, &act_g, offsets[e], offsets[e + 1], n0, n1,
                            y + offsets[e] * hidden + n0, hidden);
    }
    team_sync(team);
    /* NOTE: a token's rows are added in expert order, from zero, then into h: the
     * reference's combine and the next layer's residual add */
    share(team, batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) combine_row(y, row_w, token_rows + b * k, k, hidden, tmp, h + b * hidden);
    team_sync(team);
}

/* One decoder layer for the batch; the team runs it together. */
static int layer_step(Team *team, const ArborDecodeModel *m, const ArborDecodeLayer *layer,
                      const Layout *l, char *scratch, const StepInputs *in, float *h, ArborQAct *act_h,
                      ArborQAct *act_o, ArborQAct *act_i, float *tmp) {
    const int64_t batch = in->batch, inter = m->inter;
    float *qkv = (float *)(scratch + l->qkv), *mlp = (float *)(scratch + l->mlp);
    norm_quantize(team, m, h, layer->input_norm, act_h, batch, tmp);
    matmul(team, &layer->qkv, act_h, qkv, l->qkv_width, 0);
    rotate_and_store(team, m, layer, qkv, l->qkv_width, in->cos, in->sin, in->slots, batch, tmp);
    const int bad = attention(team, m, layer, l, scratch, in, act_o);
    matmul(team, &layer->o, act_o, h, m->hidden, 1);
    if (layer->num_experts > 0) {
        experts_step(team, m, layer, l, scratch, batch, h, tmp);
        return bad;
    }
    norm_quantize(team, m, h, layer->post_norm, act_h, batch, tmp);
    /* gate rows [n0, n1) and their up rows [inter + n0, inter + n1), MLP_CHUNK rows at a
     * time, over this thread's TILE-row tiles */
    float *gate = tmp + (l->tmp_floats - 2 * batch * MLP_CHUNK), *up = gate + batch * MLP_CHUNK;
    int64_t lo, hi;
    share(team, (inter + TILE - 1) / TILE, &lo, &hi);
    const int64_t end = hi * TILE < inter ? hi * TILE : inter;
    for (int64_t n0 = lo * TILE; n0 < end; n0 += MLP_CHUNK) {
        const int64_t n1 = n0 + MLP_CHUNK < end ? n0 + MLP_CHUNK : end;
        arbor_qmatmul_range(&layer->gate_up, act_h, n0, n1, gate, MLP_CHUNK, 0);
        arbor_qmatmul_range(&layer->gate_up, act_h, inter + n0, inter + n1, up, MLP_CHUNK, 0);
        for (int64_t b = 0; b < batch; b++)
            arbor_silu_mul_row(gate + b * MLP_CHUNK, up + b * MLP_CHUNK, mlp + b * inter + n0, n1 - n0);
    }
    team_sync(team);
    share(team, batch, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) arbor_qact_quantize_row(act_i, b, mlp + b * inter, inter);
    team_sync(team);
    matmul(team, &layer->down, act_i, h, m->hidden, 1);
    return bad;
}

/* The whole decode step. h: [B, hidden] embeddings of the new tokens (overwritten: it
 * holds the residual stream); cos, sin: [B, D/2] of each token's position; slots: [B] pool
 * slot of each new token; page_table: [B, max_pages]; seq_lens: [B] tokens in the pool
 * after this step's (the new one included); logits: [B, vocab]. scratch: at least
 * arbor_decode_scratch_bytes(m, B, num_threads) bytes, 64-byte aligned.
 * Returns 0; 1 for a slot, length or page id outside the pool; 2 for a refused shape;
 * 3 for too little scratch. */
int arbor_decode_step(const ArborDecodeModel *m, int64_t batch, float *h, const float *cos,
                      const float *sin, const int64_t *slots, const int32_t *page_table,
                      int64_t max_pages, const int32_t *seq_lens, float *logits, void *scratch,
                      int64_t scratch_bytes, int num_threads) {
    if (batch <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (slots[b] < 0 || slots[b] >= m->num_slots) return 1;
        if (seq_lens[b] < 1 || seq_lens[b] > max_pages * m->page_size) return 1;
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    }
    const Layout l = layout_for(m, batch, max_len, num_threads);
    if ((int64_t)l.total > scratch_bytes) return 3;
    char *mem = scratch;
    ArborQAct act_h, act_o, act_i;
    arbor_qact_init(&act_h, mem + l.act_h, batch, m->layers[0].qkv.kp);
    arbor_qact_init(&act_o, mem + l.act_o, batch, m->layers[0].o.kp);
    const ArborDecodeLayer *dense = first_layer(m, 0);
    arbor_qact_init(&act_i, mem + l.act_i, batch, dense == NULL ? 32 : dense->down.kp);
    const StepInputs in = {batch, max_pages, cos, sin, slots, page_table, seq_lens};
    SpinBarrier barrier;
    atomic_init(&barrier.arrived, 0);
    atomic_init(&barrier.sense, 0);
    int bad = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
    {
        /* NOTE: the team's size is what OpenMP gave, which can be fewer than asked */
        Team team = {omp_get_thread_num(), omp_get_num_threads(), 0, &barrier};
        float *tmp = (float *)(mem + l.tmp) + team.tid * l.tmp_floats;
        for (int64_t i = 0; i < m->num_layers; i++)
            bad |= layer_step(&team, m, &m->layers[i], &l, mem, &in, h, &act_h, &act_o, &act_i, tmp);
        norm_quantize(&team, m, h, m->final_norm, &act_h, batch, tmp);
        matmul(&team, &m->lm_head, &act_h, logits, m->vocab, 0);
    }
    return bad;
}
