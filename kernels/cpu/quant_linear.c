/* y = x @ W^T for block-quantized weights, the way llama.cpp does Q8_0 x Q4_1:
 * the activations are quantized to int8 in blocks of 32 (one fp32 scale per block), each
 * weight row is a run of unsigned codes with fp16 (scale, offset) per group of blocks, and
 * the inner product of a block is an integer dot product (AVX-512 VNNI `vpdpbusd`, AVX2
 * `vpmaddubsw`, or plain C), scaled once per block.
 *
 * Weight format (kernels/reference/quant.py is its specification):
 *   w[n, k] = d[n, g] * code[n, k] + m[n, g],  g = (k / 32) >> group_shift
 *   codes, 4 bits: [N, Kp / 2] bytes; within each 64-element superblock, byte i holds
 *                  element i in its low nibble and element 32 + i in its high nibble
 *   codes, 8 bits: [N, Kp] bytes (unsigned; Q8_0's signed q is stored as q + 128, m = -128 d)
 *   Kp = K rounded up to a multiple of 64; padded columns have code 0 and meet x = 0.
 * Activations: xq[m, k] = round(x[m, k] / dx[m, b]), dx = max |x| / 127 over block b, so
 *   sum_k w x ~= sum_b dx_b (d_g isum_b + m_g xsum_b),
 *   isum_b = sum_{k in b} code * xq,  xsum_b = sum_{k in b} xq.
 *
 * The instruction set is the compiler's (-march=native at the first build on each machine):
 * AVX-512 F/BW/DQ + VNNI, else AVX2 + FMA + F16C, else portable C. ARBOR_QUANT_NO_AVX512
 * and ARBOR_QUANT_SCALAR force the lower paths (the tests compare all three).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(ARBOR_QUANT_SCALAR)
#include <immintrin.h>
#endif

#if !defined(ARBOR_QUANT_SCALAR) && !defined(ARBOR_QUANT_NO_AVX512) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QPATH_AVX512 1
#elif !defined(ARBOR_QUANT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QPATH_AVX2 1
#endif

#define BLOCK 32
#define MIN_MACS_PER_THREAD (1 << 18)

static int threads_for(int64_t work, int num_threads) {
    const int64_t useful = work / MIN_MACS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

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

/* One row of x (K floats) -> xq [Kp] int8, dx, xsum and xs = dx * xsum [nb] (nb = Kp / 32). */
static void quantize_row(const float *x, int64_t k_len, int64_t nb, int8_t *xq, float *dx,
                         int32_t *xsum, float *xs) {
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * BLOCK;
        const int64_t n = k_len - start < BLOCK ? (k_len - start > 0 ? k_len - start : 0) : BLOCK;
        float amax = 0.0f;
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[start + i]));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < BLOCK; i++) {
            const int8_t q = i < n ? (int8_t)lrintf(x[start + i] * inv) : 0;
            xq[start + i] = q;
            sum += q;
        }
        dx[b] = d;
        xsum[b] = sum;
        xs[b] = d * (float)sum;
    }
}

/* The per-block scales of one (weight row, activation row) pair, s[b] = d[g] * dx[b], and
 * the offset term sum_b m[g] * dx[b] * xsum[b] (xs = dx * xsum). Returns the offset term. */
static inline float row_scales(const uint16_t *d, const uint16_t *mo, int group_shift,
                               const float *dx, const float *xs, int64_t nb, float *s) {
#if defined(QPATH_AVX512)
    if (group_shift == 0) {
        __m512 off = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b += 16) {
            const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
            const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + b));
            const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mo + b));
            _mm512_mask_storeu_ps(s + b, k, _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(k, dx + b)));
            off = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xs + b), off);
        }
        return _mm512_reduce_add_ps(off);
    }
#endif
    float off = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = b >> group_shift;
        s[b] = half_to_float(d[g]) * dx[b];
        off += half_to_float(mo[g]) * xs[b];
    }
    return off;
}

#if defined(QPATH_AVX512)
static inline __m512i load_codes(const uint8_t *w, int bits, int64_t sb) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(w + sb * 64));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + sb * 32));
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#endif

/* sum_b s[b] * isum_b for one weight row (codes w) and one activation row (xq, xsum);
 * s has 16 floats of slack past nb. */
static inline float dot_row(const uint8_t *w, int bits, const int8_t *xq, const int32_t *xsum,
                            const float *s, int64_t nb) {
#if defined(QPATH_AVX512)
    (void)xsum;
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t sb = 0;
    for (; sb + 1 < nb / 2; sb += 2) { /* two independent chains */
        const __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_codes(w, bits, sb),
                                               _mm512_loadu_si512((const void *)(xq + sb * 64)));
        const __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_codes(w, bits, sb + 1),
                                               _mm512_loadu_si512((const void *)(xq + sb * 64 + 64)));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(pick, _mm512_loadu_ps(s + 2 * sb)), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(pick, _mm512_loadu_ps(s + 2 * sb + 2)), acc1);
    }
    for (; sb < nb / 2; sb++) {
        const __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_codes(w, bits, sb),
                                               _mm512_loadu_si512((const void *)(xq + sb * 64)));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(pick, _mm512_loadu_ps(s + 2 * sb)), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(QPATH_AVX2)
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
        __m256i isum;
        if (bits == 4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (b / 2) * 32));
            const __m256i codes = (b & 1) ? _mm256_srli_epi16(v, 4) : v;
            const __m256i wv = _mm256_and_si256(codes, _mm256_set1_epi8(0x0f));
            isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones); /* |pair| <= 3810 */
        } else {
            /* code = q + 128: u8 x s8 pairs would saturate int16, so use the signed q
             * (|q| <= 128, |pair| <= 32512) and add back 128 * xsum. */
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + b * BLOCK)),
                                               _mm256_set1_epi8((char)0x80));
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
            isum = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones),
                                    _mm256_setr_epi32(128 * xsum[b], 0, 0, 0, 0, 0, 0, 0));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s[b]), acc);
    }
    const __m128 lo = _mm256_castps256_ps128(acc), hi = _mm256_extractf128_ps(acc, 1);
    __m128 s4 = _mm_add_ps(lo, hi);
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
#else
    (void)xsum;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t isum = 0;
        const int8_t *xb = xq + b * BLOCK;
        if (bits == 4) {
            const uint8_t *wb = w + (b / 2) * 32;
            const int shift = (b & 1) ? 4 : 0;
            for (int i = 0; i < BLOCK; i++) isum += (int32_t)((wb[i] >> shift) & 0x0f) * xb[i];
        } else {
            const uint8_t *wb = w + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) isum += (int32_t)wb[i] * xb[i];
        }
        acc += s[b] * (float)isum;
    }
    return acc;
#endif
}

#if defined(QPATH_AVX512)
/* Weight row n (codes w, per-block scales wd and offsets wm as floats, 16 floats of slack)
 * against up to 4 activation rows at once: the codes are unpacked once for all of them.
 * dxe: each activation row's scales expanded per superblock, [dx_2sb x 8 | dx_2sb+1 x 8]. */
static inline void dot_rows4(const uint8_t *w, int bits, const float *wd, const float *wm, int64_t nb,
                             const int8_t *xq, int64_t kp, const float *dxe, const float *xs, int jn,
                             float *out) {
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int64_t nsb = nb / 2;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < nsb; sb++) {
        const __m512i wv = load_codes(w, bits, sb);
        const __m512 wdp = _mm512_permutexvar_ps(pick, _mm512_loadu_ps(wd + 2 * sb));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            if (j < jn) {
                const __m512i iv = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(), wv, _mm512_loadu_si512((const void *)(xq + j * kp + sb * 64)));
                const __m512 sc = _mm512_mul_ps(wdp, _mm512_loadu_ps(dxe + (j * nsb + sb) * 16));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), sc, acc[j]);
            }
        }
    }
    for (int j = 0; j < jn; j++) {
        for (int64_t b = 0; b < nb; b += 16) { /* the offset term, m * dx * xsum */
            const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
            acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wm + b), _mm512_maskz_loadu_ps(k, xs + j * nb + b),
                                     acc[j]);
        }
        out[j] = _mm512_reduce_add_ps(acc[j]);
    }
}

/* rows >= 2: every weight row meets the activation rows four at a time. */
static void gemm_avx512(const int8_t *xq, const float *dx, const float *xs, int64_t rows, int64_t kp,
                        const uint8_t *codes, const uint16_t *d, const uint16_t *mo, int64_t n_out,
                        int64_t num_groups, int group_shift, int bits, const float *bias, float *y,
                        float *dxe, int num_threads) {
    const int64_t nb = kp / BLOCK, nsb = nb / 2, row_bytes = bits == 4 ? kp / 2 : kp;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < nsb; sb++)
            for (int i = 0; i < 16; i++) dxe[(r * nsb + sb) * 16 + i] = dx[r * nb + 2 * sb + (i >= 8)];
#pragma omp parallel for num_threads(threads_for(rows * n_out * kp, num_threads)) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        float wd[nb + 16], wm[nb + 16]; /* NOTE: 16 floats of slack for the last vector load */
        for (int64_t b = 0; b < nb + 16; b++) {
            wd[b] = b < nb ? half_to_float(d[n * num_groups + (b >> group_shift)]) : 0.0f;
            wm[b] = b < nb ? half_to_float(mo[n * num_groups + (b >> group_shift)]) : 0.0f;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            const int jn = rows - m0 < 4 ? (int)(rows - m0) : 4;
            float out[4];
            dot_rows4(codes + n * row_bytes, bits, wd, wm, nb, xq + m0 * kp, kp, dxe + m0 * nsb * 16,
                      xs + m0 * nb, jn, out);
            for (int j = 0; j < jn; j++) y[(m0 + j) * n_out + n] = bias != NULL ? out[j] + bias[n] : out[j];
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias). Returns 0, or -1 when scratch memory ran out.
 *   codes: [N, row_bytes] (row_bytes = Kp / 2 or Kp), d, mo: [N, num_groups] fp16 bits. */
int arbor_quant_linear(const float *x, int64_t rows, int64_t k_len, const uint8_t *codes,
                       const uint16_t *d, const uint16_t *mo, int64_t n_out, int64_t kp,
                       int64_t num_groups, int group_shift, int bits, const float *bias, float *y,
                       int num_threads) {
    const int64_t nb = kp / BLOCK, row_bytes = bits == 4 ? kp / 2 : kp;
    int8_t *xq = aligned_alloc(64, (size_t)(rows * kp + 64));
    float *dx = malloc(sizeof(float) * (size_t)(rows * nb));
    float *xs = malloc(sizeof(float) * (size_t)(rows * nb));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(rows * nb));
    if (xq == NULL || dx == NULL || xs == NULL || xsum == NULL) {
        free(xq), free(dx), free(xs), free(xsum);
        return -1;
    }
#pragma omp parallel for num_threads(threads_for(rows * k_len * 16, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k_len, k_len, nb, xq + r * kp, dx + r * nb, xsum + r * nb, xs + r * nb);

#if defined(QPATH_AVX512)
    if (rows >= 2) {
        float *dxe = aligned_alloc(64, sizeof(float) * (size_t)(rows * nb * 8 + 16));
        if (dxe == NULL) {
            free(xq), free(dx), free(xs), free(xsum);
            return -1;
        }
        gemm_avx512(xq, dx, xs, rows, kp, codes, d, mo, n_out, num_groups, group_shift, bits, bias, y,
                    dxe, num_threads);
        free(dxe), free(xq), free(dx), free(xs), free(xsum);
        return 0;
    }
#endif
    /* Each thread takes a contiguous run of weight rows; a tile of 16 weight rows meets
     * every activation row while it is in L1 (a row is <= Kp bytes). */
    const int64_t tile = 16, num_tiles = (n_out + tile - 1) / tile;
#pragma omp parallel for num_threads(threads_for(rows * n_out * kp, num_threads)) schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        float scales[nb + 16]; /* NOTE: 16 floats of slack for the last vector load */
        memset(scales + nb, 0, 16 * sizeof(float));
        const int64_t n_end = (t + 1) * tile < n_out ? (t + 1) * tile : n_out;
        for (int64_t m = 0; m < rows; m++) {
            for (int64_t n = t * tile; n < n_end; n++) {
                const float offset = row_scales(d + n * num_groups, mo + n * num_groups, group_shift,
                                                dx + m * nb, xs + m * nb, nb, scales);
                const float v = dot_row(codes + n * row_bytes, bits, xq + m * kp, xsum + m * nb,
                                        scales, nb) + offset;
                y[m * n_out + n] = bias != NULL ? v + bias[n] : v;
            }
        }
    }
    free(xq), free(dx), free(xs), free(xsum);
    return 0;
}

/* Which path this build took: 2 AVX-512 VNNI, 1 AVX2, 0 portable C. */
int arbor_quant_path(void) {
#if defined(QPATH_AVX512)
    return 2;
#elif defined(QPATH_AVX2)
    return 1;
#else
    return 0;
#endif
}
