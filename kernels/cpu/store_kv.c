/* Store the K/V of new tokens into an 8-bit KV pool: each (token, head) row of head_dim
 * floats becomes codes and one scale, in one pass (kernels/reference/kv_quant.py is the
 * spec; the torch path takes ~10 tensor ops per layer for the same):
 *
 *     scale = max|x| / QMAX  (1 for an all-zero row)
 *     int8: code = clamp(round-half-even(x / scale), -127, 127)       QMAX = 127
 *     fp8:  code = e4m3(x / scale), round to nearest even               QMAX = 448
 *
 * x: [T, H, D] with row stride x_stride between tokens (k and v are slices of a fused qkv
 * projection) and D contiguous; codes: [num_slots, H, D]; scales: [num_slots, H];
 * slots: [T] int64. Returns 0, or 1 when a slot lies outside the pool (nothing written
 * for that token).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "arbor_cpu.h"

/* A float in [-448, 448] as the nearest e4m3fn code (ties to even). Normals keep 3 of
 * fp32's 23 mantissa bits (a carry rounds up into the exponent, as it should); below
 * e4m3's smallest normal (2^-6) values are multiples of 2^-9, so the code is the rounded
 * multiple itself (8 = the smallest normal, 0x08, when the rounding carries). */
static uint8_t to_e4m3(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    const float mag = fabsf(x);
    if (mag < 0.015625f) return sign | (uint8_t)nearbyintf(mag * 512.0f);
    bits &= 0x7fffffffu;
    bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & ~0xfffffu;
    const uint32_t exp = (bits >> 23) - 120u, man = (bits >> 20) & 7u;
    return sign | (uint8_t)((exp << 3) | man);
}

void arbor_store_kv_row(const float *x, int64_t dim, int kind, void *codes, float *scale) {
    const float qmax = kind == 1 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; d++) { /* fmaxf's result (NaN ignored), without its libm call */
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / qmax : 1.0f;
    *scale = s;
    for (int64_t d = 0; d < dim; d++) {
        const float q = fminf(fmaxf(x[d] / s, -qmax), qmax);
        if (kind == 1)
            ((int8_t *)codes)[d] = (int8_t)nearbyintf(q);
        else
            ((uint8_t *)codes)[d] = to_e4m3(q);
    }
}

int arbor_store_kv_quant(const float *x, int64_t x_stride, const int64_t *slots, void *codes,
                         float *scales, int kind, int64_t num_tokens, int64_t heads, int64_t dim,
                         int64_t num_slots) {
    int bad = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        for (int64_t h = 0; h < heads; h++)
            arbor_store_kv_row(x + t * x_stride + h * dim, dim, kind,
                               (char *)codes + (slot * heads + h) * dim, scales + slot * heads + h);
    }
    return bad;
}
