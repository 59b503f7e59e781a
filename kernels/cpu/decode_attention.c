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
 * Quantized pools (kv_kind 1 = int8, 2 = fp8 e4m3): k, v hold 8-bit codes and k_scale,
 * v_scale [num_slots, Hkv] fp32 one scale per row, x = code * scale (kernels/reference/
 * kv_quant.py). Codes become floats in registers; a key's scale multiplies its score once
 * and a value's scale its softmax weight once, so the per-element work is one convert.
 * fp8 codes are decoded through a 256-entry table (no CPU has fp8 arithmetic).
 *
 * Sliding windows and soft-capping (Mistral, Gemma 2/3): with window W > 0 a query at
 * position len - 1 sees positions len - W .. len - 1 only; with softcap c > 0 each scaled
 * score s becomes c * tanh(s / c) before the softmax.
 *
 * Row invariance: a query's result depends on its own key range only. Blocks lie on
 * multiples of BLOCK positions and partials on multiples of ARBOR_ATTN_CHUNK whatever the
 * range (keys before a window's start in its first block are hidden by a select), and
 * one block of one head is one call of the shared block step (arbor_block_fn), which the
 * prefill kernel (extend_attention.c) calls too: a prompt token's attention there has the
 * bits of a decode of that token here.
 *
 * Returns 0; 1 when a length or page id is out of range (nothing is read outside the
 * pool; the outputs are then unspecified); 2 for a head_dim or Hq over 256, Hq % Hkv != 0, or
 * an unknown kv_kind; 3 when a thread's scratch for one partial could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arbor_cpu.h"
#include "fastmath.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK ARBOR_ATTN_BLOCK /* positions scored between softmax updates */
#define MAX_DIM 256   /* head_dim */
#define MAX_HEADS 256 /* query heads (per-head state lives on the thread's stack) */
/* Positions per partial result: a request's output is the exact merge, in order, of its
 * partials over positions [0, 256), [256, 512), ... (arbor_attend_chunked), so the fused
 * decode step, which spreads the partials of one request over threads, computes the same
 * bits as this kernel, whatever the batch and the thread count. */
#define ATTN_CHUNK ARBOR_ATTN_CHUNK

enum { KV_F32 = 0, KV_INT8 = 1, KV_FP8 = 2 };

/* fp8 e4m3fn -> float: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal; 0x7f / 0xff are NaN (no infinities). Filled when the library loads. */
static float fp8_table[256];

__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int b = 0; b < 256; b++) {
        const int exp = (b >> 3) & 15, man = b & 7;
        float x = exp == 0 ? ldexpf((float)man / 8.0f, -6) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
        if ((b & 0x7f) == 0x7f) x = NAN;
        fp8_table[b] = (b & 0x80) ? -x : x;
    }
}

/* Element i of a pool row as a float (the scalar path's loads). */
static inline float elem(const void *row, int kind, int64_t i) {
    if (kind == KV_INT8) return (float)((const int8_t *)row)[i];
    if (kind == KV_FP8) return fp8_table[((const uint8_t *)row)[i]];
    return ((const float *)row)[i];
}

static inline int64_t elem_size(int kind) { return kind == KV_F32 ? 4 : 1; }

ARBOR_SHARED void arbor_finish_head(const float *acc, float run_max, float run_sum, int64_t dim, float *out,
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

/* The scores of a block after the dot products: an 8-bit pool's key scales, the soft-cap,
 * then the keys before j_lo hidden (a select, so garbage there never reaches a sum). */
static inline void finish_scores(float *scores, const int64_t *slots, const float *ks, int64_t kvh, int64_t hkv,
                                 float cap, int64_t j_lo, int64_t n) {
    if (ks != NULL)
        for (int64_t j = 0; j < n; j++) scores[j] *= ks[slots[j] * hkv + kvh];
    if (cap > 0.0f)
        for (int64_t j = 0; j < n; j++) scores[j] = cap * tanh_fast(scores[j] / cap);
    for (int64_t j = 0; j < j_lo; j++) scores[j] = -INFINITY;
}

/* The online-softmax update of one block: returns the factor the accumulator is scaled by;
 * scores become the keys' weights (0 before j_lo). */
static inline float softmax_block(float *scores, int64_t j_lo, int64_t n, float *run_max, float *run_sum) {
    float block_max = -INFINITY, block_sum = 0.0f;
    /* NOTE: a max is exact in any order, so this one may be vectorized freely */
#pragma omp simd reduction(max : block_max)
    for (int64_t j = 0; j < n; j++) block_max = scores[j] > block_max ? scores[j] : block_max;
    const float new_max = block_max > *run_max ? block_max : *run_max;
    const float keep = *run_max == -INFINITY ? 0.0f : exp_nonpos(*run_max - new_max);
#pragma omp simd reduction(+ : block_sum)
    for (int64_t j = 0; j < n; j++) {
        const float w = exp_nonpos(scores[j] - new_max); /* NOTE: then a select, so the loop vectorizes */
        scores[j] = j < j_lo ? 0.0f : w;
        block_sum += scores[j];
    }
    *run_sum = *run_sum * keep + block_sum;
    *run_max = new_max;
    return keep;
}

/* Scalar block step for any head_dim and any pool kind (the fallback; the vector copies
 * below cover head_dim 8 * NC). */
static ARBOR_SHARED void block_any(const float *qh, const void *k, const void *v, const float *ks, const float *vs,
                                   int kind, const int64_t *slots, int64_t j_lo, int64_t n, int64_t kvh,
                                   int64_t hkv, int64_t dim, float scale, float cap, float *acc, float *run_max,
                                   float *run_sum) {
    float scores[BLOCK];
    const int64_t row = hkv * dim, off = kvh * dim, esize = elem_size(kind);
    for (int64_t j = 0; j < n; j++) {
        const char *kr = (const char *)k + (slots[j] * row + off) * esize;
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; d++) dot += qh[d] * elem(kr, kind, d);
        scores[j] = dot * scale;
    }
    finish_scores(scores, slots, ks, kvh, hkv, cap, j_lo, n);
    const float keep = softmax_block(scores, j_lo, n, run_max, run_sum);
    for (int64_t d = 0; d < dim; d++) acc[d] *= keep;
    for (int64_t j = j_lo; j < n; j++) {
        const char *vr = (const char *)v + (slots[j] * row + off) * esize;
        const float wv = scores[j] * (vs ? vs[slots[j] * hkv + kvh] : 1.0f);
        for (int64_t d = 0; d < dim; d++) acc[d] += wv * elem(vr, kind, d);
    }
}

/* Vector copies for head_dim 8 * NC: the scores of 8 keys are reduced together (one
 * transpose-add instead of 8 horizontal sums). */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

typedef int8_t c8 __attribute__((vector_size(8)));

/* NOTE: GCC 12 turns __builtin_convertvector of 8 bytes into 8 scalar converts (10x
 * slower than the fp32 kernel, measured), so AVX2 gets the two-instruction widening. */
static inline v8 load8_int8(const int8_t *p) {
#if defined(__AVX2__)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    c8 x;
    memcpy(&x, p, sizeof x);
    return __builtin_convertvector(x, v8);
#endif
}

/* e4m3 -> fp32 by moving bits: sign to bit 31, the 4 exponent and 3 mantissa bits to
 * bits 20-26 make the fp32 value 2^(e - 127) * 1.m (or 0.m * 2^-126 for e = 0), and one
 * multiply by 2^120 rebiases it to e4m3's 2^(e - 7) * 1.m (0.m * 2^-6): exact for every
 * finite code. (The two NaN codes read as +-480; quantize_kv never writes them.) */
static inline v8 load8_fp8(const uint8_t *p) {
#if defined(__AVX2__)
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f)), 20);
    return (v8)_mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, mag)), _mm256_set1_ps(0x1p120f));
#else
    v8 x;
    for (int i = 0; i < 8; i++) x[i] = fp8_table[p[i]];
    return x;
#endif
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

ARBOR_SHARED int64_t arbor_block_slots(const int32_t *pages, int64_t start, int64_t j_lo, int64_t n,
                                       int64_t num_pages, int64_t page_size, int64_t *slots) {
    for (int64_t j = j_lo; j < n; j++) {
        const int64_t pos = start + j, page = pages[pos / page_size];
        if (page < 0 || page >= num_pages) return -1;
        slots[j] = page * page_size + pos % page_size;
    }
    for (int64_t j = 0; j < j_lo; j++) slots[j] = slots[j_lo];
    for (int64_t j = n; j < (n + 7) / 8 * 8; j++) slots[j] = slots[j_lo];
    return n;
}

/* One block step for head_dim 8 * NC: a head's query and accumulator live in NC registers
 * of 8 floats while it works on the block. T / LOAD8: the pool's element type and its
 * 8-wide load as floats; QUANT: whether rows carry scales (a compile-time constant, so the
 * fp32 copy multiplies by nothing). NC may be a run-time value (at most NC_MAX). */
#define DEFINE_BLOCK_VEC(NAME, NC, NC_MAX, T, LOAD8, QUANT)                                    \
    static ARBOR_SHARED void NAME(const float *qh, const void *kp, const void *vp, const float *ks, \
                                  const float *vs, int kind, const int64_t *slots, int64_t j_lo,  \
                                  int64_t n, int64_t kvh, int64_t hkv, int64_t dim, float scale,  \
                                  float cap, float *acc_mem, float *run_max, float *run_sum) {    \
        const T *k = kp, *v = vp;                                                              \
        const int64_t row = hkv * dim, off = kvh * dim;                                        \
        float scores[BLOCK];                                                                   \
        v8 qv[NC_MAX], acc[NC_MAX];                                                            \
        (void)kind;                                                                            \
        for (int c = 0; c < NC; c++) {                                                         \
            qv[c] = load8(qh + 8 * c) * scale;                                                 \
            acc[c] = load8(acc_mem + 8 * c);                                                   \
        }                                                                                      \
        for (int64_t j0 = 0; j0 < n; j0 += 8) {                                                \
            v8 part[8];                                                                        \
            for (int t = 0; t < 8; t++) {                                                      \
                const T *kr = k + slots[j0 + t] * row + off;                                   \
                v8 s = qv[0] * LOAD8(kr);                                                      \
                for (int c = 1; c < NC; c++) s += qv[c] * LOAD8(kr + 8 * c);                   \
                part[t] = s;                                                                   \
            }                                                                                  \
            v8 tot = sum8(part[0], part[1], part[2], part[3], part[4], part[5], part[6], part[7]); \
            memcpy(scores + j0, &tot, sizeof tot);                                             \
        }                                                                                      \
        finish_scores(scores, slots, QUANT ? ks : NULL, kvh, hkv, cap, j_lo, n);               \
        const float keep = softmax_block(scores, j_lo, n, run_max, run_sum);                   \
        for (int c = 0; c < NC; c++) acc[c] *= keep;                                           \
        for (int64_t j = j_lo; j < n; j++) {                                                   \
            const T *vr = v + slots[j] * row + off;                                            \
            const float w = QUANT ? scores[j] * vs[slots[j] * hkv + kvh] : scores[j];          \
            for (int c = 0; c < NC; c++) acc[c] += w * LOAD8(vr + 8 * c);                      \
        }                                                                                      \
        for (int c = 0; c < NC; c++) memcpy(acc_mem + 8 * c, &acc[c], sizeof(v8));             \
    }

#define NC_ANY (MAX_DIM / 8)
DEFINE_BLOCK_VEC(block_f32_d64, 8, 8, float, load8, 0)
DEFINE_BLOCK_VEC(block_f32_d128, 16, 16, float, load8, 0)
DEFINE_BLOCK_VEC(block_f32_d8n, dim / 8, NC_ANY, float, load8, 0)
DEFINE_BLOCK_VEC(block_int8_d64, 8, 8, int8_t, load8_int8, 1)
DEFINE_BLOCK_VEC(block_int8_d128, 16, 16, int8_t, load8_int8, 1)
DEFINE_BLOCK_VEC(block_int8_d8n, dim / 8, NC_ANY, int8_t, load8_int8, 1)
DEFINE_BLOCK_VEC(block_fp8_d64, 8, 8, uint8_t, load8_fp8, 1)
DEFINE_BLOCK_VEC(block_fp8_d128, 16, 16, uint8_t, load8_fp8, 1)
DEFINE_BLOCK_VEC(block_fp8_d8n, dim / 8, NC_ANY, uint8_t, load8_fp8, 1)

ARBOR_SHARED ArborBlockFn arbor_block_fn(int kind, int64_t dim) {
    if (dim <= 0 || dim > MAX_DIM) return NULL;
    if (dim % 8 != 0) return kind == KV_F32 || kind == KV_INT8 || kind == KV_FP8 ? block_any : NULL;
    switch (kind) {
    case KV_F32: return dim == 64 ? block_f32_d64 : dim == 128 ? block_f32_d128 : block_f32_d8n;
    case KV_INT8: return dim == 64 ? block_int8_d64 : dim == 128 ? block_int8_d128 : block_int8_d8n;
    case KV_FP8: return dim == 64 ? block_fp8_d64 : dim == 128 ? block_fp8_d128 : block_fp8_d8n;
    default: return NULL;
    }
}

/* Query heads [h0, h1) of one request over positions [p0, p1) (declared in arbor_cpu.h).
 * NOTE: blocks lie on multiples of BLOCK positions whatever p0 is (keys before p0 in the
 * first block are hidden), so a query's arithmetic depends on its own key range only. */
int arbor_attend_range(const float *q, const void *k, const void *v, const float *ks,
                       const float *vs, int kind, const int32_t *pages, int64_t p0, int64_t p1,
                       int64_t num_pages, int64_t page_size, int64_t h0, int64_t h1, int64_t hq,
                       int64_t hkv, int64_t dim, float scale, float softcap, float *out, float *lse) {
    if (hkv <= 0 || hq % hkv != 0 || hq > MAX_HEADS || dim > MAX_DIM) return 2;
    if (kind != KV_F32 && (ks == NULL || vs == NULL)) return 2;
    const ArborBlockFn fn = arbor_block_fn(kind, dim);
    if (fn == NULL) return 2;
    int64_t slots[BLOCK];
    float run_max[MAX_HEADS], run_sum[MAX_HEADS];
    float *acc = out; /* NOTE: each head's accumulator is its output row until it is finished */
    const int64_t group = hq / hkv;
    for (int64_t h = h0; h < h1; h++) {
        run_max[h] = -INFINITY;
        run_sum[h] = 0.0f;
        memset(acc + h * dim, 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t start = p0 < p1 ? p0 / BLOCK * BLOCK : p1; start < p1; start += BLOCK) {
        const int64_t n = p1 - start < BLOCK ? p1 - start : BLOCK, j_lo = p0 > start ? p0 - start : 0;
        if (arbor_block_slots(pages, start, j_lo, n, num_pages, page_size, slots) < 0) return 1;
        for (int64_t h = h0; h < h1; h++)
            fn(q + h * dim, k, v, ks, vs, kind, slots, j_lo, n, h / group, hkv, dim, scale, softcap,
               acc + h * dim, &run_max[h], &run_sum[h]);
    }
    for (int64_t h = h0; h < h1; h++)
        arbor_finish_head(acc + h * dim, run_max[h], run_sum[h], dim, out + h * dim, lse + h);
    return 0;
}

ARBOR_SHARED int64_t arbor_attn_chunks(int64_t len) {
    return len <= ATTN_CHUNK ? 1 : (len + ATTN_CHUNK - 1) / ATTN_CHUNK;
}

ARBOR_SHARED void arbor_merge_partial(float *out, float *lse, const float *part, const float *part_lse,
                                      int64_t h0, int64_t h1, int64_t dim) {
    for (int64_t h = h0; h < h1; h++) {
        const float a = lse[h], b = part_lse[h];
        float *o = out + h * dim;
        const float *p = part + h * dim;
        if (b == -INFINITY) continue;
        if (a == -INFINITY) {
            memcpy(o, p, sizeof(float) * (size_t)dim);
            lse[h] = b;
            continue;
        }
        const float top = a > b ? a : b, wa = exp_nonpos(a - top), wb = exp_nonpos(b - top);
        const float inv = 1.0f / (wa + wb);
        for (int64_t d = 0; d < dim; d++) o[d] = (wa * o[d] + wb * p[d]) * inv;
        lse[h] = top + logf(wa + wb);
    }
}

ARBOR_SHARED int64_t arbor_first_visible(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

ARBOR_SHARED int arbor_attend_chunked(const float *q, const void *k, const void *v, const float *ks,
                                      const float *vs, int kind, const int32_t *pages, int64_t len,
                                      int64_t window, int64_t num_pages, int64_t page_size, int64_t h0,
                                      int64_t h1, int64_t hq, int64_t hkv, int64_t dim, float scale,
                                      float softcap, float *out, float *lse, float *tmp) {
    const int64_t chunks = arbor_attn_chunks(len), lo = arbor_first_visible(len, window);
    int bad = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = c * ATTN_CHUNK, p0 = c0 > lo ? c0 : lo;
        const int64_t p1 = c0 + ATTN_CHUNK < len ? c0 + ATTN_CHUNK : len;
        float *o = c == 0 ? out : tmp, *l = c == 0 ? lse : tmp + hq * dim;
        bad |= arbor_attend_range(q, k, v, ks, vs, kind, pages, p0, p1, num_pages, page_size, h0, h1,
                                  hq, hkv, dim, scale, softcap, o, l);
        if (c > 0) arbor_merge_partial(out, lse, tmp, tmp + hq * dim, h0, h1, dim);
    }
    return bad;
}

int arbor_decode_attention(const float *q, const void *k, const void *v, const float *k_scale,
                           const float *v_scale, int kv_kind, const int32_t *page_table,
                           const int32_t *seq_lens, float *out, float *lse, int64_t batch,
                           int64_t hq, int64_t hkv, int64_t dim, int64_t max_pages,
                           int64_t page_size, int64_t num_slots, float scale, float softcap,
                           int64_t window, int num_threads) {
    if (hkv <= 0 || hq % hkv != 0 || hq > MAX_HEADS || dim > MAX_DIM) return 2;
    if (kv_kind != KV_F32 && kv_kind != KV_INT8 && kv_kind != KV_FP8) return 2;
    if (kv_kind != KV_F32 && (k_scale == NULL || v_scale == NULL)) return 2;
    const int64_t num_pages = num_slots / page_size;
    int bad = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
    {
        float *tmp = malloc(sizeof(float) * (size_t)(hq * dim + hq)); /* one chunk's partial */
        if (tmp == NULL) bad = 3;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            const int64_t len = seq_lens[b];
            if (tmp == NULL) continue;
            if (len < 0 || len > max_pages * page_size) {
                bad = 1;
                continue;
            }
            bad |= arbor_attend_chunked(q + b * hq * dim, k, v, k_scale, v_scale, kv_kind,
                                        page_table + b * max_pages, len, window, num_pages, page_size, 0,
                                        hq, hq, hkv, dim, scale, softcap, out + b * hq * dim, lse + b * hq,
                                        tmp);
        }
        free(tmp);
    }
    return bad;
}
