/* Small math shared by the CPU kernels. */
#ifndef ARBOR_FASTMATH_H
#define ARBOR_FASTMATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a score minus its running max, -|g| in SiLU), relative error ~1e-7 (the Taylor
 * remainder on |f| <= ln(2)/2 is 5e-9; the rest is fp32 rounding). Written so that the
 * compiler vectorizes a loop of it: libm's expf is one call per element. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) is still a normal float */
    const float t = x * 1.44269504088896341f; /* x / ln 2 = n + f / ln 2 */
    const float n = __builtin_rintf(t);
    const float f = (t - n) * 0.69314718055994531f; /* |f| <= ln(2) / 2 */
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* tanh(x) from exp_nonpos: (1 - e) / (1 + e) with e = exp(-2|x|), the sign put back;
 * absolute error ~1e-7 (for a soft-cap, whose scores are then multiplied by the cap). */
static inline float tanh_fast(float x) {
    const float a = x < 0.0f ? -x : x;
    const float e = exp_nonpos(-2.0f * a);
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -t : t;
}

#endif
