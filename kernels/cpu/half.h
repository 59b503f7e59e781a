/* IEEE half <-> float conversions shared by the kernels that read or write fp16 scales.
 *
 * F16C instructions where the build has them; otherwise (and under ARBOR_QUANT_SCALAR, the
 * tests' portable path) bit-exact C with torch's rounding: to nearest even, overflow to
 * inf, subnormals kept.
 */
#ifndef ARBOR_HALF_H
#define ARBOR_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) && !defined(ARBOR_QUANT_SCALAR)
#include <immintrin.h>
#endif

/* IEEE half -> float (F16C where there is one). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && !defined(ARBOR_QUANT_SCALAR)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while ((m & 0x400) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float -> IEEE half, rounded to nearest even (F16C where there is one; torch's .half()). */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__) && !defined(ARBOR_QUANT_SCALAR)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
    if (abs >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0)); /* inf, nan */
    if (abs >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
    if (abs < 0x38800000) { /* a half subnormal (or zero): round abs / 2^-24 to an integer */
        const float scaled = (float)(abs == 0 ? 0.0 : (double)f * (f < 0 ? -16777216.0 : 16777216.0));
        return (uint16_t)(sign | (uint32_t)lrintf(scaled));
    }
    const uint32_t m = abs + 0xfff + ((abs >> 13) & 1); /* round the 13 dropped bits to even */
    return (uint16_t)(sign | ((m - 0x38000000) >> 13));
#endif
}

#endif /* ARBOR_HALF_H */
