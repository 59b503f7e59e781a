/* The small per-layer ops of a Llama block for the CPU, fp32, one pass each:
 * residual add + RMSNorm, SiLU(gate) * up, and rotary embedding in place.
 *
 * In torch each of these is 4-10 ops (each a dispatch and a pass over memory); a decode
 * step at batch 32 spent ~10 ms of ~86 in them. The arithmetic follows the torch
 * reference (kernels/reference): fp32 throughout, the same operations in the same order,
 * so results differ only by rounding (the compiler may fuse a multiply-add).
 *
 * Rows are spread over threads only when there is enough work to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "arbor_cpu.h"
#include "fastmath.h"

#define MIN_ELEMENTS_PER_THREAD 16384

static int threads_for(int64_t elements, int num_threads) {
    const int64_t useful = elements / MIN_ELEMENTS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

/* h += x (skipped when x is NULL); out = w * (h / rms(h)). */
void arbor_add_rms_norm_row(const float *x, float *h, const float *weight, float *out,
                            int64_t hidden, float eps) {
    float sum_sq = 0.0f;
    if (x != NULL) {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < hidden; i++) {
            h[i] += x[i];
            sum_sq += h[i] * h[i];
        }
    } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < hidden; i++) sum_sq += h[i] * h[i];
    }
    const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) out[i] = weight[i] * (h[i] * inv);
}

/* out[i] = silu(g[i]) * u[i], silu(g) = g * sigmoid(g). */
void arbor_silu_mul_row(const float *g, const float *u, float *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float e = exp_nonpos(-fabsf(g[i])); /* exp(-|g|), never overflows */
        const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        out[i] = g[i] * sig * u[i];
    }
}

/* Rotate `heads` consecutive heads (NeoX layout: the two halves of a head are the pair):
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. cos, sin: [D/2] of one position. */
void arbor_rotary_row(float *x, const float *cos, const float *sin, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/* residual[r] += x[r] (skipped when x is NULL); out[r] = w * (residual[r] / rms(residual[r])). */
void arbor_add_rms_norm(const float *x, float *residual, const float *weight, float *out,
                        int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * hidden, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        arbor_add_rms_norm_row(x != NULL ? x + r * hidden : NULL, residual + r * hidden, weight,
                               out + r * hidden, hidden, eps);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. */
void arbor_silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter,
                        int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        arbor_silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
}

/* Rotate the first `heads` heads of each token in place. cos, sin: [T, D/2]. */
void arbor_rotary(float *x, int64_t row_stride, const float *cos, const float *sin,
                  int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens * heads * head_dim, num_threads)) \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        arbor_rotary_row(x + t * row_stride, cos + t * half, sin + t * half, heads, head_dim);
}
